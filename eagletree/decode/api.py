"""The one-call API: `generate` (one prompt, a list decoded in batches, or a stream of text) and `decode_steps`
(the tokens of each pass), with the Decoder of `generate`'s last call kept for the next call like it."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidType, InvalidValue
from .config import DecodeConfig
from .decoder import Decoder, check_parts
from .prompts import is_token_ids
from .resources import COMPANION_FILES
from .stats import GenerationStats


def decode_steps(
    target,
    tokenizer,
    head,
    prompt,
    stats: GenerationStats | None = None,
    *,
    inspect_step=None,
    config: DecodeConfig | None = None,
    **options,
):
    """Yield the tokens each target pass emits (a list per pass) decoding one prompt; records every pass in
    `stats`. `config`, or `options` (DecodeConfig's fields, or the flat names `generate` takes); `options` also
    take `Decoder`'s profile, calibrator and copy_calibration, and inspect_step is `Decoder.steps`'."""
    decoder_args = _decoder_args(options, ("profile", "calibrator", "copy_calibration"))
    decoder = Decoder(target, tokenizer, head, _config(config, options), **decoder_args)
    return (step.tokens for step in decoder.steps(prompt, stats, inspect_step))


def generate(
    target,
    tokenizer,
    head,
    prompt_or_messages,
    stream: bool = False,
    config: DecodeConfig | None = None,
    *,
    inspect_step=None,
    batch_size: int = 8,
    **options,
):
    """Lossless speculative generation. Returns a GenerationResult, or with stream=True an iterator of text pieces.

    `config` (a DecodeConfig), or `options`: its fields (tree, budget, depth, top_k_draft, max_new_tokens, stop,
    truncate_prompt, ...) or the flat names temperature, top_k, top_p, seed, copy, copy_spans, copy_len, store.
    The defaults are chosen by device (DecodeConfig: the cost-aware `auto` tree, 60 nodes on a GPU, 8 on a CPU).
    A prompt is chat messages, a string or token ids (a list of ints, or an integer tensor of shape [n] or [1, n]).
    A list of prompts (strings, message lists, token-id lists) returns a list of results, decoded `batch_size` at a
    time in shared target passes (`Decoder.results`: one budget for the batch's trees, continuous batching), and a
    call like the last one (same models and options, not streamed) reuses its Decoder:
    building one (the latency profile's probe, the datastore's index) costs a share of a short answer's time.
    `options` also take profile and calibrator, as `Decoder` takes them; inspect_step: as `Decoder.steps` takes it.
    """
    decoder_args = _decoder_args(options, ("profile", "calibrator"))
    decoder = _decoder(target, tokenizer, head, stream, decoder_args, _config(config, options))
    if (
        isinstance(prompt_or_messages, list)
        and prompt_or_messages
        and not isinstance(prompt_or_messages[0], dict)
        and not is_token_ids(prompt_or_messages)
    ):
        if stream:
            raise InvalidValue("stream=True takes one prompt at a time")
        if inspect_step is not None:  # (it inspects one sequence's drafter at a time)
            return [decoder.generate(p, inspect_step=inspect_step) for p in prompt_or_messages]
        return decoder.generate_batch(prompt_or_messages, batch_size)
    return decoder.generate(prompt_or_messages, stream=stream, inspect_step=inspect_step)


def _decoder(target, tokenizer, head, stream: bool, decoder_args: dict, config: DecodeConfig) -> Decoder:
    """`generate`'s Decoder: the last call's when this one is like it, else a new one (a stream's, or one given a
    profile or calibrator, is never kept)."""
    check_parts(head, config)  # (before the kept Decoder's key reads them)
    if stream or any(value is not None for value in decoder_args.values()):
        return Decoder(target, tokenizer, head, config, **decoder_args)
    return _LAST.decoder_for(target, tokenizer, head, config)


def _decoder_args(options: dict, names: tuple[str, ...]) -> dict:
    """Those of `names` (Decoder's keywords) that `options` holds, taken out of it."""
    return {name: options.pop(name) for name in names if name in options}


class _LastDecoder:
    """The Decoder of `generate`'s last call, for the next call with the same target (on the same device, in the
    same dtype), tokenizer, head (its vocabulary and device too), config and files (the head's companion files and
    a datastore file, as they are on disk now). One slot: it keeps at most one set of models alive. A streamed call
    builds its own, so two interleaved streams never share a searcher."""

    def __init__(self):
        self.key, self.decoder = None, None

    def decoder_for(self, target, tokenizer, head, config: DecodeConfig) -> Decoder:
        """The kept Decoder when the call is like the last one, else a new one, kept."""
        weight = next(target.parameters())
        head_state = None
        if head is not None:
            head_weight = next(head.parameters())
            head_state = (id(head), head_weight.device, head_weight.dtype, head.drafted_vocab_size())
        key = (id(target), weight.device, weight.dtype, id(tokenizer), head_state, config, _files_read(head, config))
        try:
            hash(key)
        except TypeError:  # a config holding an unhashable value: not kept
            return Decoder(target, tokenizer, head, config)
        if key != self.key:
            self.key, self.decoder = None, None  # (a failed build keeps nothing)
            self.decoder = Decoder(target, tokenizer, head, config)
            self.key = key
        return self.decoder


_LAST = _LastDecoder()


def _files_read(head, config: DecodeConfig) -> tuple:
    """The files a Decoder of `head` and `config` may read, each with its size and time of change (None: absent)."""
    paths = [] if head is None or head.folder is None else [head.folder / name for name in COMPANION_FILES]
    if isinstance(config.copy.datastore, (str, Path)) and config.copy.datastore != "auto":
        paths.append(Path(config.copy.datastore))
    stamps = []
    for path in paths:
        try:
            stat = path.stat()
            stamps.append((str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino))
        except OSError:
            stamps.append((str(path), None))
    return tuple(stamps)


def _config(config: DecodeConfig | None, options: dict) -> DecodeConfig:
    """`config`, or one built from keyword options (not both)."""
    if config is not None and options:
        raise InvalidType(f"pass a DecodeConfig or keyword options, not both (got config and {sorted(options)})")
    return config if config is not None else DecodeConfig.from_options(**options)

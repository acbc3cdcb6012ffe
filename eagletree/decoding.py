"""Speculative generation: draft a tree with the head, verify it in one target pass, accept, commit.

A `Decoder` holds one target, tokenizer, head and `DecodeConfig`, and what they resolve to once (the tree
kind's searcher, the device's latency profile, the head's calibrations and datastore); `Decoder.steps`
runs the decoding step of docs/design.md in a loop, one `Step` per target pass, and `Decoder.generate`
returns the text and the statistics people tune with (tokens per pass, predicted vs measured, where the
time went). `generate` and `decode_steps` are the one-call forms.
"""

from __future__ import annotations

import numbers
import time
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .decode_config import DecodeConfig, TreeKind
from .decode_resources import (
    COMPANION_FILES,
    head_calibrator,
    head_copy_calibration,
    latency_profile,
    resolve_store,
)
from .draft_heads import make_drafter
from .target import new_cache
from .tree_search.copy import CopyCalibration, NgramIndex, copy_only, copy_trie
from .tree_search.searchers import make_searcher
from .tree_search.store import TokenStore
from .verify import DraftTree, prefill, verify_step


@dataclass
class GenerationStats:
    new_tokens: int = 0
    passes: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per pass
    predicted: list[float] = field(default_factory=list)  # the tree's E[tokens/pass] per pass
    times: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("prefill", "draft", "search", "verify", "accept", "commit"), 0.0)
    )
    seconds: float = 0.0
    steps: list | None = None  # (DraftTree, accepted node indices) per pass, when asked for (calibration)
    copied_tokens: int = 0  # accepted draft tokens that only a copied span proposed (not the head too)

    def record(self, step) -> None:
        """Count one decoding Step."""
        self.passes += 1
        self.new_tokens += len(step.tokens)
        self.accepted_lengths.append(step.length)
        self.predicted.append(step.draft.expected_tokens)
        for k, v in step.times.items():
            self.times[k] += v
        self.copied_tokens += step.copied
        if self.steps is not None:
            self.steps.append((step.draft, step.accepted))

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.passes if self.passes else 0.0

    @property
    def predicted_tokens_per_pass(self) -> float:
        return sum(self.predicted) / len(self.predicted) if self.predicted else 0.0

    def histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for n in self.accepted_lengths:
            hist[n] = hist.get(n, 0) + 1
        return dict(sorted(hist.items()))

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "passes": self.passes,
            "tokens_per_pass": self.tokens_per_pass,
            "predicted_tokens_per_pass": self.predicted_tokens_per_pass,
            "accepted_histogram": self.histogram(),
            "copied_tokens": self.copied_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds else 0.0,
            "times": dict(self.times),
        }


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats


def is_token_ids(prompt) -> bool:
    """Whether `prompt` is one prompt of token ids: a list or tuple of integers."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(_is_int(t) for t in prompt)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def encode_prompt(tokenizer, prompt) -> torch.Tensor:
    """Chat messages (through the chat template), a plain string, or token ids (a 1-D or [1, n] integer tensor, a
    list of ints) -> 1-D ids."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise TypeError(f"a prompt tensor holds token ids: expected an integer dtype, got {prompt.dtype}")
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(
                f"a prompt tensor is one sequence of token ids, shape [n] or [1, n], got "
                f"{list(prompt.shape)}; decode a batch as a list of prompts"
            )
        ids = prompt.flatten().long()
    elif is_token_ids(prompt):
        ids = torch.tensor([int(t) for t in prompt], dtype=torch.long)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        ids = tokenizer.apply_chat_template(
            list(prompt), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"][0]
    elif isinstance(prompt, str):
        ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
    else:
        raise TypeError(f"prompt must be chat messages, a string or token ids, got {type(prompt).__name__}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty")
    return ids


def check_token_ids(target, ids: torch.Tensor) -> None:
    """ValueError unless every id is a row of the target's embedding."""
    vocab = target.get_input_embeddings().num_embeddings
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"prompt token ids must lie in [0, {vocab}) (the target's vocabulary), got {low if low < 0 else high}"
        )


def stop_token_ids(target, tokenizer, stop=None) -> list[int]:
    """The target's end-of-sequence ids and the tokenizer's, plus `stop`: token ids, or strings that are one token
    each (a token as the tokenizer writes it, e.g. "<|im_end|>", or text that encodes to one token, e.g. "\\n")."""
    ids = set()
    eos = target.generation_config.eos_token_id
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if stop is None:
        return sorted(ids)
    if isinstance(stop, (str, int)) or not isinstance(stop, (list, tuple, set)):
        raise TypeError(f"stop must be a list of token ids or token strings, got {stop!r}")
    vocab = target.get_input_embeddings().num_embeddings
    for s in stop:
        if _is_int(s):
            if not 0 <= int(s) < vocab:
                raise ValueError(f"stop token id {s} is outside the target's vocabulary [0, {vocab})")
            ids.add(int(s))
        elif isinstance(s, str) and s:
            ids.add(_one_token(tokenizer, s))
        else:
            raise TypeError(f"stop entries must be token ids or non-empty token strings, got {s!r}")
    return sorted(ids)


def _one_token(tokenizer, text: str) -> int:
    """The id of the token `text` (as the vocabulary writes it, or as text that encodes to exactly one token)."""
    if tokenizer is None:
        raise ValueError(f"stop {text!r}: a stop string needs the tokenizer; pass token ids instead")
    token = tokenizer.convert_tokens_to_ids(text)
    if token is not None and (token != tokenizer.unk_token_id or text == tokenizer.unk_token):
        return int(token)
    encoded = tokenizer(text, add_special_tokens=False).input_ids
    if len(encoded) != 1:
        raise ValueError(
            f"stop {text!r} is {len(encoded)} tokens ({encoded}), not one; stop takes single tokens "
            f"(a stop on longer text needs a check on the decoded text)"
        )
    return int(encoded[0])


def hf_generation_config(max_new_tokens: int, temperature: float, eos_token_id, top_k=None, top_p=None, **extra):
    """A transformers GenerationConfig for plain decoding as eagletree decodes: every logits-shaping value set
    (`generate` fills the unset ones from the model's own generation_config, where a repetition_penalty or a
    top_k would make "plain decoding" another decoder than the one compared against)."""
    from transformers import GenerationConfig

    sample = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        do_sample=sample,
        temperature=temperature if sample else 1.0,
        top_k=(top_k or 0) if sample else 50,
        top_p=(top_p or 1.0) if sample else 1.0,
        typical_p=1.0,
        min_p=None,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        **extra,
    )


@dataclass
class Step:
    """One target pass: what it emitted, the tree it verified, and where its time went."""

    tokens: list[int]  # emitted by this pass (cut at max_new_tokens)
    draft: DraftTree
    accepted: list[int]  # accepted node indices, root first
    times: dict[str, float]  # seconds: draft, search, verify, accept, commit
    length: int = 0  # tokens the pass produced, before the max_new_tokens cut
    copied: int = 0  # accepted draft tokens that only a copied span proposed
    stopped: bool = False  # a stop token was emitted


class _Sequence:
    """One sequence being decoded: the target's KV cache, the drafter and what it has not read yet, the copy index.

    Committed (features, next tokens) wait in `pending` until the drafter drafts: it catches up in one
    call right before, so steps that do not draft (tree="auto" pausing) cost it nothing.
    """

    def __init__(
        self, target, head, ids: torch.Tensor, copy_calibration: CopyCalibration | None, store: TokenStore | None = None
    ):
        self.layers = head.fused_layers if head is not None else None  # EAGLE-3 reads these target layers
        self.cache = new_cache(target)
        out = prefill(target, self.cache, ids[:-1], layers=self.layers)
        self.drafter = make_drafter(head, target) if head is not None else None
        self.pending = []
        if self.drafter is not None and out is not None:
            layer_hidden = out.layer_hidden and {k: v[0] for k, v in out.layer_hidden.items()}
            self.pending.append((_features(out.hidden[0], layer_hidden, self.layers), ids[1:]))
        self.calibration = copy_calibration
        self.index = NgramIndex(ids.tolist()) if copy_calibration is not None else None  # prompt + emitted tokens
        self.store = store  # a corpus copied from too (retrieved spans), or None
        self.draft_s = 0.0  # the drafter's seconds in the current step

    def expand(self, root: int, inspect_step=None):
        """The drafter caught up on the committed tokens, as the searches' timed `expand`."""
        t = time.perf_counter()
        self.drafter.extend(torch.cat([f for f, _ in self.pending]), torch.cat([n for _, n in self.pending]))
        self.pending.clear()
        self.draft_s += time.perf_counter() - t
        if inspect_step is not None:
            inspect_step(self.drafter, root)
            self.drafter.begin_tree()

        def expand(nodes, tokens, parents, level):
            t = time.perf_counter()
            probs = self.drafter(nodes, tokens, parents, level)
            self.draft_s += time.perf_counter() - t
            return probs

        return expand

    def learn(self, draft: DraftTree, accepted: list[int]) -> int:
        """Update the copy calibration with a verified tree; returns the accepted tokens only a copy proposed."""
        if draft.copy_info is None:
            return 0
        self.calibration.update(draft, accepted)
        return sum(copy_only(draft.copy_info[v]) for v in accepted[1:])

    def commit(self, step) -> None:
        """A verified pass's tokens reach the drafter (at its next catch-up) and the copy index."""
        if self.drafter is not None:
            device = step.hidden.device
            self.pending.append(
                (_features(step.hidden, step.layer_hidden, self.layers), torch.tensor(step.tokens, device=device))
            )
        if self.index is not None:
            self.index.extend(step.tokens)


def _features(hidden, layer_hidden, layers):
    """The head's input features: the last hidden state, or the concatenated fused layers (EAGLE-3)."""
    return hidden if not layers else torch.cat([layer_hidden[i] for i in layers], dim=-1)


class Decoder:
    """Lossless speculative decoding of prompts with one target, tokenizer, head and DecodeConfig.

    Built once, it checks the head against the target, resolves the stop tokens, the tree kind's searcher,
    and what the config's tree and copying read (the device's latency profile for `auto`, the head's
    calibration, copy table and datastore); each `steps` or `generate` call then decodes one prompt.
    head=None decodes without a head: plain decoding, or copied spans alone when copying is on.
    profile: a LatencyProfile for `auto` (default: measured on this device once and cached); calibrator and
    copy_calibration: instead of the ones saved next to the head (a given copy_calibration keeps learning across
    prompts; the head's is reloaded for each prompt).
    """

    def __init__(
        self,
        target,
        tokenizer,
        head,
        config: DecodeConfig | None = None,
        *,
        profile=None,
        calibrator=None,
        copy_calibration: CopyCalibration | None = None,
    ):
        self.target, self.tokenizer, self.head = target, tokenizer, head
        self.device = next(target.parameters()).device
        self.config = config = (config or DecodeConfig()).for_device(self.device)
        if head is not None:
            _check_head(head, target, config)
        self.stops = stop_token_ids(target, tokenizer, config.stop)
        copies = config.copies
        if config.tree is TreeKind.AUTO and head is not None and calibrator is None:
            calibrator = head_calibrator(head)
        self._shared_copy_calibration = copy_calibration is not None
        self.copy_calibration = (
            None
            if not copies
            else (copy_calibration if copy_calibration is not None else head_copy_calibration(head, config.copy.length))
        )
        self.store: TokenStore | None = resolve_store(
            config.copy.datastore, head, tokenizer, copies, target.get_input_embeddings().num_embeddings
        )
        self.searcher = None
        if head is not None or copies:
            if config.tree is TreeKind.AUTO:
                profile = deepcopy(profile) if profile is not None else latency_profile(target)
            self.searcher = make_searcher(
                config.tree.value,
                config.budget,
                config.depth,
                config.top_k_draft,
                self.device,
                None,
                config.accept_by_rank,
                config.tree_paths,
                profile,
                calibrator,
            )

    def steps(self, prompt, stats: GenerationStats | None = None, inspect_step=None):
        """Yield one Step per target pass decoding `prompt` (chat messages, a string or token ids); each is
        recorded in `stats`. The prompt is checked at the call; the work happens as the steps are read.

        `inspect_step(drafter, root)` is called before each step's drafting (analysis: e.g. build other trees
        from the same drafter state); the drafter's tree is reset after it.
        """
        ids = self._prompt_ids(prompt)
        stats = stats if stats is not None else GenerationStats()
        if self.config.max_new_tokens == 0:
            return iter(())
        return self._run(ids, stats, inspect_step)

    def generate(self, prompt, stream: bool = False, inspect_step=None):
        """A GenerationResult for `prompt`, or with stream=True an iterator of its text pieces."""
        stats = GenerationStats()
        tokens = (step.tokens for step in self.steps(prompt, stats, inspect_step))
        if stream:
            return stream_text(self.tokenizer, tokens)
        ids = [t for pass_tokens in tokens for t in pass_tokens]
        return GenerationResult(decode_text(self.tokenizer, ids), ids, stats)

    def _prompt_ids(self, prompt) -> torch.Tensor:
        """The prompt's ids, checked against the vocabulary and the context (cut to its end with truncate_prompt)."""
        ids = encode_prompt(self.tokenizer, prompt)
        check_token_ids(self.target, ids)
        limit, wanted = getattr(self.target.config, "max_position_embeddings", None), self.config.max_new_tokens
        if limit is not None and ids.numel() + wanted > limit:
            if not self.config.truncate_prompt or wanted >= limit:
                raise ValueError(
                    f"prompt ({ids.numel()} tokens) + max_new_tokens ({wanted}) exceeds the model's "
                    f"context of {limit} tokens; shorten the prompt or ask for fewer new tokens (in "
                    "Python, truncate_prompt=True keeps the prompt's last tokens)"
                )
            ids = ids[-(limit - wanted) :]
        return ids.to(self.device)

    def _run(self, ids: torch.Tensor, stats: GenerationStats, inspect_step):
        """steps' generator: prefill, then one Step per pass, each recorded in `stats`."""
        seed = self.config.sampling.seed
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        if self.searcher is not None:
            self.searcher.start()
        t0 = time.perf_counter()
        copy_calibration = self.copy_calibration
        if copy_calibration is not None and not self._shared_copy_calibration:
            copy_calibration = deepcopy(copy_calibration)  # each prompt starts from the head's table
        seq = _Sequence(self.target, self.head, ids, copy_calibration, self.store)
        stats.times["prefill"] += time.perf_counter() - t0
        if self.searcher is not None and seq.drafter is not None:
            self.searcher.token_map = seq.drafter.token_map  # the drafter's draft ids -> target ids
        for step in self._passes(seq, int(ids[-1]), generator, inspect_step):
            stats.record(step)
            stats.seconds = time.perf_counter() - t0
            yield step
        stats.seconds = time.perf_counter() - t0

    def _passes(self, seq: _Sequence, root: int, generator, inspect_step):
        """The decoding step of docs/design.md, once per target pass: draft, search, verify, accept, commit."""
        config, searcher = self.config, self.searcher
        sampling = config.sampling
        emitted = 0
        while emitted < config.max_new_tokens:
            left = config.max_new_tokens - emitted
            t, seq.draft_s = time.perf_counter(), 0.0
            # drafting deeper than the tokens still wanted, or than a tree of the budget's nodes reaches, is wasted
            step_depth = min(config.depth, left - 1, searcher.budget - 1 if searcher is not None else config.depth)
            # 1. Draft: the head, when it drafts this step, and copied spans of earlier text, also looked up
            #    after the head's best nodes' paths. A span longer than the budget could never be verified whole.
            drafting = step_depth >= 1 and bool(seq.pending) and searcher.drafts()
            expand = seq.expand(root, inspect_step) if drafting else None
            copies = None
            if seq.index is not None and left > 1 and searcher.takes_copies():
                copies = copy_trie(
                    seq.index,
                    seq.calibration,
                    config.copy.spans,
                    min(config.copy.length, searcher.budget - 1, left - 1),
                    at_nodes=expand is not None,
                    store=seq.store,
                )
            # 2. Search: the nodes this pass verifies (the root alone when there is nothing to draft from).
            if expand is None and copies is None:
                draft = DraftTree([root], [-1], draft_probs=[1.0])
            else:
                draft = searcher.search(expand, root, max(step_depth, 1), copies)
            times = {"draft": seq.draft_s, "search": time.perf_counter() - t - seq.draft_s}
            # 3-5. Verify every node in one target pass, accept top-down, commit the accepted path's KV entries.
            step = verify_step(
                self.target,
                seq.cache,
                draft,
                sampling.temperature,
                sampling.top_k,
                sampling.top_p,
                generator,
                self.stops,
                layers=seq.layers,
            )
            times.update(step.times)
            if searcher is not None:
                searcher.observe(len(draft), sum(step.times.values()), len(step.accepted) - 1)
            copied = seq.learn(draft, step.accepted)
            tokens = step.tokens[:left]
            emitted += len(tokens)
            yield Step(tokens, draft, step.accepted, times, len(step.tokens), copied, step.stopped)
            if step.stopped or emitted >= config.max_new_tokens:
                return
            seq.commit(step)
            root = step.tokens[-1]


def _check_head(head, target, config: DecodeConfig) -> None:
    """ValueError (or HeadError) unless the head drafts for this target, on its device, in a float dtype."""
    head.check_target(target.config)
    head_dtype, head_device = next(head.parameters()).dtype, next(head.parameters()).device
    if not head_dtype.is_floating_point:
        raise ValueError(f"the head's dtype {head_dtype} is not a floating-point type")
    target_device = next(target.parameters()).device
    if head_device != target_device:
        raise ValueError(
            f"the head is on {head_device} but the target on {target_device}; move the head there "
            f"(head.to({str(target_device)!r}))"
        )
    paths = config.tree_paths
    if paths is not None and max(max(p) for p in paths) >= head.drafted_vocab_size():
        raise ValueError(
            f"tree_paths rank {max(max(p) for p in paths)} is past the head's draft vocabulary "
            f"of {head.drafted_vocab_size()} tokens"
        )


def decode_steps(
    target,
    tokenizer,
    head,
    prompt,
    stats: GenerationStats | None = None,
    profile=None,
    calibrator=None,
    copy_calibration=None,
    inspect_step=None,
    config: DecodeConfig | None = None,
    **options,
):
    """Yield the tokens each target pass emits (a list per pass) decoding one prompt; records every pass in
    `stats`. `config`, or `options` (DecodeConfig's fields, or the flat names `generate` takes); the other
    arguments are `Decoder`'s and `Decoder.steps`'."""
    decoder = Decoder(
        target,
        tokenizer,
        head,
        _config(config, options),
        profile=profile,
        calibrator=calibrator,
        copy_calibration=copy_calibration,
    )
    return (step.tokens for step in decoder.steps(prompt, stats, inspect_step))


def generate(
    target,
    tokenizer,
    head,
    prompt_or_messages,
    stream: bool = False,
    config: DecodeConfig | None = None,
    profile=None,
    calibrator=None,
    inspect_step=None,
    **options,
):
    """Lossless speculative generation. Returns a GenerationResult, or with stream=True an iterator of text pieces.

    `config` (a DecodeConfig), or `options`: its fields (tree, budget, depth, top_k_draft, max_new_tokens, stop,
    truncate_prompt, ...) or the flat names temperature, top_k, top_p, seed, copy, copy_spans, copy_len, store.
    The defaults are chosen by device (DecodeConfig: the cost-aware `auto` tree, 60 nodes on a GPU, 8 on a CPU).
    A prompt is chat messages, a string or token ids (a list of ints, or an integer tensor of shape [n] or [1, n]).
    A list of prompts (strings, message lists, token-id lists) returns a list of results, decoded one after another
    by one Decoder, and a call like the last one (same models and options, not streamed) reuses its Decoder:
    building one (the latency profile's probe, the datastore's index) costs a share of a short answer's time.
    profile, calibrator: as `Decoder` takes them; inspect_step: as `Decoder.steps` takes it.
    """
    config = _config(config, options)
    if stream or profile is not None or calibrator is not None:
        decoder = Decoder(target, tokenizer, head, config, profile=profile, calibrator=calibrator)
    else:
        decoder = _LAST.decoder_for(target, tokenizer, head, config)
    if (
        isinstance(prompt_or_messages, list)
        and prompt_or_messages
        and not isinstance(prompt_or_messages[0], dict)
        and not is_token_ids(prompt_or_messages)
    ):
        if stream:
            raise ValueError("stream=True takes one prompt at a time")
        return [decoder.generate(p, inspect_step=inspect_step) for p in prompt_or_messages]
    return decoder.generate(prompt_or_messages, stream=stream, inspect_step=inspect_step)


class _LastDecoder:
    """The Decoder of `generate`'s last call, for the next call with the same target (on the same device, in the
    same dtype), tokenizer, head (its vocabulary and device too), config and files (the head's companion files and
    a datastore file, as they are on disk now). One slot: it keeps at most one set of models alive. A streamed call
    builds its own, so two interleaved streams never share a searcher."""

    def __init__(self):
        self.key, self.decoder = None, None

    def decoder_for(self, target, tokenizer, head, config: DecodeConfig) -> Decoder:
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
        raise TypeError(f"pass a DecodeConfig or keyword options, not both (got config and {sorted(options)})")
    return config if config is not None else DecodeConfig.from_options(**options)


def decode_text(tokenizer, ids) -> str:
    """Text of token ids, without special tokens and without clean-up (so streamed pieces add up to it)."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except TypeError:  # a minimal tokenizer without that option
        return tokenizer.decode(ids, skip_special_tokens=True)


def stream_text(tokenizer, steps):
    """Text pieces as tokens arrive; held back while the decoded text ends in an incomplete character."""
    ids, sent = [], ""
    for tokens in steps:
        ids += tokens
        text = decode_text(tokenizer, ids)
        if text.endswith("\ufffd") or not text.startswith(sent):
            continue
        if len(text) > len(sent):
            yield text[len(sent) :]
        sent = text
    text = decode_text(tokenizer, ids)
    if text.startswith(sent) and len(text) > len(sent):
        yield text[len(sent) :]

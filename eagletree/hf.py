"""Trees inside the `generate()` call people already make: a decoding method for transformers' `custom_generate`.

    out = model.generate(**inputs, custom_generate=eagletree.hf.decoding(head), max_new_tokens=128)

transformers (5.x) calls a callable `custom_generate` as its decoding method once `generate` has prepared the call:
the prompts' ids (a batch left-padded, with its `attention_mask`), the logits processors and stopping criteria it
built from the GenerationConfig, the config itself and the streamer. `decoding(head)` returns such a method: it
decodes through eagletree's `Decoder` (one prompt through `steps`, several through the batched decoder) with the
user's own model object and returns what `generate` returns: the sequences (each row its padded prompt, then its
answer, rows that finished early padded with `pad_token_id`), or a `GenerateDecoderOnlyOutput` with
`return_dict_in_generate=True`.

Lossless means the target's own distribution: greedy, or sampling under temperature, top-k and top-p, stopping at
the end-of-sequence ids and max_new_tokens / max_length, and at any other stopping criterion (stop strings, the
user's own), asked after every token of the row as `generate` would show it. Whatever else would change the
distribution or the stop (another logits processor: a repetition penalty, min_p, a bad-words list, ...; beams;
several sequences per prompt; max_time) is refused with one line naming the option, never ignored; so is a streamer
with several prompts (as transformers refuses it).

transformers 5.x hands a callable neither the streamer nor the tokenizer (so `stop_strings=` cannot reach it). A
folder that `eagletree export --format hf-generate` writes, `model.generate(**inputs, custom_generate=FOLDER,
trust_remote_code=True)`, runs `folder_generate` instead, which gets every argument of `generate`: it turns stop
strings into their stopping criterion, hands the streamer to the method and calls `generate` with it.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import threading
from pathlib import Path

import torch

from .decode import Decoder
from .decode.config import DecodeConfig
from .draft import HeadError
from .errors import InvalidValue

# the processors and criteria `generate` builds from the options honoured here (by class name: they are what the
# GenerationConfig's temperature, top_k, top_p, max_length and eos_token_id turn into)
KNOWN_PROCESSORS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
KNOWN_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria"}  # the Decoder stops there itself
UNTIMEABLE = {"MaxTimeCriteria"}  # every other criterion is asked token by token (`stop_point`)


def decoding(head, tree: str = "auto", tokenizer=None, **options):
    """A decoding method for `model.generate(custom_generate=...)` drafting with `head` (a loaded DraftHead) as a
    `tree` ("auto", "eagle2", "optimal", ...); `tokenizer`: the target's, where the model's generation config does
    not name its end-of-sequence ids; `options`: further `DecodeConfig` options (budget, depth, copy, ...)."""

    decoders: dict = {}  # the Decoder of the last (model, settings), reused by the next call with the same

    def method(model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None, **kwargs):
        check_generation(generation_config, logits_processor, stopping_criteria, streamer, input_ids.shape[0])
        prompts = unpadded_prompts(input_ids, kwargs.get("attention_mask"))
        limits = {"max_new_tokens": new_tokens(generation_config, input_ids), "stop": eos_ids(generation_config)}
        config = DecodeConfig.from_options(tree=tree, **limits, **sampling(generation_config), **options)
        key = (id(model), config)
        if key not in decoders:  # built once per model and settings: its drafter, kernels and profile kept
            decoders.clear()
            decoders[key] = Decoder(model, tokenizer, head, config)
        decoder = decoders[key]
        others = [c for c in stopping_criteria or () if type(c).__name__ not in KNOWN_CRITERIA]
        if len(prompts) == 1:
            answers = [one_answer(decoder, prompts[0], streamer, input_ids, others)]
        else:
            answers = [r.token_ids for r in decoder.generate_batch(prompts, batch_size=len(prompts))]
            answers = [cut_at_stop(others, input_ids[row], answer) for row, answer in enumerate(answers)]
        return generate_output(input_ids, answers, generation_config)

    return method


def check_generation(config, processors, criteria, streamer, rows: int) -> None:
    """InvalidValue naming the first option `decoding` cannot honour losslessly."""
    if getattr(config, "num_beams", 1) not in (None, 1):
        raise InvalidValue(f"num_beams={config.num_beams}: beam search is not supported by eagletree's decoding")
    if getattr(config, "num_return_sequences", 1) not in (None, 1):
        raise InvalidValue(
            f"num_return_sequences={config.num_return_sequences}: eagletree's decoding returns one sequence a prompt"
        )
    other = [type(p).__name__ for p in processors or () if type(p).__name__ not in KNOWN_PROCESSORS]
    if other:
        raise InvalidValue(
            f"logits processor {other[0]} is not supported by eagletree's decoding (it keeps the target's "
            "distribution: temperature, top_k and top_p only)"
        )
    timed = [type(c).__name__ for c in criteria or () if type(c).__name__ in UNTIMEABLE]
    if timed:
        raise InvalidValue(
            f"stopping criterion {timed[0]} (max_time) is not supported by eagletree's decoding: it stops where a "
            "clock says, not where the tokens do"
        )
    if streamer is not None and rows > 1:
        raise InvalidValue(f"a streamer streams one prompt; got a batch of {rows}")


def unpadded_prompts(input_ids: torch.Tensor, attention_mask) -> list[list[int]]:
    """Each row's prompt ids without its padding (left or right, as the mask says)."""
    if attention_mask is None:
        return [row.tolist() for row in input_ids]
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]


def new_tokens(config, input_ids: torch.Tensor) -> int:
    """The answer's length limit: max_new_tokens, else max_length less the (padded) prompt, as `generate` counts."""
    return int(config.max_length - input_ids.shape[1]) if config.max_new_tokens is None else int(config.max_new_tokens)


def eos_ids(config) -> list[int]:
    eos = config.eos_token_id
    return [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])


def sampling(config) -> dict:
    """DecodeConfig's sampling options from the GenerationConfig: greedy, or its temperature, top_k and top_p."""
    if not config.do_sample:
        return {"temperature": 0.0}
    top_k = config.top_k if config.top_k else None
    top_p = config.top_p if config.top_p is not None and config.top_p < 1.0 else None
    return {"temperature": float(config.temperature or 1.0), "top_k": top_k, "top_p": top_p}


def one_answer(decoder: Decoder, prompt: list[int], streamer, input_ids, criteria=()) -> list[int]:
    """One prompt's answer through `steps`, each pass's tokens handed to the streamer as they are decoded, ending at
    the first token after which one of `criteria` stops it (`stop_point`)."""
    if streamer is not None:
        streamer.put(input_ids.cpu())
    answer = []
    for step in decoder.steps(prompt):
        kept, stopped = stop_point(criteria, input_ids[0], answer + list(step.tokens), start=len(answer))
        new = kept[len(answer) :]
        answer.extend(new)
        if streamer is not None:
            streamer.put(torch.tensor(new))
        if stopped:
            break
    if streamer is not None:
        streamer.end()
    return answer


def stop_point(criteria, prompt: torch.Tensor, answer: list[int], start: int = 0) -> tuple[list[int], bool]:
    """(`answer` up to and including its first token from `start` on after which one of the stopping `criteria` is
    met on the row as `generate` shows it, its padded prompt then the answer so far; whether one was): where
    `generate` would have stopped that row. Tokens decoded past it are dropped; those before it are the ones
    `generate` draws."""
    for k in range(start, len(answer)):
        row = torch.cat([prompt, torch.tensor(answer[: k + 1], dtype=prompt.dtype, device=prompt.device)])[None]
        if any(bool(torch.as_tensor(c(row, None)).any()) for c in criteria):
            return answer[: k + 1], True
    return answer, False


def cut_at_stop(criteria, prompt: torch.Tensor, answer: list[int]) -> list[int]:
    """A whole answer cut where the stopping `criteria` stop it (`stop_point`)."""
    return stop_point(criteria, prompt, answer)[0]


def generate_output(input_ids: torch.Tensor, answers: list[list[int]], config):
    """`generate`'s return value: the sequences [rows, prompt + longest answer] (shorter answers padded with the
    pad token, else the first end-of-sequence id), or a GenerateDecoderOnlyOutput holding them."""
    pad = config.pad_token_id if config.pad_token_id is not None else (eos_ids(config) or [0])[0]
    width = max((len(a) for a in answers), default=0)
    new = torch.full((len(answers), width), int(pad), dtype=input_ids.dtype, device=input_ids.device)
    for row, answer in enumerate(answers):
        new[row, : len(answer)] = torch.tensor(answer, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, new], dim=1)
    if not config.return_dict_in_generate:
        return sequences
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(sequences=sequences)


_FOLDER_METHODS: dict = {}  # (model, head folder and its files' times, tree, options) -> decoding method, newest last
_KEPT_METHODS = 4  # decoding methods kept (each holds a head and its Decoder)
_HUB_HEADS: dict = {}  # Hub repository -> the head folder fetched from it, once a process
_LOCK = threading.Lock()
REFUSED_IN_FOLDER = ("assistant_model", "synced_gpus")  # generate's arguments a decoding method never receives


def folder_generate(model, export: dict, **kwargs):
    """`generate` as an hf-generate export's generate.py runs it: `kwargs` are all of `generate`'s arguments, plus
    eagletree_head (a head folder to draft with instead of the export's) and eagletree_tree (how trees are searched).
    The streamer goes to the decoding method; stop strings (an argument, or a generation config's) become a
    StopStringCriteria with the tokenizer, which is used for nothing else (as `generate` uses it)."""
    from transformers import GenerationMixin

    for name in REFUSED_IN_FOLDER:
        if kwargs.get(name):
            given = kwargs[name] if isinstance(kwargs[name], (bool, int)) else f"<{type(kwargs[name]).__name__}>"
            raise InvalidValue(f"{name}={given} is not supported by eagletree's decoding (it drafts itself)")
    head = Path(kwargs.pop("eagletree_head", None) or exported_head(export))
    tree = kwargs.pop("eagletree_tree", None) or export.get("tree", "auto")
    streamer, tokenizer = kwargs.pop("streamer", None), kwargs.pop("tokenizer", None)
    method = functools.partial(folder_method(model, head, tree, export.get("options", {})), streamer=streamer)
    kwargs, strings = stop_strings_as_criteria(model, kwargs, tokenizer)
    with model_config_without_stop_strings(model) if strings else contextlib.nullcontext():
        return GenerationMixin.generate(model, custom_generate=method, **kwargs)


@contextlib.contextmanager
def model_config_without_stop_strings(model):
    """The model's generation config without stop strings while the block runs (`generate` fills a config's unset
    fields from it, so its stop strings would come back), restored after."""
    saved = model.generation_config
    model.generation_config = without_stop_strings(saved)
    try:
        yield
    finally:
        model.generation_config = saved


def exported_head(export: dict) -> Path:
    """The export's head: in the folder it was written to (if that folder still holds this export), else fetched
    from the Hub repository it names (once a process); HeadError in one line saying what to pass otherwise."""
    local = Path(export["folder"]) / export["head"]
    try:
        here = json.loads((Path(export["folder"]) / "config.json").read_text()).get("custom_generate")
    except (OSError, ValueError, AttributeError):
        here = None
    if here == export and (local / "config.json").is_file():
        return local
    repo = export.get("hub_repo")
    if not repo:
        raise HeadError(
            f"the head of this custom_generate export is not at {str(local)!r} (the folder moved, and it names no "
            "Hub repository): pass eagletree_head=PATH to generate, or export again with --hub-repo"
        )
    if repo not in _HUB_HEADS:
        import huggingface_hub

        try:
            fetched = huggingface_hub.snapshot_download(repo, allow_patterns=[f"{export['head']}/*"])
        except Exception as e:  # (offline, no such repository, no access: huggingface_hub's own errors)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise HeadError(
                f"could not fetch {export['head']}/ from the Hub repository {repo!r} ({reason}); pass "
                "eagletree_head=PATH to generate"
            ) from e
        _HUB_HEADS[repo] = Path(fetched) / export["head"]
    return _HUB_HEADS[repo]


def stop_strings_as_criteria(model, kwargs: dict, tokenizer) -> tuple[dict, list]:
    """(`kwargs` with the stop strings, an argument or a generation config's, as one more stopping criterion and
    none left in a config `generate` would build the criterion from, which it cannot: a callable gets no tokenizer;
    the stop strings)."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    config = kwargs.get("generation_config")
    strings = (
        kwargs.pop("stop_strings", None)
        or getattr(config, "stop_strings", None)
        or getattr(model.generation_config, "stop_strings", None)
    )
    if not strings:
        return kwargs, []
    if tokenizer is None:
        raise InvalidValue(f"stop_strings={strings!r} needs the tokenizer: pass tokenizer= to generate as well")
    if config is not None:
        kwargs["generation_config"] = without_stop_strings(config)
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer, strings))
    return {**kwargs, "stopping_criteria": criteria}, list(strings)


def without_stop_strings(config):
    """A copy of a GenerationConfig without stop strings."""
    config = copy.deepcopy(config)
    config.stop_strings = None
    return config


def folder_method(model, head_dir: Path, tree: str, options: dict):
    """The decoding method for this model, head folder and settings, built once (the head loaded onto the model's
    device, the Decoder kept by the method; the last few kept) and built again when the head's files change."""
    from .decode.resources import COMPANION_FILES
    from .draft.base import CONFIG, WEIGHTS
    from .loading import load_head

    files = [head_dir / name for name in (CONFIG, WEIGHTS, *COMPANION_FILES)]
    stamp = tuple(path.stat().st_mtime_ns if path.is_file() else None for path in files)
    dtype = next(model.parameters()).dtype
    key = (
        id(model),
        str(model.device),
        dtype,
        str(head_dir.resolve()),
        stamp,
        tree,
        json.dumps(options, sort_keys=True),
    )
    with _LOCK:
        method = _FOLDER_METHODS.pop(key, None)
        if method is None:
            head = load_head(head_dir, model.config, device=model.device).eval()
            method = decoding(head, tree, None, **options)
        _FOLDER_METHODS[key] = method  # newest last
        while len(_FOLDER_METHODS) > _KEPT_METHODS:
            del _FOLDER_METHODS[next(iter(_FOLDER_METHODS))]
    return method

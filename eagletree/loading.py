"""A target and its draft head together, as the CLI's commands, `eagletree bench` and the benchmark scripts load
them: the head shipped for a target by default, any head folder (eagletree's or an export to import), the head's
precision, the target's kernels packed or not."""

from __future__ import annotations

from pathlib import Path

import torch

from . import target  # target.load_target is looked up per call, so a test can stand a tiny model in for it
from .draft import DraftHead, HeadError, is_foreign_head
from .draft import load_head as load_saved_head
from .draft.base import check_head_target, read_head_config
from .draft.precision import load_or_measure_draft_dtype
from .errors import InvalidValue
from .export.convert import import_for_config, importable_layout
from .packing import pack_target

DRAFT_VOCABS = ("auto", "head", "full")
SHIPPED_HEADS = {"smollm2-135m": Path(__file__).parent / "heads" / "smollm2-135m"}


def draft_dtype(name: str, model):
    """The head's precision for --draft-dtype `name`: 'auto' = the target's, except for an fp32 target on a CPU
    with native bf16, where `load_models` measures fp32 against bf16 drafting (`draft.precision`) and this
    gives fp32 to load the head in before measuring (the target's own pass keeps its precision either way)."""
    if name == "auto":
        return torch.float32 if measures_draft_dtype(model) else model.dtype
    return getattr(torch, name)


def measures_draft_dtype(model) -> bool:
    """Whether --draft-dtype auto measures the head's precision for this target: fp32 on a CPU with native bf16."""
    return model.device.type == "cpu" and model.dtype == torch.float32 and target.cpu_has_bf16()


def draft_vocab_for(name: str, model) -> str:
    """'head' (the head's own draft vocabulary) or 'full' (the target's whole vocabulary) for --draft-vocab `name`.

    auto = full on a GPU, the head's own elsewhere: a drafting level reads the lm_head rows it scores. On a CPU
    that read is the cost (SmolLM2's 49,152 rows, 6x the shipped head's 8,192, make a drafting level dearer
    and decoding slower on the CPUs measured: docs/results.md, "The draft vocabulary"); a GPU reads 57 MB in tens of
    microseconds (not measured), and the full vocabulary drafts the tokens a draft vocabulary leaves out.
    """
    _check_draft_vocab_name(name)
    if name == "auto":
        return "full" if model.device.type == "cuda" else "head"
    return name


def _check_draft_vocab_name(name: str) -> None:
    if name not in DRAFT_VOCABS:
        raise InvalidValue(f"draft_vocab must be one of {DRAFT_VOCABS}, got {name!r}")


def load_head(directory, target_config=None, dtype=None, device=None) -> DraftHead:
    """Any head folder: a saved eagletree head (`draft.load_head`), or an export in a registered format
    (`eagletree.export`) imported for the target whose config is `target_config`."""
    if not is_foreign_head(directory):
        return load_saved_head(directory, target_config=target_config, dtype=dtype, device=device)
    if target_config is None:
        raise HeadError(f"{directory} is an EAGLE-format head; importing it needs the target's config")
    head = import_for_config(directory, target_config)
    head = head.to(device) if device is not None else head
    return head.to(dtype) if dtype is not None else head


def check_head_folder(directory, target_spec=None) -> None:
    """HeadError naming the folder unless it holds a head `load_head` loads (a saved eagletree head, or an export it
    imports) and, with `target_spec`, one built for that target; reads config files only, never the weights, so a
    bad --head is named before the target loads."""
    if is_foreign_head(directory):
        importable_layout(directory)
        return
    config = read_head_config(directory)
    target_config = None
    if target_spec is not None:
        try:
            target_config = target.target_config(target_spec)
        except target.TargetError:  # (loading the target names it)
            pass
    if target_config is not None:
        check_head_target(config, target_config)


def head_to_load(target_name: str, head, required: bool = True):
    """The head folder to load for --head `head`: None for 'none'; when not given, the one shipped for the target.

    A target without a shipped head is an error that names --head when `required`, else no head (None).
    """
    if head is not None:
        return None if str(head) == "none" else head
    target.check_target_spec(target_name)  # a mistyped target is named as such, not as one without a shipped head
    shipped = SHIPPED_HEADS.get(target_name)
    if shipped is None or not shipped.is_dir():
        if required:
            raise InvalidValue(
                f"no head is shipped for target {target_name!r}; pass --head DIR "
                "(train one with train.py) or --head none for plain decoding"
            )
        return None
    return shipped


def load_models(
    target_name: str,
    head_dir=None,
    *,
    device=None,
    dtype: str | None = None,
    pack: str = "off",
    head_dtype: str | None = "auto",
    draft_vocab: str = "head",
):
    """The target (`dtype` 'float32'/'bfloat16' or None for the device's default; Linears packed per `pack`, see
    `pack_target`), its tokenizer and the head in `head_dir` (None: no head) on the target's device, in the
    precision `draft_dtype(head_dtype)` picks (None: the one it was saved in; 'auto' on a CPU with native bf16:
    the faster of fp32 and bf16 drafting measured here, `load_or_measure_draft_dtype`), drafting over its own draft
    vocabulary or the target's whole one as `draft_vocab_for(draft_vocab)` picks ('full': `DraftHead.widen_vocab`).

    Returns (model, tokenizer, head, how many Linears were packed).
    """
    _check_draft_vocab_name(draft_vocab)  # before loading anything
    target.checked_device(device)
    if head_dir is not None:
        check_head_folder(head_dir, target_name)
    model, tok = target.load_target(target_name, dtype=None if dtype is None else getattr(torch, dtype), device=device)
    packed = pack_target(model, pack)
    head = None
    if head_dir is not None:
        head = load_head(
            head_dir,
            target_config=model.config,
            device=model.device,
            dtype=None if head_dtype is None else draft_dtype(head_dtype, model),
        )
        if draft_vocab == "full" and head.config.draft_vocab_size is not None:
            head.widen_vocab()  # refused, naming the flag, for a head with an lm_head of its own
        elif draft_vocab_for(draft_vocab, model) == "full" and head.can_widen_vocab():
            head.widen_vocab()  # auto keeps an own lm_head's vocabulary
        if head_dtype == "auto" and measures_draft_dtype(model):
            head = head.to(load_or_measure_draft_dtype(head, model))
    return model, tok, head, packed

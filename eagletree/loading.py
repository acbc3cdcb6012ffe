"""A target and its draft head together, as the CLI's commands, `eagletree bench` and the benchmark scripts load
them: the head shipped for a target by default, the head's precision, the target's kernels packed or not."""

from __future__ import annotations

from pathlib import Path

import torch

from . import target  # target.load_target is looked up per call, so a test can stand a tiny model in for it
from .draft_heads import load_head
from .packing import pack_target

SHIPPED_HEADS = {"smollm2-135m": Path(__file__).parent / "heads" / "smollm2-135m"}


def draft_dtype(name: str, model):
    """The head's precision: 'auto' = bf16 for an fp32 target on a CPU with native bf16 (drafting is
    memory-bound there, so it halves a drafter call; the target's own pass keeps its precision), else the target's."""
    if name == "auto":
        cpu_bf16 = model.device.type == "cpu" and model.dtype == torch.float32 and target.cpu_has_bf16()
        return torch.bfloat16 if cpu_bf16 else model.dtype
    return getattr(torch, name)


def head_to_load(target_name: str, head, required: bool = True):
    """The head folder to load for --head `head`: None for 'none'; when not given, the one shipped for the target.

    A target without a shipped head is an error that names --head when `required`, else no head (None).
    """
    if head is not None:
        return None if str(head) == "none" else head
    shipped = SHIPPED_HEADS.get(target_name)
    if shipped is None or not shipped.is_dir():
        if required:
            raise SystemExit(f"error: no head is shipped for target {target_name!r}; pass --head DIR "
                             "(train one with train.py) or --head none for plain decoding")
        return None
    return shipped


def load_models(target_name: str, head_dir=None, *, device=None, dtype: str | None = None, pack: str = "off",
                head_dtype: str | None = "auto"):
    """The target (`dtype` 'float32'/'bfloat16' or None for the device's default; Linears packed per `pack`, see
    `pack_target`), its tokenizer and the head in `head_dir` (None: no head) on the target's device, in the
    precision `draft_dtype(head_dtype)` picks (None: the one it was saved in).

    Returns (model, tokenizer, head, how many Linears were packed).
    """
    model, tok = target.load_target(target_name, dtype=None if dtype is None else getattr(torch, dtype),
                                    device=device)
    packed = pack_target(model, pack)
    head = None
    if head_dir is not None:
        head = load_head(head_dir, target_config=model.config, device=model.device,
                         dtype=None if head_dtype is None else draft_dtype(head_dtype, model))
    return model, tok, head, packed

"""Draft heads: EAGLE-style feature-level heads, draft vocabulary, the tree drafter, save/load (export formats and
foreign head folders: eagletree.export)."""

import json
from pathlib import Path

from .base import (
    DraftHead,
    Drafting,
    FeatureSpec,
    HeadConfig,
    HeadError,
    head_class,
    head_types,
    register_head,
    target_identity,
)
from .dflash import DFlashHead
from .drafter import Drafter, TreeDrafter
from .eagle import EagleHead
from .eagle3 import Eagle3Head
from .medusa import MedusaDrafter, MedusaHead
from .vocab import build_draft_vocab, check_draft_vocab, t2d_mask, target_to_draft

__all__ = [
    "DraftHead",
    "DFlashHead",
    "Drafter",
    "Drafting",
    "FeatureSpec",
    "EagleHead",
    "Eagle3Head",
    "MedusaHead",
    "HeadConfig",
    "HeadError",
    "TreeDrafter",
    "MedusaDrafter",
    "head_class",
    "head_types",
    "is_foreign_head",
    "load_head",
    "make_drafter",
    "register_head",
    "target_identity",
    "build_draft_vocab",
    "check_draft_vocab",
    "t2d_mask",
    "target_to_draft",
]

# The kinds of head a saved config.json can name (its head_type); a new kind is one class added here.
for _kind in (EagleHead, Eagle3Head, MedusaHead, DFlashHead):
    register_head(_kind)


def is_foreign_head(directory) -> bool:
    """Whether `directory` holds a head saved elsewhere (an EAGLE, vLLM or SGLang export: its config.json names no
    head_type), which `eagletree.loading.load_head` imports; False where there is no config.json."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        return False
    try:
        return "head_type" not in json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise HeadError(f"{config_path} is not valid JSON: {e}") from e


def load_head(directory, target_config=None, dtype=None, device=None) -> DraftHead:
    """A saved eagletree head (its config names the type). A foreign head folder is refused here: importing one is
    `eagletree.loading.load_head` (or `eagletree import`), which reads the export formats."""
    if is_foreign_head(directory):
        raise HeadError(
            f"{directory} is an EAGLE-format head (its config.json names no head_type): load it with "
            "eagletree.loading.load_head, which imports it for a target, or `eagletree import` it"
        )
    return DraftHead.from_pretrained(directory, target_config=target_config, dtype=dtype, device=device)


def make_drafter(head: DraftHead, target_model) -> Drafter:
    """The drafter for a head (its `make_drafter`): what the decoding loop and the tree searches call."""
    return head.make_drafter(target_model)

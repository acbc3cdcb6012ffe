"""Draft heads: EAGLE-style feature-level heads, draft vocabulary, the tree drafter, save/load."""

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
from .drafter import Drafter, TreeDrafter
from .eagle import EagleHead
from .eagle3 import Eagle3Head
from .export import import_eagle
from .medusa import MedusaDrafter, MedusaHead
from .vocab import build_draft_vocab, check_draft_vocab, t2d_mask, target_to_draft

__all__ = [
    "DraftHead",
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
for _kind in (EagleHead, Eagle3Head, MedusaHead):
    register_head(_kind)


def load_head(directory, target_config=None, dtype=None, device=None) -> DraftHead:
    """Any saved eagletree head (its config names the type), or an EAGLE-1/2 head in EAGLE/vLLM/SGLang layout."""
    config_path = Path(directory) / "config.json"
    if config_path.is_file():
        try:
            is_foreign = "head_type" not in json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise HeadError(f"{config_path} is not valid JSON: {e}") from e
        if is_foreign:
            if target_config is None:
                raise HeadError(f"{directory} is an EAGLE-format head; importing it needs the target's config")
            head = import_eagle(directory, target_config)
            head = head.to(device) if device is not None else head
            return head.to(dtype) if dtype is not None else head
    return DraftHead.from_pretrained(directory, target_config=target_config, dtype=dtype, device=device)


def make_drafter(head: DraftHead, target_model) -> Drafter:
    """The drafter for a head (its `make_drafter`): what the decoding loop and the tree searches call."""
    return head.make_drafter(target_model)

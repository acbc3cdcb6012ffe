"""Draft heads: EAGLE-style feature-level heads, draft vocabulary, the tree drafter, save/load."""

from .drafter import TreeDrafter
from .eagle import EagleHead, HeadConfig, HeadError, target_identity
from .vocab import build_draft_vocab, check_draft_vocab, t2d_mask, target_to_draft

__all__ = ["EagleHead", "HeadConfig", "HeadError", "TreeDrafter", "target_identity", "build_draft_vocab",
           "check_draft_vocab", "t2d_mask", "target_to_draft"]

"""What heads drafting one level per call share (EAGLE-1/2, EAGLE-3): their layer runs once per tree level for the
whole frontier, one sequence at a time (`TreeDrafter`) or several in one ragged call (`RaggedTreeDrafter`)."""

from __future__ import annotations

from .base import DraftHead, Drafting
from .batch_drafter import RaggedTreeDrafter
from .drafter import TreeDrafter


class LevelDraftingHead(DraftHead):
    """A head with a decoder layer (`layer`, `rotary`, `layer_inputs`, `new_cache`) drafted one level per call."""

    @property
    def drafting(self) -> Drafting:
        return Drafting(batched=True)

    def make_drafter(self, target_model) -> TreeDrafter:
        return TreeDrafter(self, target_model)

    def make_batch_drafter(self, target_model) -> RaggedTreeDrafter:
        return RaggedTreeDrafter(self, target_model)

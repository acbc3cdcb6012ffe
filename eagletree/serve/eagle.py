"""SafeAILab/EAGLE's own code as `plan` serves with it: EAGLE-2 trees (total_token, depth, top_k), an EAGLE-1/2
export drafted over the full vocabulary (its code reads no token map)."""

from __future__ import annotations

from .registry import Engine


def settings(plan, export_dir: str, eagle3: bool, draft_vocab: bool, export_format: str | None = None) -> dict:
    """EaModel.from_pretrained's tree arguments: total_token counts the root; its first top-k level comes before
    `depth` more."""
    return {"total_token": plan.nodes, "depth": plan.depth - 1, "top_k": plan.width}


ENGINE = Engine("eagle", chain=False, full_vocab=True, settings=settings, formats=("eagle", "eagle3"))

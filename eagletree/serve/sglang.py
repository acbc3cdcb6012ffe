"""SGLang 0.5.23 as `plan` serves with it: EAGLE-2 trees (steps, top-k, draft tokens), an EAGLE-1/2 export drafted
over its token map (`--speculative-token-map`), launch_server flags."""

from __future__ import annotations

from pathlib import Path

from ..export import TOKEN_MAP
from .registry import Engine


def settings(plan, export_dir: str, eagle3: bool, draft_vocab: bool, export_format: str | None = None) -> dict:
    """The launch_server flags for the plan's tree, and the command they make."""
    flags = {
        "--speculative-algorithm": "EAGLE3" if eagle3 else "EAGLE",
        "--speculative-draft-model-path": export_dir,
        "--speculative-num-steps": plan.depth,
        "--speculative-eagle-topk": plan.width,
        # SGLang counts the verified root among the draft tokens (steps + 1 for a chain).
        "--speculative-num-draft-tokens": plan.nodes,
    }
    if draft_vocab and not eagle3:
        flags["--speculative-token-map"] = str(Path(export_dir) / TOKEN_MAP)
    return {
        "flags": flags,
        "command": "python -m sglang.launch_server --model-path TARGET "
        + " ".join(f"{k} {v}" for k, v in flags.items()),
    }


ENGINE = Engine("sglang", chain=False, full_vocab=False, settings=settings, formats=("sglang", "eagle3"))

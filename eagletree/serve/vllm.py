"""vLLM 0.33 as `plan` serves with it: a chain only (its SpeculativeConfig has no token tree), an EAGLE-1/2 export
drafted over the full vocabulary (vLLM reads no token map), `speculative_config` with method "eagle" or "eagle3"."""

from __future__ import annotations

from .registry import Engine


def settings(plan, export_dir: str, eagle3: bool, draft_vocab: bool, export_format: str | None = None) -> dict:
    """`LLM(..., speculative_config=...)`: the chain's length as num_speculative_tokens; a block head's `dflash` export
    (a DFlashDraftModel checkpoint) under method "dflash"."""
    method = "dflash" if export_format == "dflash" else "eagle3" if eagle3 else "eagle"
    return {
        "speculative_config": {
            "method": method,
            "model": export_dir,
            "num_speculative_tokens": plan.depth,
        }
    }


ENGINE = Engine("vllm", chain=True, full_vocab=True, settings=settings, formats=("vllm", "dflash", "speculators"))

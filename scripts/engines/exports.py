"""The checks' one door to eagletree's export code: every name they use of it, and which format each engine loads.

Repoint these imports when the export code moves; nothing else in scripts/engines imports it.
"""

from __future__ import annotations

from eagletree.draft_heads.export import export_head, import_eagle, import_eagle3, read_export_config

__all__ = ["VLLM_FORMATS", "export_head", "import_eagle", "import_eagle3", "read_export_config", "sglang_format"]

VLLM_FORMATS = (
    "vllm",
    "speculators",
)  # what check_vllm.py --format exports to; `vllm_runs.export_kind` tells them apart


def sglang_format(head) -> str:
    """The format SGLang loads `head` in: 'eagle3' for a head that fuses target layers (EAGLE-3), else 'sglang'."""
    return "eagle3" if head.feature_spec.layers else "sglang"

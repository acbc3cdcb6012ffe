"""The checks' one door to eagletree's export code: every name they use of it, and which format each engine loads
(the engines' own declarations in eagletree.serve)."""

from __future__ import annotations

from pathlib import Path

from eagletree.export.convert import export_head, recognize_folder
from eagletree.export.shared import read_export_config
from eagletree.serve import engine

__all__ = ["VLLM_FORMATS", "export_head", "import_export", "read_export_config", "sglang_format"]

VLLM_FORMATS = engine(
    "vllm"
).formats  # what check_vllm.py --format exports to; `vllm_runs.export_kind` tells them apart


def import_export(folder, target):
    """The head in an export folder of any registered format (built from the target model or its config, as the
    folder's layout needs)."""
    layout = recognize_folder(folder)
    return layout.load(Path(folder), target if layout.imports_with_model else target.config)


def sglang_format(head) -> str:
    """The format SGLang loads `head` in (its engine's first format that takes the head's kind)."""
    return engine("sglang").format_for(head.head_type)

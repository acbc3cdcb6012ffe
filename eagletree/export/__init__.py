"""Export formats: a head written in the layout EAGLE's code, vLLM or SGLang loads, and read back by `eagletree
import`. One module per format (eagle.py, eagle3.py, vllm.py, speculators.py, sglang.py,
dflash.py, gguf.py, hf_generate.py) declares the heads it
takes, whether it needs the target, how it writes and how import recognizes its folders; `registry` finds them by
name. A new format is its module and one `register` line below.

This package's top imports no torch (the command line lists the formats from it); `convert` (export_head,
import_folder) and the format modules load it.
"""

from .registry import all_layouts, format_layouts, format_names, formats_taking, layout_for, recognize, register

__all__ = [
    "TOKEN_MAP",
    "all_layouts",
    "format_layouts",
    "format_names",
    "formats_taking",
    "layout_for",
    "recognize",
    "register",
]

TOKEN_MAP = "token_map.pt"  # SGLang's --speculative-token-map: an EAGLE-1/2 export's draft vocabulary, target ids

# The formats, in the order `eagletree export --format` lists them and a refusal names a head's formats.
register("eagle")
register("eagle3")
register("vllm")
register("sglang")
register("speculators")
register("dflash")
register("gguf")
register("hf-generate", f"{__package__}.hf_generate")

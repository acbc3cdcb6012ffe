"""eagletree: lossless speculative decoding with EAGLE-style draft heads and optimized draft trees.

`DecodeConfig` (with `Sampling` and `CopyOptions`) says how to decode, a `Decoder` decodes with a target,
its tokenizer and a draft head, and `generate` is the one-call form. Names load on first use, so that
`import eagletree` (and the command line's parsing) does not import torch. `except eagletree.EagletreeError`
catches every error eagletree raises for bad input or files.
"""

__version__ = "0.1.0"
__all__ = ["CopyOptions", "DecodeConfig", "Decoder", "EagletreeError", "Sampling", "TreeKind", "generate"]

_HOMES = {
    "CopyOptions": "decode",
    "DecodeConfig": "decode",
    "Sampling": "decode",
    "TreeKind": "decode",
    "Decoder": "decode",
    "generate": "decode",
    "EagletreeError": "errors",  # the base of every error eagletree raises for bad input
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'eagletree' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{_HOMES[name]}", __name__), name)

"""The target, tokenizer and draft head a command's flags name (`common.add_model_args`), loaded with one line
on stderr saying what was loaded and how.

Handlers import this module only when they run: it loads torch.
"""

from __future__ import annotations

import sys
import time

from ..decode import Decoder
from ..decode.config import DecodeConfig
from ..loading import head_to_load, load_models


def load_from_args(args, config: DecodeConfig | None = None):
    """Target, tokenizer and head from --target/--head (the shipped head by default); with the decoding `config`
    the flags ask for (built before loading, so a bad flag is refused at once), also a Decoder for them."""
    head_path = head_to_load(args.target, args.head)
    t0 = time.perf_counter()
    model, tok, head, packed = load_models(
        args.target,
        head_path,
        device=args.device,
        dtype=getattr(args, "dtype", None),  # generate, chat, viz: --dtype
        pack=args.pack,
        head_dtype=args.draft_dtype,
        draft_vocab=_draft_vocab(args),
    )
    print(
        f"loaded {args.target} ({type(model).__name__}, {model.dtype}, {model.device}"
        f"{f', {packed} Linears packed' if packed else ''}{_kernels_note(model)})"
        f"{'' if head is None else f' and head {head_path}'} in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    if config is None:
        return model, tok, head
    return model, tok, head, Decoder(model, tok, head, config)


def _draft_vocab(args) -> str:
    """--draft-vocab as `load_models` takes it; plan's auto is settled once the head is loaded (`cli.plan`)."""
    return "head" if args.draft_vocab == "auto" and getattr(args, "engine", None) else args.draft_vocab


def _kernels_note(model) -> str:
    """Where --pack auto measured the kernels: each tree size's choice with both timings."""
    choice = getattr(model, "kernel_choice", None)
    return "" if choice is None else f"; kernels measured here: {choice.summary()}"

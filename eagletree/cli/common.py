"""What every `eagletree` command shares: running a parsed command (its errors as one line and an exit status,
warnings one line each), the argparse type for counts, and the argument groups of the commands that load a target
and a head or decode.

Imported while the command line parses: nothing here loads torch.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from ..decode.config import CPU_BUDGET, GPU_BUDGET, TREE_KINDS, DecodeConfig, TreeKind
from ..errors import EagletreeError, InvalidValue

DEFAULTS = DecodeConfig()  # the library's decoding defaults are the command line's


def at_least(low: int):
    """An argparse type for an integer >= `low`, so a bad value is refused before anything loads, naming the flag
    ("argument --max-nodes: must be an integer >= 2, got 1")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def refuse_head_none(args, command: str, why: str) -> None:
    """ValueError before loading when a command that needs a draft head is given --head none."""
    if args.head == "none":
        raise InvalidValue(
            f"--head none: {command} {why}; pass a head folder, or leave --head out for the target's shipped head"
        )


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings as the command line shows them: 'DataWarning: ...', without the source line that raised them."""
    return f"{category.__name__}: {message}\n"


def run_command(args) -> int:
    """Run the parsed command (`args.func`, its handler) and return the exit status: an eagletree error, a bad value
    or a file error is one 'error: ...' line (2), Ctrl-C is 'interrupted' (130)."""
    shown = warnings.formatwarning  # restored after the command: main may run inside another program (or tests)
    warnings.formatwarning = one_line_warning
    try:
        return args.func(args)  # (the handler loads torch and transformers: seconds, so inside the Ctrl-C handling)
    except (EagletreeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what the command was writing is cleaned up on the way (files.writing)
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = shown


def add_model_args(p, needs_head: bool = False) -> None:
    """--target, --head, --device, --draft-dtype, --draft-vocab, --pack: what `models.load_from_args` reads
    (`needs_head`: the command refuses --head none)."""
    p.add_argument("--target", default="smollm2-135m", help="alias, HF model folder or .gguf file")
    p.add_argument(
        "--head",
        default=None,
        help="draft head folder; default: the head shipped for the target"
        + ("" if needs_head else "; 'none' = plain decoding"),
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--draft-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the head's precision; auto = the faster of float32 and bfloat16 drafting, measured once on a CPU "
        "with native bf16 for an fp32 target (cached), else the target's (outputs do not depend on it)",
    )
    p.add_argument(
        "--draft-vocab",
        default="auto",
        choices=["auto", "head", "full"],
        help="the tokens the head drafts: its own draft vocabulary (head) or the target's whole "
        "vocabulary (full: more tokens draftable, a larger lm_head per drafting level); auto = "
        "full on a GPU, head on a CPU; plan: the vocabulary its --engine drafts over",
    )
    p.add_argument(
        "--pack",
        default="auto",
        choices=["auto", "on", "off"],
        help="pre-pack the target's Linear weights for oneDNN (CPU; one more copy of the weights in "
        "memory); auto = measure stock vs packed here once per CPU model, threads, dtype and torch "
        "version (cached) and keep packing only at the tree sizes where it is faster; on = packed at "
        "every size",
    )


def add_decoding_args(p, tree: str = DEFAULTS.tree.value, needs_head: bool = False) -> None:
    """Decoding flags, with DecodeConfig's defaults (`tree`: another default tree kind); `DecodeConfig.from_args`
    reads them."""
    add_model_args(p, needs_head)
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the target's precision (default: float32 on CPU, bfloat16 on CUDA); bfloat16's output "
        "equals plain bf16 decoding's up to rounding; whether it is faster depends on the CPU "
        "(docs/results.md)",
    )
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    p.add_argument("--temperature", type=float, default=DEFAULTS.sampling.temperature)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument(
        "--tree",
        default=tree,
        choices=TREE_KINDS,
        help=f"default {tree}"
        + (
            ": the cost-aware tree, which drafts only while trees beat a one-token pass on this machine"
            if tree == TreeKind.AUTO
            else ""
        ),
    )
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help=f"tree nodes per target pass, root included (default: {GPU_BUDGET} on CUDA, {CPU_BUDGET} on CPU)",
    )
    p.add_argument("--depth", type=int, default=DEFAULTS.depth)
    p.add_argument("--top-k-draft", type=int, default=DEFAULTS.top_k_draft)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--copy",
        default="auto",
        choices=["auto", "on", "off"],
        help="copied spans of the prompt and the answer so far as extra tree candidates (auto: on for "
        "eagle2, optimal and auto trees, off for the fixed chain and sequoia shapes)",
    )
    p.add_argument(
        "--datastore",
        default="auto",
        help="with copying, a corpus copied from too (the target's earlier answers: retrieved spans): auto "
        "= the head folder's datastore.npz when it has one, none, or a file `eagletree datastore` made",
    )

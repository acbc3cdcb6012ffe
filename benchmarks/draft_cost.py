"""Where a drafting level's time goes: the head layer, the lm_head slice (+ softmax), the drafter's own
Python/tensor bookkeeping, and the tree search's top-k and bookkeeping, measured while decoding real prompts.

    .venv/bin/python benchmarks/draft_cost.py                      # shipped head, CLI defaults (bf16 head, --pack auto)
    .venv/bin/python benchmarks/draft_cost.py --tree eagle2 --budget 8 --prompts heldout:4

Per level = per drafter call during tree search (level 1 reuses the root distribution, so it makes no call; the
search's work on it is spread over the calls, so the parts add up to "one level in all"); the catch-up call on
committed tokens (`extend`) is reported per decoding step, and drafting per step = levels x one level + the
catch-up. Medians over the prompts that drafted at least one level (a prompt answered at once, or `auto`
drafting nothing, has no level to measure).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagletree.bench import load_prompts
from eagletree.decoding import GenerationStats, decode_steps
from eagletree.draft_heads.drafter import TreeDrafter
from eagletree.loading import head_to_load, load_models
from eagletree.packing import kernels_used


def parse_args(argv=None):
    """The flags, checked; the head folder to measure."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head", default=None, help="default: the head shipped for --target")
    ap.add_argument("--prompts", default="heldout:4")
    ap.add_argument("--tree", default="eagle2")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="at least 2 (one token drafts no level)")
    ap.add_argument("--pack", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument(
        "--draft-vocab",
        default="head",
        choices=["head", "full"],
        help="the head's own draft vocabulary or the target's whole one (a larger lm_head per level)",
    )
    args = ap.parse_args(argv)
    if args.max_new_tokens < 2:
        ap.error(f"--max-new-tokens must be >= 2 (one token drafts no level), got {args.max_new_tokens}")

    try:
        head_dir = head_to_load(args.target, args.head)
    except ValueError as e:  # no head shipped for that target, or a mistyped target
        ap.error(str(e))
    if head_dir is None:
        ap.error("--head none: this measures a head's drafting; pass a head folder")
    return args, head_dir


def instrument(head):
    """Time the head's layer, the lm_head slice, the drafter's level calls and its catch-up calls (in place);
    returns the running clock (seconds) and call counts."""
    clock = {"head": 0.0, "lm": 0.0, "call": 0.0, "extend": 0.0}
    counts = {"call": 0, "extend": 0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[name] += time.perf_counter() - t

        return wrapper

    real_forward, real_probs = head.forward, TreeDrafter.draft_probs
    real_call, real_extend = TreeDrafter.__call__, TreeDrafter.extend
    head.forward = timed("head", real_forward)
    TreeDrafter.draft_probs = lambda self, h: timed("lm", real_probs)(self, h)

    def call(self, nodes, tokens, parents, level):
        if level > 1:
            counts["call"] += 1
            return timed("call", real_call)(self, nodes, tokens, parents, level)
        return real_call(self, nodes, tokens, parents, level)

    def extend(self, features, next_tokens):
        counts["extend"] += 1
        saved = dict(clock)
        out = timed("extend", real_extend)(self, features, next_tokens)
        clock["head"], clock["lm"] = saved["head"], saved["lm"]  # the catch-up is reported on its own
        return out

    TreeDrafter.__call__, TreeDrafter.extend = call, extend
    return clock, counts


def measure(model, tok, head, args, clock, counts):
    """Per prompt: the drafting cost per level and per step (a row), and how many prompts drafted no level."""
    rows, skipped = [], 0
    for messages in load_prompts(args.prompts):
        for k in clock:
            clock[k] = 0.0
        counts.update(call=0, extend=0)
        stats = GenerationStats()
        for _ in decode_steps(
            model,
            tok,
            head,
            messages,
            max_new_tokens=args.max_new_tokens,
            tree=args.tree,
            budget=args.budget,
            depth=args.depth,
            stats=stats,
        ):
            pass
        levels = counts["call"]
        if not levels or not stats.passes:
            skipped += 1
            continue
        rows.append(
            {
                "head": clock["head"] / levels,
                "lm": clock["lm"] / levels,
                "drafter_other": (clock["call"] - clock["head"] - clock["lm"]) / levels,
                "search": stats.times["search"] / levels,
                "level": (clock["call"] + stats.times["search"]) / levels,
                "extend": clock["extend"] / max(counts["extend"], 1),
                "step": (clock["call"] + stats.times["search"] + clock["extend"]) / stats.passes,
                "verify_one": stats.times["verify"] / stats.passes,
                "levels_per_pass": counts["call"] / stats.passes,
            }
        )
    return rows, skipped


def main(argv=None):
    args, head_dir = parse_args(argv)
    model, tok, head, _ = load_models(
        args.target,
        head_dir,
        device="cpu",
        dtype="float32",
        pack=args.pack,
        head_dtype=args.draft_dtype,
        draft_vocab=args.draft_vocab,
    )
    clock, counts = instrument(head)
    rows, skipped = measure(model, tok, head, args, clock, counts)
    if not rows:
        raise SystemExit(
            "no prompt drafted a level (each was answered at once, or the tree drafted nothing): "
            "nothing to measure; use other prompts or more --max-new-tokens"
        )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(
        f"drafting cost on {args.target} + {head_dir} ({next(head.parameters()).dtype}), kernels "
        f"{kernels_used(model)['kernels']}, tree {args.tree} budget {args.budget} depth {args.depth}, "
        f"{len(rows)} prompts x {args.max_new_tokens} tokens, threads {torch.get_num_threads()}"
        + (f" ({skipped} prompts drafted no level and are left out)" if skipped else "")
    )
    print("| per drafting level, ms (median over prompts) | |\n|---|---|")
    for key, label in (
        ("head", "head layer (fc + decoder layer)"),
        ("lm", "lm_head slice + softmax"),
        ("drafter_other", "drafter bookkeeping (masks, slots, gathers)"),
        ("search", "tree search (top-k, ranking, bookkeeping) per level"),
        ("level", "one level in all"),
        ("extend", "catch-up call per step (committed tokens)"),
        ("step", "drafting and search per step (levels + catch-up)"),
        ("verify_one", "verify pass per step (for scale)"),
    ):
        print(f"| {label} | {med[key] * 1e3:.2f} |")
    print(f"| levels per pass | {med['levels_per_pass']:.2f} |")


if __name__ == "__main__":
    main()

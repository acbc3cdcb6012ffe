"""Where a drafting level's time goes: the head layer, the lm_head slice (+ softmax), the drafter's own
Python/tensor bookkeeping, and the tree search's top-k and bookkeeping, measured while decoding real prompts.

    .venv/bin/python benchmarks/draft_cost.py                      # shipped head, CLI defaults (bf16 head, --pack auto)
    .venv/bin/python benchmarks/draft_cost.py --tree eagle2 --budget 8 --prompts heldout:4
    .venv/bin/python benchmarks/draft_cost.py --prompts mtbench:16 --batch-size 8   # one head call a level for 8

Per level = per batch drafter call during tree search (one call drafts a level for every sequence of the
batch; level 1 reuses the root distributions, so it makes no call; the search's work on it is spread over the
calls, so the parts add up to "one level in all"); the catch-up call on committed tokens (`extend`) is reported
per decoding step, and drafting per step = levels x one level + the catch-up. Medians over the batches of
prompts that drafted at least one level (a prompt answered at once, or `auto` drafting nothing, has no level to
measure).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagletree.bench import load_prompts
from eagletree.decode import Decoder
from eagletree.decode import step as decoding_step
from eagletree.decode.config import DecodeConfig
from eagletree.draft import batch_drafter, block_drafter
from eagletree.draft.batch_drafter import make_batch_drafter
from eagletree.draft.drafter import TreeDrafter
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
    ap.add_argument(
        "--copy",
        default="auto",
        choices=["auto", "on", "off"],
        help="copied and retrieved spans (their look-ups count as search)",
    )
    ap.add_argument("--batch-size", type=int, default=1, help="sequences decoded together (one head call a level)")
    ap.add_argument(
        "--lean",
        default="on",
        choices=["on", "off"],
        help="off: the head's transformers layer instead of its lean form (draft/lean.py), for a before/after",
    )
    ap.add_argument("--pack", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--draft-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument(
        "--draft-vocab",
        default="head",
        choices=["head", "full"],
        help="the head's own draft vocabulary or the target's whole one (a larger lm_head per level)",
    )
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens < 2:
        ap.error(f"--max-new-tokens must be >= 2 (one token drafts no level), got {args.max_new_tokens}")

    try:
        head_dir = head_to_load(args.target, args.head)
    except ValueError as e:  # no head shipped for that target, or a mistyped target
        ap.error(str(e))
    if head_dir is None:
        ap.error("--head none: this measures a head's drafting; pass a head folder")
    return args, head_dir


def instrument(head, drafter_class):
    """Time the head's layer, the lm_head slice, the batch drafter's (`drafter_class`) level calls and catch-up
    calls, the searches and the verify passes (in place); returns the running clock (seconds), call counts and the
    rows seen (a row's first catch-up is its prompt's prefill: clear it before each batch)."""
    clock = {"head": 0.0, "lm": 0.0, "call": 0.0, "extend": 0.0, "search": 0.0, "verify": 0.0}
    counts = {"call": 0, "extend": 0, "passes": 0}
    seen: set[int] = set()

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[name] += time.perf_counter() - t

        return wrapper

    real_forward, real_probs = head.forward, TreeDrafter.draft_probs
    real_expand, real_extend = drafter_class.expand, drafter_class.extend
    head.forward = timed("head", real_forward)
    if hasattr(batch_drafter, "lean_forward"):  # the layer's fast path (absent before it existed: a before/after)
        batch_drafter.lean_forward = timed("head", batch_drafter.lean_forward)
    TreeDrafter.draft_probs = lambda self, h: timed("lm", real_probs)(self, h)

    def expand(self, requests):
        if any(level > 1 for *_, level in requests):  # level 1 reuses the root distributions: no head call
            counts["call"] += 1
            return timed("call", real_expand)(self, requests)
        return real_expand(self, requests)

    def extend(self, rows, features, next_tokens, positions=None):
        saved = dict(clock)
        if not seen.issuperset(rows):  # a prompt's first call: its prefill, paid once
            seen.update(rows)
            out = real_extend(self, rows, features, next_tokens, positions)
        else:
            counts["extend"] += 1
            out = timed("extend", real_extend)(self, rows, features, next_tokens, positions)
        clock["head"], clock["lm"] = saved["head"], saved["lm"]  # the catch-up is reported on its own
        return out

    drafter_class.expand, drafter_class.extend = expand, extend
    real_verify = decoding_step.verify_rows

    def verify(*a, **k):
        counts["passes"] += 1
        return timed("verify", real_verify)(*a, **k)

    decoding_step.verify_rows = verify
    return clock, counts, timed, seen


def measure(model, tok, head, args, clock, counts, timed, seen):
    """Per batch of prompts: the drafting cost per level and per step (a row), and how many batches drafted no
    level."""
    decoder = Decoder(
        model,
        tok,
        head,
        DecodeConfig.from_options(
            max_new_tokens=args.max_new_tokens,
            tree=args.tree,
            budget=args.budget,
            depth=args.depth,
            copy={"auto": None, "on": True, "off": False}[args.copy],
        ),
    )
    decoder.prepare(args.batch_size)
    decoder.searcher.search_batch = timed("search", decoder.searcher.search_batch)
    prompts = load_prompts(args.prompts)
    rows, skipped = [], 0
    for first in range(0, len(prompts), args.batch_size):
        for k in clock:
            clock[k] = 0.0
        counts.update(call=0, extend=0, passes=0)
        seen.clear()
        decoder.generate_batch(prompts[first : first + args.batch_size], args.batch_size)
        levels, passes = counts["call"], counts["passes"]
        if not levels or not passes:
            skipped += 1
            continue
        search = clock["search"] - clock["call"]  # the searches' own work between the drafter's calls
        rows.append(
            {
                "head": clock["head"] / levels,
                "lm": clock["lm"] / levels,
                "drafter_other": (clock["call"] - clock["head"] - clock["lm"]) / levels,
                "search": search / levels,
                "level": (clock["call"] + search) / levels,
                "extend": clock["extend"] / max(counts["extend"], 1),
                "step": (clock["call"] + search + clock["extend"]) / passes,
                "verify_one": clock["verify"] / passes,
                "levels_per_pass": levels / passes,
            }
        )
    return rows, skipped


def plain_token_ms(model, tok, args) -> float:
    """t(1): milliseconds a target pass of plain decoding (no head, no copies: one token per sequence a pass) on the
    same prompts, lengths and batches, prefill left out (the batch decoded to its first token only, subtracted), the
    median over the batches."""
    decoders = [
        Decoder(model, tok, None, DecodeConfig.from_options(max_new_tokens=n, copy=False))
        for n in (1, args.max_new_tokens)
    ]
    for decoder in decoders:
        decoder.prepare(args.batch_size)
    prompts, per_pass = load_prompts(args.prompts), []
    for first in range(0, len(prompts), args.batch_size):
        seconds, passes = [], []
        for decoder in decoders:
            t = time.perf_counter()
            results = decoder.generate_batch(prompts[first : first + args.batch_size], args.batch_size)
            seconds.append(time.perf_counter() - t)
            passes.append(max(r.stats.passes for r in results))
        if passes[1] > passes[0]:
            per_pass.append((seconds[1] - seconds[0]) / (passes[1] - passes[0]))
    return statistics.median(per_pass) * 1e3


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
    if args.lean == "off":
        batch_drafter.lean_layer = lambda *a, **k: None
        if hasattr(block_drafter, "lean_block"):  # the block head's lean call (absent before it existed)
            block_drafter.lean_block = lambda *a, **k: None
    t1 = plain_token_ms(model, tok, args)
    clock, counts, timed, seen = instrument(head, type(make_batch_drafter(head, model)))
    rows, skipped = measure(model, tok, head, args, clock, counts, timed, seen)
    if not rows:
        raise SystemExit(
            "no prompt drafted a level (each was answered at once, or the tree drafted nothing): "
            "nothing to measure; use other prompts or more --max-new-tokens"
        )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(
        f"drafting cost on {args.target} + {head_dir} ({next(head.parameters()).dtype}), kernels "
        f"{kernels_used(model)['kernels']}, lean layer {args.lean}, tree {args.tree} budget {args.budget} depth "
        f"{args.depth}, copy {args.copy}, "
        f"{len(rows)} batches of {args.batch_size} x {args.max_new_tokens} tokens, threads {torch.get_num_threads()}"
        + (f" ({skipped} batches drafted no level and are left out)" if skipped else "")
    )
    print("| per drafting level, ms (median over batches) | |\n|---|---|")
    for key, label in (
        ("head", "head layer (fc + decoder layer, lean or transformers)"),
        ("lm", "lm_head slice + softmax"),
        ("drafter_other", "drafter bookkeeping (masks, slots, gathers)"),
        ("search", "tree search (top-k, ranking, bookkeeping) per level"),
        ("level", "one level in all"),
        ("extend", "catch-up call per step (committed tokens; a prompt's first call left out)"),
        ("step", "drafting and search per step (levels + catch-up)"),
        ("verify_one", "verify pass per step (for scale)"),
    ):
        print(f"| {label} | {med[key] * 1e3:.2f} |")
    print(f"| levels per pass | {med['levels_per_pass']:.2f} |")
    print(f"| plain decoding, ms a token: t(1) | {t1:.2f} |")
    print(f"| drafting and search per step / t(1) | {med['step'] * 1e3 / t1:.3f} |")


if __name__ == "__main__":
    main()

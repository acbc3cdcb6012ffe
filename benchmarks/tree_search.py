"""Expected tokens/pass of chain, Sequoia, EAGLE-2 and optimal trees at several budgets, and search cost.

    .venv/bin/python benchmarks/tree_search.py --head eagletree/heads/smollm2-135m [--prompts 4]
    .venv/bin/python benchmarks/tree_search.py --synthetic [--steps 200]

With --head, the draft distributions are the real head's, recorded during real greedy decoding of
held-out ShareGPT prompts: at every decoding step each method builds its tree from the same drafter
state. --synthetic uses random distributions instead (a softmax over 1,000 tokens with a random
sharpness per path). A node's acceptance is taken to be its draft probability, so E[tokens/pass] =
1 + sum of path products (the head's calibration is reported by its evaluation). Search times are
for the batched forms used in generation, drafting (head calls) timed separately; verify times are
measured on the target in the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch
from tqdm import tqdm

from eagletree.bench import TimedDrafter, sharegpt_heldout
from eagletree.decode import decode_steps
from eagletree.loading import load_models
from eagletree.packing import kernels_used
from eagletree.search import (
    chain_shape,
    eagle2_search,
    optimal_search,
    path_expand,
    sequoia_tree,
    static_search,
)
from eagletree.train.evaluate import heldout_prompts
from eagletree.verify.profile import measure_verify

BUDGETS = (8, 16, 32, 60)


def synthetic_drafter(step: int, vocab: int = 1000):
    def child_probs(path):
        digest = hashlib.sha256(f"{step}/{path}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        sharpness = 1.0 + 4.0 * float(torch.rand((), generator=g))
        return torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * sharpness, -1)

    return child_probs


def accept_by_rank(steps: int, k: int = 10) -> list[float]:
    """Mean probability of the r-th ranked draft token: Sequoia's per-rank acceptance estimate."""
    tops = [torch.sort(synthetic_drafter(10_000 + s)(()), descending=True).values[:k] for s in range(steps)]
    return torch.stack(tops).mean(0).tolist()


def record_real(args, shapes):
    """Per decoding step of real greedy decoding: every method's tree from the same head state."""
    # the head in its saved precision; the target's kernels as the CLI runs them (--pack auto)
    model, tok, head, _ = load_models(args.target, args.head, head_dtype=None, pack="auto")
    expected, search_s, draft_s = {}, {}, {}

    def inspect(drafter, root):
        for b in BUDGETS:
            for m, build in builders(b, shapes, args, drafter.token_map).items():
                drafter.begin_tree()
                timed = TimedDrafter(drafter)
                t0 = time.perf_counter()
                tree = build(timed, root)
                expected.setdefault((m, b), []).append(tree.expected_tokens)
                search_s.setdefault((m, b), []).append(time.perf_counter() - t0 - timed.seconds)
                draft_s.setdefault((m, b), []).append(timed.seconds)

    for messages in tqdm(heldout_prompts(sharegpt_heldout()[300:], args.prompts), desc="prompts"):
        for _ in decode_steps(
            model,
            tok,
            head,
            messages,
            max_new_tokens=args.max_new_tokens,
            tree="eagle2",
            budget=60,
            inspect_step=inspect,
        ):
            pass
    verify = measure_verify(model, BUDGETS, reps=4, progress=False)
    return expected, search_s, draft_s, verify, kernels_used(model)["kernels"]


def builders(b, shapes, args, token_map=None):
    kw = dict(token_map=token_map)
    return {
        "chain": lambda e, root: static_search(e, root, chain_shape(min(b - 1, args.depth)), **kw),
        "sequoia": lambda e, root: static_search(e, root, shapes[b], **kw),
        "eagle2": lambda e, root: eagle2_search(e, root, b, args.depth, args.top_k, **kw),
        "optimal": lambda e, root: optimal_search(e, root, b, args.depth, args.top_k, **kw),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=None, help="record real draft distributions with this head")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=None, help="synthetic steps (--synthetic only; default 200)")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--synthetic", action="store_true", help="random draft distributions instead of a head")
    args = ap.parse_args(argv)
    if not args.synthetic and not args.head:
        ap.error("pass --head DIR (real draft distributions) or --synthetic")
    if args.synthetic and args.head:
        ap.error("--head and --synthetic exclude each other: real draft distributions or random ones")
    if args.head and args.steps is not None:
        ap.error("--steps counts synthetic steps; with --head the steps are those of decoding --prompts prompts")
    for name in ("prompts", "max_new_tokens", "steps", "depth", "top_k"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    args.steps = 200 if args.steps is None else args.steps

    ranks = accept_by_rank(200, args.top_k)  # Sequoia's per-rank acceptance estimate
    shapes = {b: sequoia_tree(ranks, b, args.depth) for b in BUDGETS}
    methods = ("chain", "sequoia", "eagle2", "optimal")
    if args.synthetic:
        expected, search_s, draft_s, verify, kernels = record_synthetic(args, shapes), {}, {}, {}, None
        expected, search_s = expected
        source = f"{args.steps} synthetic steps"
    else:
        expected, search_s, draft_s, verify, kernels = record_real(args, shapes)
        source = (
            f"{len(expected[('eagle2', BUDGETS[0])])} real decoding steps ({args.prompts} held-out prompts, "
            f"head {args.head})"
        )

    print(f"\nE[tokens/pass] by draft confidence, mean over {source}, depth {args.depth}, top_k {args.top_k}")
    print("| budget | " + " | ".join(methods) + " | eagle2 < optimal (share of steps) | mean shortfall |")
    print("|---|" + "---|" * (len(methods) + 2))
    for b in BUDGETS:
        e2, opt = torch.tensor(expected[("eagle2", b)]), torch.tensor(expected[("optimal", b)])
        short = (opt - e2) > 1e-9
        gap = float(((opt - e2) / opt)[short].mean()) if short.any() else 0.0
        row = " | ".join(f"{statistics.mean(expected[(m, b)]):.3f}" for m in methods)
        print(f"| {b} | {row} | {float(short.float().mean()):.0%} | {gap:.2%} |")

    print(
        "\nper step, ms (median): tree search (batched form, head calls excluded) / drafting (head calls)"
        + (f" and the verify pass of that many nodes ({kernels} kernels, as the CLI runs them)" if verify else "")
    )
    print("| budget | " + " | ".join(methods) + (" | verify pass |" if verify else " |"))
    print("|---|" + "---|" * (len(methods) + (1 if verify else 0)))
    for b in BUDGETS:
        cells = []
        for m in methods:
            cell = f"{statistics.median(search_s[(m, b)]) * 1e3:.2f}"
            if draft_s:
                cell += f" / {statistics.median(draft_s[(m, b)]) * 1e3:.1f}"
            cells.append(cell)
        extra = f" | {verify[b]['forward'] * 1e3:.1f} |" if verify else " |"
        print(f"| {b} | {' | '.join(cells)}{extra}")


def record_synthetic(args, shapes):
    expected, seconds = {}, {}
    for step in tqdm(range(args.steps), desc="tree search"):
        child_probs = synthetic_drafter(step)
        for b in BUDGETS:
            for m, build in builders(b, shapes, args).items():
                timed = TimedDrafter(path_expand(child_probs))
                t0 = time.perf_counter()
                tree = build(timed, 0)
                seconds.setdefault((m, b), []).append(time.perf_counter() - t0 - timed.seconds)
                expected.setdefault((m, b), []).append(tree.expected_tokens)
    return expected, seconds


if __name__ == "__main__":
    main()

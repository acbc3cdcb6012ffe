"""Expected tokens/pass of chain, Sequoia, EAGLE-2 and optimal trees at several budgets, and search cost.

    .venv/bin/python benchmarks/tree_search.py [--steps 200] [--verify-target smollm2-135m]

Draft distributions are synthetic until a trained head exists (P4): per path a softmax over a
1,000-token vocabulary with a random sharpness, so the drafter's confidence varies from step to
step like a real head's. All methods see the same drafter and steps; a node's acceptance is
taken to be its draft probability (a calibrated drafter), so E[tokens/pass] = 1 + sum of path products.
Search times are for the batched forms used in generation; verify times, when asked for, are
measured on the target in the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch
from tqdm import tqdm

from eagletree.tree_search import (
    chain_shape, eagle2_search, optimal_search, path_expand, sequoia_tree, static_search,
)

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--verify-target", default=None, help="also measure verify time per budget on this target")
    args = ap.parse_args(argv)

    ranks = accept_by_rank(200, args.top_k)
    shapes = {b: sequoia_tree(ranks, b, args.depth) for b in BUDGETS}
    methods = ("chain", "sequoia", "eagle2", "optimal")
    expected = {(m, b): [] for m in methods for b in BUDGETS}
    seconds = {(m, b): [] for m in methods for b in BUDGETS}
    for step in tqdm(range(args.steps), desc="tree search"):
        child_probs = synthetic_drafter(step)
        for b in BUDGETS:
            builders = {
                "chain": lambda e: static_search(e, 0, chain_shape(min(b - 1, args.depth))),
                "sequoia": lambda e: static_search(e, 0, shapes[b]),
                "eagle2": lambda e: eagle2_search(e, 0, b, args.depth, args.top_k),
                "optimal": lambda e: optimal_search(e, 0, b, args.depth, args.top_k),
            }
            for m, build in builders.items():
                expand = path_expand(child_probs)
                drafting = [0.0]

                def timed(nodes, tokens, parents, level, expand=expand, drafting=drafting):
                    t = time.perf_counter()
                    out = expand(nodes, tokens, parents, level)
                    drafting[0] += time.perf_counter() - t
                    return out

                t0 = time.perf_counter()
                tree = build(timed)
                seconds[(m, b)].append(time.perf_counter() - t0 - drafting[0])  # search only, drafter excluded
                expected[(m, b)].append(tree.expected_tokens)

    print(f"\nE[tokens/pass] (mean over {args.steps} synthetic steps, depth {args.depth}, top_k {args.top_k})")
    print("| budget | " + " | ".join(methods) + " | eagle2 < optimal (share of steps) | mean shortfall |")
    print("|---|" + "---|" * (len(methods) + 2))
    for b in BUDGETS:
        e2, opt = torch.tensor(expected[("eagle2", b)]), torch.tensor(expected[("optimal", b)])
        short = (opt - e2) > 1e-9
        gap = float(((opt - e2) / opt)[short].mean()) if short.any() else 0.0
        row = " | ".join(f"{statistics.mean(expected[(m, b)]):.3f}" for m in methods)
        print(f"| {b} | {row} | {float(short.float().mean()):.0%} | {gap:.2%} |")

    print("\nsearch time per step, ms (batched form, drafter calls excluded)")
    print("| budget | " + " | ".join(methods) + (" | verify pass |" if args.verify_target else " |"))
    print("|---|" + "---|" * (len(methods) + (1 if args.verify_target else 0)))
    verify = {}
    if args.verify_target:
        from eagletree.target import load_target
        from eagletree.verify.profile import measure_verify

        model, _ = load_target(args.verify_target)
        verify = measure_verify(model, BUDGETS, reps=4)
    for b in BUDGETS:
        row = " | ".join(f"{statistics.median(seconds[(m, b)]) * 1e3:.2f}" for m in methods)
        extra = f" | {verify[b]['forward'] * 1e3:.1f} |" if verify else " |"
        print(f"| {b} | {row}{extra}")
    print("\ndrafting time per level: needs a trained head (P4); not measured here")


if __name__ == "__main__":
    main()

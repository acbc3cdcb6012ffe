"""Predicted batched throughput on a latency profile: one node budget for the batch vs per-sequence trees vs chains.

Decodes the prompts one at a time with the optimal tree at a large budget and keeps every step's candidate
nodes (path values, calibrated by the head's calibration when it has one) and each step's best chain. Steps of
B different prompts then form the passes of a batch of B, and for each batch size it predicts, per pass:

- one budget: the B x b best nodes of all B trees together (`best_nodes`), as eagle2/optimal verify a batch;
- per sequence: each sequence's own b best nodes (the equal split, at the same B x b rows);
- chains: each sequence's best chain of b - 1 drafts;
- plain: one row per sequence.

Expected tokens per pass are 1 + the chosen values per sequence; tokens/s divide B x that by the profile's
t(B, rows) (`LatencyProfile.batch_time`; drafting is not charged, as on a GPU where the head's levels are a
small share). Without --profile the profile is an ASSUMED GPU one (stated in the output): t(B, R) = t1 (1 +
R / 1024), flat until the pass becomes compute-bound; pass a profile measured on the device (e.g. the GPU run's
8B config) with --profile.

    python benchmarks/batch_prediction.py --prompts mtbench:16 --max-new-tokens 64 --budget 8 --batch-sizes 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import random

import torch

from eagletree import DecodeConfig, Decoder
from eagletree.bench import load_prompts
from eagletree.decode.resources import head_calibrator
from eagletree.draft import load_head
from eagletree.loading import head_to_load
from eagletree.search.cost import LatencyProfile
from eagletree.search.searchers import best_nodes, calibrated_values
from eagletree.target import load_target

SEARCH_BUDGET = 128  # nodes per step searched: enough that a batch's one budget finds all it would take


def assumed_gpu_profile() -> LatencyProfile:
    sizes = [1, 2, 4, 8, 16, 32, 64]
    t1 = 0.02
    batches = {str(b): [t1 * (1 + b * n / 1024) for n in sizes] for b in (2, 4, 8, 16, 32)}
    return LatencyProfile(sizes, [t1 * (1 + n / 1024) for n in sizes], batch_verify_s=batches, notes={"assumed": True})


def chain_values(tree) -> torch.Tensor:
    """Path values of the tree's best chain: from the root, the most valuable child at each level."""
    children = tree.children()
    values, v, out = tree.values, 0, []
    while children[v]:
        v = max(children[v], key=lambda c: float(values[c]))
        out.append(float(values[v]))
    return torch.tensor(out, dtype=torch.float64)


def step_values(target, tok, head, prompts, max_new_tokens: int) -> list[list[tuple]]:
    """Per prompt, per step: (candidate values best first, best chain's values)."""
    calibrator = head_calibrator(head)
    decoder = Decoder(
        target, tok, head, DecodeConfig(tree="optimal", budget=SEARCH_BUDGET, max_new_tokens=max_new_tokens)
    )
    out = []
    for prompt in prompts:
        steps = []
        for step in decoder.steps(prompt):
            tree = step.draft
            values = tree.values[1:] if calibrator is None else calibrated_values(tree, calibrator)
            tree.values = torch.cat([torch.ones(1, dtype=torch.float64), values.double()])
            steps.append((torch.sort(values.double(), descending=True).values, chain_values(tree)))
        out.append(steps)
    return out


def predict(steps, profile: LatencyProfile, batch: int, budget: int, passes: int, seed: int = 0) -> dict:
    """Mean tokens per sequence per pass and tokens/s of each policy over `passes` random batches of steps."""
    rng = random.Random(seed)
    totals = {"plain": 0.0, "chains": 0.0, "per sequence": 0.0, "one budget": 0.0}
    for _ in range(passes):
        picked = [rng.choice(steps[i]) for i in rng.sample(range(len(steps)), batch)]
        values = [v for v, _ in picked]
        totals["plain"] += batch
        totals["chains"] += sum(1 + float(c[: budget - 1].sum()) for _, c in picked)
        totals["per sequence"] += sum(1 + float(v[: budget - 1].sum()) for v in values)
        counts = best_nodes(values, batch * budget)
        totals["one budget"] += sum(1 + float(v[: n - 1].sum()) for v, n in zip(values, counts))
    rows = {"plain": batch, "chains": batch * budget, "per sequence": batch * budget, "one budget": batch * budget}
    return {
        name: (total / passes / batch, total / passes / float(profile.batch_time(batch, rows[name])))
        for name, total in totals.items()
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default="mtbench:16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=8, help="nodes per sequence, root included")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--profile", default=None, help="a latency profile JSON (default: an assumed GPU profile)")
    ap.add_argument("--passes", type=int, default=2000, help="random batches drawn per batch size")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    target, tok = load_target(args.target)
    head = load_head(head_to_load(args.target, None), target_config=target.config)
    prompts = load_prompts(args.prompts)
    if max(sizes) > len(prompts):
        raise SystemExit(f"--batch-sizes up to {max(sizes)} need at least that many prompts, got {len(prompts)}")
    profile = LatencyProfile.load(args.profile) if args.profile else assumed_gpu_profile()
    where = args.profile or "an ASSUMED GPU profile, t(B, R) = t1 (1 + R / 1024)"
    steps = step_values(target, tok, head, prompts, args.max_new_tokens)
    print(
        f"{args.target} + shipped head, {len(prompts)} prompts x {args.max_new_tokens} tokens, {args.budget} nodes "
        f"per sequence; profile: {where}"
    )
    print("| batch | policy | tokens / sequence / pass | predicted tokens/s | over plain |\n|---|---|---|---|---|")
    for b in sizes:
        result = predict(steps, profile, b, args.budget, args.passes)
        for name, (tpp, rate) in result.items():
            print(f"| {b} | {name} | {tpp:.2f} | {rate:.0f} | {rate / result['plain'][1]:.2f}x |")


if __name__ == "__main__":
    main()

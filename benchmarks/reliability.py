"""How well the tree search's values predict acceptance: predicted vs accepted nodes, by source and depth.

    .venv/bin/python benchmarks/reliability.py --prompts humaneval:21-40 --max-new-tokens 128

Every prompt is decoded with the shipped head (EAGLE-2, --budget nodes, greedy, copied and retrieved spans as
in `generate`). Each verified node whose parent was accepted had a chance: the search valued it with a factor,
its estimate of P(accepted | parent accepted). Summed over such nodes, the factors predict how many are
accepted; verification counts how many were. Rows: the head's nodes by depth, copied-only nodes by factor,
and nodes both proposed (the head and a copy agreeing) by depth. A ratio far from 1 in a row with many
nodes says the values misrank that kind against the others; ratios near 1 everywhere say the search
chooses as well as its estimates allow, and only sharper drafts (or more nodes) raise tokens/pass.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from tqdm import tqdm

from eagletree.bench import load_prompts
from eagletree.decode import GenerationStats, decode_steps
from eagletree.loading import SHIPPED_HEADS, load_models
from eagletree.search.copy import copy_only

TARGET = "smollm2-135m"


def node_rows(tree, accepted) -> list[tuple[str, float, bool]]:
    """(row, factor, accepted) for every node of a verified tree whose parent was accepted."""
    on_path = set(accepted)
    parents = tree.parents.tolist()
    factors = tree.draft_probs.tolist()
    rows = []
    for v in range(1, len(parents)):
        if parents[v] not in on_path:
            continue
        info = tree.copy_info[v] if tree.copy_info is not None else None
        depth = int(tree.depths[v])
        if info is None:
            row = f"head only, depth {depth}" if depth < 4 else "head only, depth 4+"
        elif copy_only(info):
            row = "copied only, factor < 0.5" if factors[v] < 0.5 else "copied only, factor >= 0.5"
        else:
            row = "both agree, depth 1" if depth == 1 else "both agree, depth 2+"
        rows.append((row, factors[v], v in on_path))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=str(SHIPPED_HEADS[TARGET]))
    ap.add_argument("--prompts", default="humaneval:21-40", help="mtbench[:N], humaneval[:N], humaneval:A-B, heldout:N")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--copy", default="on", choices=["on", "off"])
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.budget < 2:
        ap.error(f"--max-new-tokens must be >= 1 and --budget >= 2, got {args.max_new_tokens} and {args.budget}")
    try:
        prompts = load_prompts(args.prompts)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    target, tok, head, _ = load_models(TARGET, args.head, pack="auto", head_dtype=None)  # the head as saved
    totals = defaultdict(lambda: [0, 0.0, 0])  # row -> [nodes, predicted, accepted]
    new = passes = 0
    for prompt in tqdm(prompts, desc="prompts", unit="prompt"):
        stats = GenerationStats(steps=[])
        for _ in decode_steps(
            target,
            tok,
            head,
            prompt,
            max_new_tokens=args.max_new_tokens,
            tree="eagle2",
            budget=args.budget,
            copy=args.copy == "on",
            stats=stats,
        ):
            pass
        new, passes = new + stats.new_tokens, passes + stats.passes
        for tree, accepted in stats.steps:
            if tree.draft_probs is None:  # the root alone: nothing drafted
                continue
            for row, factor, hit in node_rows(tree, accepted):
                t = totals[row]
                t[0], t[1], t[2] = t[0] + 1, t[1] + factor, t[2] + hit
    print(
        f"{len(prompts)} prompts ({args.prompts}) x {args.max_new_tokens} new tokens, EAGLE-2 {args.budget} nodes, "
        f"copy {args.copy}: {new / max(passes, 1):.3f} tokens/pass over {passes} passes\n"
    )
    print("| nodes (parent accepted) | count | predicted accepted | accepted | accepted / predicted |")
    print("|---|---|---|---|---|")
    for row in sorted(totals):
        n, predicted, hits = totals[row]
        print(f"| {row} | {n:,} | {predicted:.1f} | {hits} | {hits / predicted if predicted else float('nan'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

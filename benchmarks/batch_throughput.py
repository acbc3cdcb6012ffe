"""Batched decoding throughput: HF batched `generate`, eagletree's batched plain decoding and with trees.

For each batch size, in one run (`eagletree.bench.throughput`): HF `generate` on the prompts B at a time,
eagletree plain and eagletree with the shipped head (the default `auto` tree, or --tree), both through
`Decoder.generate_batch(prompts, B)` (continuous batching). Prints tokens/s per method and batch size and the
ratios the batching goals are about, checks every eagletree answer against plain decoding of the prompt alone,
and reports how the node budget split across the sequences of each pass (with --tree eagle2/optimal also an
equal split per sequence at the same total: tokens per pass). --plot writes the throughput plot.

    python benchmarks/batch_throughput.py --prompts mtbench:32 --max-new-tokens 128 --batch-sizes 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json

import torch

from eagletree import DecodeConfig, Decoder
from eagletree.bench import load_prompts
from eagletree.bench.throughput import budget_split, plot_throughput, throughput, throughput_table
from eagletree.draft import load_head
from eagletree.loading import head_to_load
from eagletree.packing import cpu_model, kernels_tag, pack_target
from eagletree.target import load_target


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default="mtbench:8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--tree", default="auto", help="the tree kind of the 'trees' method (default: the default)")
    ap.add_argument("--budget", type=int, default=None, help="nodes per sequence (default: by device)")
    ap.add_argument("--split", action="store_true", help="only the budget split (eagle2/optimal: vs an equal split)")
    ap.add_argument("--plot", default=None, help="write the throughput plot to this file (.png)")
    ap.add_argument("--pack", default="auto", choices=["auto", "on", "off"], help="the target's kernels, as the CLI's")
    ap.add_argument("--repeats", type=int, default=1, help="rounds per batch size, methods alternating (medians)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    target, tok = load_target(args.target)
    pack_target(target, args.pack)  # (the kernels the command line runs)
    head = load_head(head_to_load(args.target, None), target_config=target.config)
    prompts = load_prompts(args.prompts)
    config = DecodeConfig(tree=args.tree, budget=args.budget, max_new_tokens=args.max_new_tokens)
    trees = Decoder(target, tok, head, config)
    print(
        f"{args.target}, {len(prompts)} prompts x {args.max_new_tokens} tokens, {cpu_model()}, "
        f"{torch.get_num_threads()} threads, kernels {kernels_tag(target) or 'stock'}; "
        f"trees: {trees.config.tree.value}, budget {trees.config.budget} per sequence"
    )
    if not args.split:
        result = throughput(target, tok, head, prompts, sizes, config, repeats=args.repeats)
        print(throughput_table(result))
        if args.plot:
            plot_throughput(result, args.plot)
            print(f"plot: {args.plot}")
    for b in sizes:
        print(
            f"B={b} one budget ({trees.config.tree.value}): {json.dumps(budget_split(trees, prompts, b))}", flush=True
        )
        if trees.config.tree.value in ("eagle2", "optimal"):
            trees.searcher.global_budget = False
            print(f"B={b} equal split per sequence: {json.dumps(budget_split(trees, prompts, b))}", flush=True)
            trees.searcher.global_budget = True


if __name__ == "__main__":
    main()

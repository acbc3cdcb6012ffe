"""Verify-pass latency t(N)/t(1) and the engine's own overhead, measured side by side in one run.

    .venv/bin/python benchmarks/verify_cost.py                       # real SmolLM2 on CPU
    .venv/bin/python benchmarks/verify_cost.py --device cuda         # bf16, SDPA with the boolean mask
    .venv/bin/python benchmarks/verify_cost.py --config cfg.json     # random weights from a config (no download)

Every N is measured round-robin in the same loop, so machine noise hits all of them alike; the
table reports medians. Overhead = mask + acceptance + KV commit, as a fraction of the target pass.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from eagletree.target import load_target, new_cache, tree_forward, truncate_cache
from eagletree.verify import DraftTree, accept_tree, commit, prefill


def random_tree(n: int, depth: int, vocab: int, g: torch.Generator, root: int) -> DraftTree:
    """A random tree with distinct sibling tokens: parents drawn among nodes above the depth limit."""
    parents, depths, tokens = [-1], [0], [root]
    for v in range(1, n):
        while True:
            u = int(torch.randint(v, (1,), generator=g))
            if depths[u] < depth:
                break
        parents.append(u)
        depths.append(depths[u] + 1)
        tokens.append((v * 7919) % vocab)  # distinct within the tree, so siblings never repeat
    return DraftTree(tokens, parents)


def load(args):
    if args.config:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.config)
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        return model, args.config
    model, _ = load_target(args.target, device=args.device)
    return model, args.target


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--config", help="a model config.json: build random weights instead of loading --target")
    ap.add_argument("--device", default=None)
    ap.add_argument("--prefix", type=int, default=256, help="committed context length before the tree")
    ap.add_argument("--sizes", default="1,4,8,16,32,64,128")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args(argv)

    model, name = load(args)
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    sizes = [int(s) for s in args.sizes.split(",")]
    g = torch.Generator().manual_seed(0)
    cache = new_cache(model)
    prefill(model, cache, torch.randint(vocab, (args.prefix,), generator=g).to(device))
    trees = {n: random_tree(n, min(args.depth, n - 1), vocab, g, root=1).to(device) for n in sizes}
    cols = ("mask", "forward", "accept", "accept_t1", "commit")
    times = {n: {c: [] for c in cols} for n in sizes}
    sampler = torch.Generator().manual_seed(1)

    for rep in tqdm(range(args.reps + 1), desc=f"verify cost on {name} ({device.type})"):
        for n in sizes:
            tree = trees[n]
            sync(device)
            t0 = time.perf_counter()
            allowed, positions = tree.attention_mask(args.prefix), tree.position_ids(args.prefix)
            sync(device)
            t1 = time.perf_counter()
            out = tree_forward(model, tree.tokens[None], cache, allowed, positions)
            sync(device)
            t2 = time.perf_counter()
            accepted, _ = accept_tree(tree, out.logits[0])
            sync(device)
            t3 = time.perf_counter()
            accept_tree(tree, out.logits[0], temperature=1.0, generator=sampler)
            sync(device)
            t4 = time.perf_counter()
            commit(cache, args.prefix, accepted)
            sync(device)
            t5 = time.perf_counter()
            truncate_cache(cache, args.prefix)
            if rep:  # the first round warms up
                for c, dt in zip(cols, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    times[n][c].append(dt)

    med = {n: {c: statistics.median(v) for c, v in times[n].items()} for n in sizes}
    base = med[sizes[0]]["forward"]
    print(f"\nverify pass on {name}, {device.type}, {model.dtype}, prefix {args.prefix}, depth <= {args.depth}, "
          f"median of {args.reps} round-robin reps")
    print("| N | forward ms | t(N)/t(1) | mask ms | accept ms (greedy) | accept ms (T=1) | commit ms "
          "| overhead greedy | overhead T=1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        m = med[n]
        over_g = (m["mask"] + m["accept"] + m["commit"]) / m["forward"]
        over_s = (m["mask"] + m["accept_t1"] + m["commit"]) / m["forward"]
        print(f"| {n} | {m['forward'] * 1e3:.1f} | {m['forward'] / base:.2f} | {m['mask'] * 1e3:.2f} | "
              f"{m['accept'] * 1e3:.2f} | {m['accept_t1'] * 1e3:.2f} | {m['commit'] * 1e3:.2f} | "
              f"{over_g:.1%} | {over_s:.1%} |")


if __name__ == "__main__":
    main()

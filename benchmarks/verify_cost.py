"""Verify-pass latency t(N)/t(1) and the engine's own overhead, measured side by side in one run.

    .venv/bin/python benchmarks/verify_cost.py                       # real SmolLM2 on CPU
    .venv/bin/python benchmarks/verify_cost.py --device cuda         # bf16, SDPA with the boolean mask
    .venv/bin/python benchmarks/verify_cost.py --config cfg.json     # random weights from a config (no download)
    .venv/bin/python benchmarks/verify_cost.py --pack off            # PyTorch's stock CPU kernels only

Every N is measured round-robin in the same loop, so machine noise hits all of them alike; the
table reports medians. Overhead = mask + acceptance + KV commit, as a fraction of the target pass. With the target's
Linears packed for oneDNN (`--pack`, on by default on CPU, as in the CLI) every N is also measured with the
stock kernels in the same loop (the two kernels' order alternating from round to round), and a column
compares each pass with a stock one-token pass. N = 1 is always measured: it is the base of the ratios.

A last table times the passes decoding itself runs (`verify.batch.verify_rows`: the ragged pass, through the
lean path where the target has one, with greedy acceptance and commit), as `auto`'s profile measures them:
their level and shape differ from transformers' tree pass.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch

from eagletree.bench import build_config, parse_list, random_target
from eagletree.cli.common import at_least
from eagletree.loading import load_models
from eagletree.packing import pack_target, packing_problem, stock_kernels
from eagletree.verify.profile import measure_batch_verify, measure_verify


def load(args):
    """The model to measure: random weights from --config, else the --target model."""
    if args.config:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        return random_target(build_config(args.config), device, dtype), args.config
    model, _, _, _ = load_models(args.target, device=args.device)
    return model, args.target


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument(
        "--config",
        help="a model config.json (or a built-in name: llama-3.1-8b): build random weights instead of loading --target",
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--prefix", type=int, default=256, help="committed context length before the tree")
    ap.add_argument("--sizes", default="1,4,8,16,32,64,128")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--reps", type=at_least(1), default=12)
    ap.add_argument(
        "--pack",
        default="auto",
        choices=["auto", "on", "off"],
        help="pack the target's Linears for oneDNN (CPU) at every size, to compare with the stock "
        "kernels; auto = where it can",
    )
    args = ap.parse_args(argv)

    model, name = load(args)
    device = next(model.parameters()).device
    sizes = sorted({1, *parse_list(args.sizes, int, "sizes")})  # t(1): the base of the ratios
    if sizes[0] < 1:
        raise SystemExit(f"--sizes must be tree sizes >= 1, got {args.sizes}")
    packed = pack_target(model, "on" if args.pack == "auto" and not packing_problem(model) else args.pack) > 0
    variants = {"packed": nullcontext} if packed else {}
    variants["stock"] = lambda: stock_kernels(model)
    runs = measure_verify(model, sizes, prefix=args.prefix, depth=args.depth, reps=args.reps, variants=variants)
    stock_one = runs["stock"][1]["forward"]
    for kernels, med in runs.items():
        base = med[1]["forward"]
        print(
            f"\nverify pass on {name}, {device.type}, {model.dtype}, {kernels} kernels, prefix {args.prefix}, "
            f"depth <= {args.depth}, median of {args.reps} round-robin reps"
            + (", both kernels in the same loop" if packed else "")
        )
        print(
            "| N | forward ms | t(N)/t(1) | t(N) / stock t(1) | mask ms | accept ms (greedy) | accept ms (T=1) "
            "| commit ms | overhead greedy | overhead T=1 |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for n in sizes:
            m = med[n]
            over_g = (m["mask"] + m["accept"] + m["commit"]) / m["forward"]
            over_s = (m["mask"] + m["accept_t1"] + m["commit"]) / m["forward"]
            print(
                f"| {n} | {m['forward'] * 1e3:.1f} | {m['forward'] / base:.2f} | {m['forward'] / stock_one:.2f} | "
                f"{m['mask'] * 1e3:.2f} | {m['accept'] * 1e3:.2f} | {m['accept_t1'] * 1e3:.2f} | "
                f"{m['commit'] * 1e3:.2f} | {over_g:.1%} | {over_s:.1%} |"
            )
    if "packed" in runs:  # like --pack auto (which times the Linears alone), per N: the faster kernel here
        print(
            "\nfaster kernel per N (whole forward pass): "
            + ", ".join(
                f"N={n}: {'packed' if runs['packed'][n]['forward'] < runs['stock'][n]['forward'] else 'stock'} "
                f"({runs['packed'][n]['forward'] * 1e3:.1f} vs stock {runs['stock'][n]['forward'] * 1e3:.1f} ms)"
                for n in sizes
            )
        )

    ragged = measure_batch_verify(model, 1, sizes, prefix=args.prefix, depth=args.depth, reps=args.reps)
    print(
        f"\nthe passes decoding runs ({'packed' if packed else 'stock'} kernels; ragged, lean path where there is "
        f"one; forward, greedy acceptance and commit), prefix {args.prefix}, median of {args.reps} reps"
    )
    print("| N | step ms | t(N)/t(1) |")
    print("|---|---|---|")
    for n, t in zip(sizes, ragged):
        print(f"| {n} | {t * 1e3:.1f} | {t / ragged[0]:.2f} |")


if __name__ == "__main__":
    main()

"""The Python API's defaults against plain decoding, as a new user meets them.

For each prompt, alternating in one run: plain greedy HF `generate` (the target as `load_target` gives
it), `eagletree.generate(...)` with no decoding options (the device's defaults; timed per call, so the
Decoder it builds on its first call and reuses is timed too), one `Decoder` with the defaults reused for
every prompt, and one with EAGLE-2's 60 nodes (the GPU setting). Prints each method's speed over plain
decoding (median and range over the runs) and checks that every greedy answer is plain decoding's token
for token.

    python benchmarks/api_default.py --prompts mtbench:4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagletree import DecodeConfig, Decoder, generate
from eagletree.bench import load_prompts, run_hf
from eagletree.draft import load_head
from eagletree.loading import head_to_load
from eagletree.packing import cpu_model
from eagletree.target import load_target


def timed(fn):
    t = time.perf_counter()
    ids = fn()
    return ids, time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default="mtbench:4")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="times each prompt is decoded by every method")
    args = ap.parse_args(argv)
    target, tok = load_target(args.target)
    head = load_head(head_to_load(args.target, None), target_config=target.config)
    prompts = load_prompts(args.prompts)
    n = args.max_new_tokens
    reused = Decoder(target, tok, head, DecodeConfig(max_new_tokens=n))
    eagle2 = Decoder(target, tok, head, DecodeConfig(tree="eagle2", budget=60, max_new_tokens=n))
    methods = {
        "generate() defaults": lambda p: generate(target, tok, head, p, max_new_tokens=n).token_ids,
        "Decoder defaults, reused": lambda p: reused.generate(p).token_ids,
        "Decoder eagle2 60, reused": lambda p: eagle2.generate(p).token_ids,
    }
    print(
        f"{args.target} + shipped head, {len(prompts)} prompts x {n} tokens, {args.rounds} rounds, "
        f"{cpu_model()}, {torch.get_num_threads()} threads; defaults: {reused.config.tree.value}, "
        f"budget {reused.config.budget}"
    )
    ratios = {name: [] for name in methods}
    for _ in range(args.rounds):
        for i, messages in enumerate(prompts):
            plain = run_hf(target, tok, messages, n, 0.0, 0)
            for name, method in methods.items():
                ids, seconds = timed(lambda: method(messages))  # noqa: B023 (called at once)
                if ids != plain.token_ids:
                    raise SystemExit(f"prompt {i}: {name} differs from plain decoding")
                ratios[name].append(plain.seconds / seconds)
    print("| method | speed over plain greedy HF generate: median (range) |\n|---|---|")
    for name, values in ratios.items():
        print(f"| {name} | {statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}) |")
    print("every answer identical to plain decoding: True")


if __name__ == "__main__":
    main()

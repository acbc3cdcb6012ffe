"""A bf16 target on the CPU: plain bf16 vs plain fp32 decoding speed, and how often a bf16 tree leaves plain bf16.

    .venv/bin/python benchmarks/bf16_agreement.py --prompts 16 --max-new-tokens 96

Per held-out prompt: plain decoding (HF generate) in fp32 and in bf16 side by side (the order alternates),
both with every Linear packed for oneDNN, then an EAGLE-2 tree of --budget nodes in bf16. A comparison runs to
the first token where two outputs differ; the mismatch rate is differences per 1,000 tokens compared.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import warnings

from eagletree.bench import first_difference, load_prompts, run_hf
from eagletree.decode import generate
from eagletree.loading import SHIPPED_HEADS, load_models

TARGET = "smollm2-135m"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="held-out ShareGPT prompts (bench's heldout:N)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--budget", type=int, default=8)
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or args.budget < 1:
        ap.error("--prompts, --max-new-tokens and --budget must be >= 1")

    warnings.simplefilter("ignore")
    prompts = load_prompts(f"heldout:{args.prompts}")
    models = {}  # both with every Linear packed for oneDNN
    models["fp32"], tok, _, _ = load_models(TARGET, device="cpu", dtype="float32", pack="on")
    models["bf16"], _, head, _ = load_models(
        TARGET, SHIPPED_HEADS[TARGET], device="cpu", dtype="bfloat16", pack="on", head_dtype="bfloat16"
    )
    rates = {"fp32": [], "bf16": []}
    mismatches = compared = 0
    bf16_vs_fp32 = []
    for i, messages in enumerate(prompts):
        runs = {}
        for name in ("fp32", "bf16") if i % 2 else ("bf16", "fp32"):
            runs[name] = run_hf(models[name], tok, messages, args.max_new_tokens, 0.0, 0)
            rates[name].append(runs[name].decode_rate)
        tree = generate(
            models["bf16"], tok, head, messages, max_new_tokens=args.max_new_tokens, tree="eagle2", budget=args.budget
        ).token_ids
        want = runs["bf16"].token_ids
        k = first_difference(tree, want)
        compared += min(len(tree), len(want)) if k is None else k + 1
        mismatches += k is not None
        bf16_vs_fp32.append(first_difference(runs["fp32"].token_ids, want))
        print(
            f"prompt {i}: fp32 {rates['fp32'][-1]:.1f} bf16 {rates['bf16'][-1]:.1f} tokens/s; tree vs plain bf16 "
            f"first difference {k}; plain bf16 vs fp32 first difference {bf16_vs_fp32[-1]}",
            flush=True,
        )
    # a run of one token has no decode rate (NaN): left out of the median, and counted
    ratios = [b / a for a, b in zip(rates["fp32"], rates["bf16"]) if math.isfinite(a) and math.isfinite(b) and a > 0]
    print(
        json.dumps(
            {
                "prompts": len(prompts),
                "max_new_tokens": args.max_new_tokens,
                "bf16_over_fp32_median": statistics.median(ratios) if ratios else None,
                "ratios": ratios,
                "prompts_without_a_rate": len(prompts) - len(ratios),
                "tree_vs_plain_bf16_mismatches": mismatches,
                "tokens_compared": compared,
                "per_1000": 1000 * mismatches / max(compared, 1),
                "bf16_vs_fp32_first_difference": bf16_vs_fp32,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Speculative generation vs plain decoding on held-out ShareGPT prompts, side by side in one run.

    .venv/bin/python benchmarks/generation.py [--prompts 8] [--max-new-tokens 96] [--head DIR]

For every prompt, plain HF greedy decoding and each tree method run back to back, so each speedup
is a ratio measured on the same prompt moments apart; the table reports the median (and range) of
those per-prompt ratios, tokens per pass (measured and predicted), and whether every output equals
plain decoding token for token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
from tqdm import tqdm

from eagletree.draft_heads import load_head
from eagletree.generate import generate
from eagletree.target import load_target
from eagletree.train.data import load_dataset, split
from eagletree.train.evaluate import heldout_prompts

METHODS = {
    "chain d=5": dict(tree="chain", depth=5),
    "sequoia 16": dict(tree="sequoia", budget=16, depth=6),
    "eagle2 16": dict(tree="eagle2", budget=16, depth=6, top_k_draft=4),
    "eagle2 60": dict(tree="eagle2", budget=60, depth=6, top_k_draft=10),
    "optimal 32": dict(tree="optimal", budget=32, depth=6, top_k_draft=6),
    "auto": dict(tree="auto", budget=60, depth=6, top_k_draft=10),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head", default="eagletree/heads/smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)

    model, tok = load_target(args.target)
    head = load_head(args.head, target_config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, heldout = split(load_dataset("sharegpt"))
    prompts = heldout_prompts(heldout[100:], args.prompts)  # past the conversations evaluation uses
    methods = [m.strip() for m in args.methods.split(",")]
    rows = {m: {"ratio": [], "tps": [], "new": 0, "passes": 0, "pred": [], "same": True} for m in methods}
    plain_tps = []
    for messages in tqdm(prompts, desc="prompts"):
        inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        plain_s = time.perf_counter() - t0
        ref = out[0, inputs["input_ids"].shape[1]:].tolist()
        plain_tps.append(len(ref) / plain_s)
        for m in methods:
            r = generate(model, tok, head, messages, max_new_tokens=args.max_new_tokens, **METHODS[m])
            row = rows[m]
            row["ratio"].append(plain_s / r.stats.seconds * (len(r.token_ids) / max(len(ref), 1)))
            row["tps"].append(r.stats.new_tokens / r.stats.seconds)
            row["new"] += r.stats.new_tokens
            row["passes"] += r.stats.passes
            row["pred"] += r.stats.predicted
            if r.token_ids != ref:
                row["same"] = False
                print(f"MISMATCH {m}: {r.token_ids[:20]} vs {ref[:20]}")

    print(f"\n{len(prompts)} held-out ShareGPT prompts, {args.max_new_tokens} new tokens, greedy, {args.target}, "
          f"{model.device.type}; plain decoding {statistics.median(plain_tps):.1f} tokens/s (median)")
    print("| method | tokens/pass | predicted | tokens/s (median) | speedup vs plain (median, range) | identical |")
    print("|---|---|---|---|---|---|")
    results = {}
    for m in methods:
        row = rows[m]
        tpp = row["new"] / max(row["passes"], 1)
        pred = statistics.mean(row["pred"]) if row["pred"] else 0.0
        results[m] = {"tokens_per_pass": tpp, "predicted": pred, "tokens_per_s": statistics.median(row["tps"]),
                      "speedup": statistics.median(row["ratio"]), "identical": row["same"]}
        print(f"| {m} | {tpp:.2f} | {pred:.2f} | {statistics.median(row['tps']):.1f} | "
              f"{statistics.median(row['ratio']):.2f}x ({min(row['ratio']):.2f}-{max(row['ratio']):.2f}) | "
              f"{'yes' if row['same'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain_tokens_per_s": statistics.median(plain_tps), "methods": results}, f, indent=2)


if __name__ == "__main__":
    main()

"""Batched decoding throughput: HF batched `generate`, eagletree's batched plain decoding and with trees.

For each batch size B, in one run: HF `generate` on the prompts B at a time (left padding, the same stop
tokens), eagletree plain (no head; the same decoding loop, one root per sequence per pass) and eagletree with
the shipped head (the default `auto` tree, or --tree), both through `Decoder.generate_batch(prompts, B)`
(continuous batching). Prints tokens/s per method and batch size and the ratios the batching issue sets goals
for, checks every eagletree answer against plain decoding of the prompt alone, and reports how the node budget
split across the sequences of each pass (with --tree eagle2/optimal also against an equal split per sequence:
tokens per pass). --plot writes the throughput plot.

    python benchmarks/batch_throughput.py --prompts mtbench:32 --max-new-tokens 128 --batch-sizes 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagletree import DecodeConfig, Decoder
from eagletree.bench import load_prompts
from eagletree.decoding import hf_generation_config, stop_token_ids
from eagletree.draft_heads import load_head
from eagletree.loading import head_to_load
from eagletree.packing import cpu_model
from eagletree.target import load_target


def hf_batched(target, tok, prompts, batch: int, max_new_tokens: int):
    """HF generate B prompts at a time (left padding); returns (answers' token ids, seconds)."""
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stops = stop_token_ids(target, tok)
    config = hf_generation_config(max_new_tokens, 0.0, stops, pad_token_id=pad)
    answers, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts[i : i + batch]]
        inputs = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = target.generate(**inputs, generation_config=config)
        for row in out[:, inputs["input_ids"].shape[1] :].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            answers.append(row[:cut])
    return answers, time.perf_counter() - t0


def eagletree_batched(decoder: Decoder, prompts, batch: int):
    t0 = time.perf_counter()
    results = decoder.generate_batch(prompts, batch)
    return results, time.perf_counter() - t0


def budget_split(decoder: Decoder, prompts, batch: int) -> dict:
    """Nodes per sequence in each pass of a batch (how uneven the one budget is spent) and tokens per pass."""
    passes = []
    original = decoder._pass

    def recording(batch_state, live, inspect_step):
        steps = list(original(batch_state, live, inspect_step))
        passes.append([len(step.draft) for _, step in steps])
        yield from steps

    decoder._pass = recording
    try:
        results = decoder.generate_batch(prompts, batch)
    finally:
        decoder._pass = original
    full = [p for p in passes if len(p) == batch]
    spread = [max(p) / min(p) for p in full] or [1.0]
    tokens = sum(r.stats.new_tokens for r in results)
    return {
        "passes": len(passes),
        "tokens_per_sequence_pass": tokens / sum(len(p) for p in passes),
        "max_over_min_nodes": statistics.mean(spread),
        "most_nodes_one_sequence": max(max(p) for p in passes),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", default="mtbench:8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--tree", default="auto", help="the tree kind of the 'trees' method (default: the default)")
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--plot", default=None, help="write the throughput plot to this file (.png)")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    target, tok = load_target(args.target)
    head = load_head(head_to_load(args.target, None), target_config=target.config)
    prompts = load_prompts(args.prompts)
    n = args.max_new_tokens
    plain = Decoder(target, tok, None, DecodeConfig(max_new_tokens=n))
    trees = Decoder(target, tok, head, DecodeConfig(tree=args.tree, budget=args.budget, max_new_tokens=n))
    print(
        f"{args.target}, {len(prompts)} prompts x {n} tokens, {cpu_model()}, {torch.get_num_threads()} threads; "
        f"trees: {trees.config.tree.value}, budget {trees.config.budget} per sequence"
    )
    reference = [r.token_ids for r in plain.generate_batch(prompts, 1)]
    rates, same = {}, True
    for b in sizes:
        hf_answers, hf_s = hf_batched(target, tok, prompts, b, n)
        rates[("HF generate", b)] = sum(map(len, hf_answers)) / hf_s
        for name, decoder in (("eagletree plain", plain), ("eagletree trees", trees)):
            results, seconds = eagletree_batched(decoder, prompts, b)
            rates[(name, b)] = sum(r.stats.new_tokens for r in results) / seconds
            same &= [r.token_ids for r in results] == reference
        hf_same = sum(a == r for a, r in zip(hf_answers, reference))
        print(f"B={b}: HF batched answers equal to plain decoding alone: {hf_same}/{len(prompts)}", flush=True)
    _print_table(rates, sizes)
    print(f"every eagletree answer identical to plain decoding alone: {same}")
    for b in sizes[1:]:
        print(f"B={b} budget split ({trees.config.tree.value}): {budget_split(trees, prompts, b)}")
        if trees.config.tree.value in ("eagle2", "optimal"):
            trees.searcher.global_budget = False
            print(f"B={b} equal split per sequence: {budget_split(trees, prompts, b)}")
            trees.searcher.global_budget = True
    if args.plot:
        _plot(rates, sizes, args.plot)


def _print_table(rates: dict, sizes: list[int]) -> None:
    methods = ("HF generate", "eagletree plain", "eagletree trees")
    print(
        "| batch | " + " | ".join(f"{m} tok/s" for m in methods) + " | trees / plain | plain / HF | plain / plain B=1 |"
    )
    print("|---" * (len(methods) + 4) + "|")
    for b in sizes:
        row = [rates[(m, b)] for m in methods]
        ratios = (row[2] / row[1], row[1] / row[0], row[1] / rates[("eagletree plain", sizes[0])])
        print(
            f"| {b} | " + " | ".join(f"{r:.1f}" for r in row) + " | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |"
        )


def _plot(rates: dict, sizes: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ("HF generate", "eagletree plain", "eagletree trees"):
        ax.plot(sizes, [rates[(m, b)] for b in sizes], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens / s")
    ax.set_title("batched decoding throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()

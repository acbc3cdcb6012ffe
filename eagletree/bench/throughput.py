"""Batched throughput: HF batched `generate`, eagletree's batched plain decoding and eagletree with trees.

For each batch size B, in one run: HF `generate` on the prompts B at a time (left padding, the same stop
tokens), eagletree plain (no head: the same decoding loop, one root per sequence per pass) and eagletree with
the head (`Decoder.generate_batch(prompts, B)`, continuous batching). `bench --batch-sizes` and
`benchmarks/batch_throughput.py` print the table; every eagletree answer is checked against plain decoding of
its prompt alone. With `repeats` > 1 each batch size is measured in that many rounds, the methods' order rotating
from round to round, and the table shows each method's median rate (a shared 2-core machine moves one run's rate
by 10% and more; the rounds' trees / plain ratios are kept too).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from ..decode import Decoder, hf_generation_config, stop_token_ids, whole_answers
from ..decode.config import DecodeConfig
from ..errors import InvalidValue

METHODS = ("HF generate", "eagletree plain", "eagletree trees")


def hf_batched(target, tok, prompts, batch: int, max_new_tokens: int) -> tuple[list[list[int]], float]:
    """HF generate, `batch` prompts at a time (left padding); returns (each answer's token ids, seconds)."""
    side = tok.padding_side
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stops = stop_token_ids(target, tok)
    config = hf_generation_config(max_new_tokens, 0.0, stops, pad_token_id=pad)
    device = next(target.parameters()).device
    answers, t0 = [], time.perf_counter()
    try:
        for i in range(0, len(prompts), batch):
            texts = [
                tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts[i : i + batch]
            ]
            inputs = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.inference_mode():
                out = target.generate(**inputs, generation_config=config)
            for row in out[:, inputs["input_ids"].shape[1] :].tolist():
                answers.append(row[: next((j + 1 for j, t in enumerate(row) if t in stops), len(row))])
    finally:
        tok.padding_side = side
    return answers, time.perf_counter() - t0


def throughput(
    target, tok, head, prompts, sizes: list[int], config: DecodeConfig, progress: bool = True, repeats: int = 1
) -> dict:
    """Tokens/s of each method at each batch size, with the checks: {"rates": {method: {B: tok/s, the median of
    the rounds}}, "rounds": {method: {B: [tok/s per round]}}, "identical": every eagletree answer equals plain
    decoding alone, "hf_identical": {B: HF batched answers equal to it (the last round's)}}."""
    if not sizes or min(sizes) < 1:
        raise InvalidValue(f"batch sizes must be integers >= 1, got {sizes}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise InvalidValue(f"repeats must be an integer >= 1, got {repeats!r}")
    plain = Decoder(target, tok, None, replace(config, copy=replace(config.copy, enabled=False)))  # no copies
    trees = Decoder(target, tok, head, config)
    trees.prepare(min(max(sizes), len(prompts)))  # the batch passes' profile: measured once, not timed
    reference = [r.token_ids for r in whole_answers(plain.generate_batch(prompts, 1))]
    rounds = {m: {b: [] for b in sizes} for m in METHODS}
    identical, hf_identical = True, {}
    for b in tqdm(sizes, desc="batch sizes", disable=not progress):
        for k in range(repeats):
            for name in METHODS[k % 3 :] + METHODS[: k % 3]:  # (the order rotates: no method always runs first)
                if name == METHODS[0]:
                    answers, seconds = hf_batched(target, tok, prompts, b, config.max_new_tokens)
                    rounds[name][b].append(sum(map(len, answers)) / seconds)
                    hf_identical[b] = sum(a == want for a, want in zip(answers, reference))
                    continue
                decoder = plain if name == METHODS[1] else trees
                t0 = time.perf_counter()
                results = whole_answers(decoder.generate_batch(prompts, b))
                rounds[name][b].append(sum(r.stats.new_tokens for r in results) / (time.perf_counter() - t0))
                identical &= [r.token_ids for r in results] == reference
    rates = {m: {b: statistics.median(rounds[m][b]) for b in sizes} for m in METHODS}
    return {
        "rates": rates,
        "rounds": rounds,
        "repeats": repeats,
        "identical": identical,
        "hf_identical": hf_identical,
        "prompts": len(prompts),
    }


def throughput_table(result: dict) -> str:
    """The markdown table of `throughput`'s rates and the ratios the batching goals are about."""
    rates = result["rates"]
    sizes = sorted(rates[METHODS[0]])
    lines = [
        "| batch | "
        + " | ".join(f"{m} tok/s" for m in METHODS)
        + " | trees / plain | plain / HF | plain / plain B=1 |",
        "|---" * (len(METHODS) + 4) + "|",
    ]
    for b in sizes:
        hf, plain, trees = (rates[m][b] for m in METHODS)
        ratios = (trees / plain, plain / hf, plain / rates[METHODS[1]][sizes[0]])
        lines.append(
            f"| {b} | {hf:.1f} | {plain:.1f} | {trees:.1f} | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |"
        )
    repeats = result.get("repeats", 1)
    if repeats > 1:
        rounds = result["rounds"]
        spans = []
        for b in sizes:
            ratios = [t / p for t, p in zip(rounds[METHODS[2]][b], rounds[METHODS[1]][b])]
            spans.append(f"B={b}: {min(ratios):.2f}-{max(ratios):.2f}x")
        lines.append(
            f"\nmedians of {repeats} rounds per batch size (the methods' order rotating); trees / plain in each "
            "round: " + ", ".join(spans)
        )
    lines.append(f"\nevery eagletree answer identical to plain decoding alone: {result['identical']}")
    lines.append(
        "HF batched answers equal to plain decoding alone (left padding changes its numerics): "
        + ", ".join(f"B={b}: {n}/{result['prompts']}" for b, n in result["hf_identical"].items())
    )
    return "\n".join(lines)


def plot_throughput(result: dict, path) -> None:
    """Tokens/s against batch size, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = result["rates"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in METHODS:
        sizes = sorted(rates[m])
        ax.plot(sizes, [rates[m][b] for b in sizes], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences per target pass)")
    ax.set_ylabel("tokens / s (all sequences)")
    ax.set_title("batched decoding throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def budget_split(decoder: Decoder, prompts, batch: int) -> dict:
    """How one node budget spreads over the sequences of each full pass of `batch` sequences (nodes per sequence:
    the mean max/min ratio, the most one sequence took) and the tokens per sequence per pass it bought."""
    passes = []
    original = decoder._pass

    def recording(state, live, inspect_step):
        steps = list(original(state, live, inspect_step))
        passes.append([len(step.draft) for _, step in steps])
        yield from steps

    decoder._pass = recording
    try:
        results = whole_answers(decoder.generate_batch(prompts, batch))
    finally:
        del decoder._pass
    full = [p for p in passes if len(p) == batch] or passes
    return {
        "passes": len(passes),
        "tokens_per_pass": sum(r.stats.new_tokens for r in results) / sum(len(p) for p in passes),
        "max_over_min_nodes": statistics.mean(max(p) / min(p) for p in full),
        "most_nodes_one_sequence": max(max(p) for p in passes),
    }

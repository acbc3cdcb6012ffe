"""`model.generate` with and without eagletree's trees (`custom_generate=eagletree.hf.decoding(head)`), side by side.

    python benchmarks/hf_generate.py --prompts mtbench:16 --max-new-tokens 128 --batch-size 8 --rounds 2

The same model object and kernels (transformers' own: nothing packed), the same chat-templated prompts, greedy:
per round, plain `generate` and `generate` with the trees one prompt at a time, then both on left-padded batches of
--batch-size, alternating which goes first; prints tokens/s of each and the ratio, and checks the answers: with
trees, one at a time, equal to plain one at a time (batched answers are compared with plain batched, whose left
padding changes transformers' numerics at near-ties). Say which CPU it ran on; run it with nothing else running.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eagletree import hf
from eagletree.bench import load_prompts
from eagletree.loading import head_to_load, load_head
from eagletree.target import load_target


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head", default=None, help="default: the head shipped for --target")
    ap.add_argument("--prompts", default="mtbench:16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tree", default="auto")
    args = ap.parse_args(argv)
    for name in ("max_new_tokens", "batch_size", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def run(model, batches, max_new_tokens: int, method=None) -> tuple[float, list[list[int]]]:
    """(seconds, each prompt's answer ids) of `generate` over the batches (plain where `method` is None)."""
    extra = {} if method is None else {"custom_generate": method}
    answers, start = [], time.perf_counter()
    for batch in batches:
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, **extra)
        width = batch["input_ids"].shape[1]
        pad = model.generation_config.pad_token_id
        answers += [[t for t in row[width:].tolist() if t != pad] for row in out]
    return time.perf_counter() - start, answers


def main(argv=None) -> int:
    args = parse_args(argv)
    model, tok = load_target(args.target, dtype=torch.float32, device="cpu")
    head = load_head(head_to_load(args.target, args.head), target_config=model.config, device="cpu")
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id or model.generation_config.eos_token_id
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in load_prompts(args.prompts)]
    single = [tok([t], return_tensors="pt") for t in texts]
    size = args.batch_size
    batched = [
        tok(texts[i : i + size], return_tensors="pt", padding=True, padding_side="left")
        for i in range(0, len(texts), size)
    ]
    method = hf.decoding(head, tree=args.tree)
    rates = {k: [] for k in ("plain 1", "trees 1", f"plain {size}", f"trees {size}")}
    same = True
    for r in range(args.rounds):
        for mode, batches in (("1", single), (str(size), batched)):
            order = (None, method) if r % 2 == 0 else (method, None)
            got = {}
            for m in order:
                seconds, answers = run(model, batches, args.max_new_tokens, m)
                name = f"{'plain' if m is None else 'trees'} {mode}"
                rates[name].append(sum(map(len, answers)) / seconds)
                got[name.split()[0]] = answers
            same &= got["plain"] == got["trees"]
    print(
        f"{args.target} + {head_to_load(args.target, args.head)}, {len(texts)} prompts x {args.max_new_tokens} tokens, "
        f"greedy, tree {args.tree}, {args.rounds} rounds, threads {torch.get_num_threads()}"
    )
    print("| generate | tokens/s (median) | each round |\n|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    for mode in ("1", str(size)):
        ratio = statistics.median(t / p for t, p in zip(rates[f"trees {mode}"], rates[f"plain {mode}"]))
        print(f"trees / plain at {mode} a call: {ratio:.2f}x")
    print(f"answers with trees equal plain generate's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

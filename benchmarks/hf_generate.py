"""`model.generate` with and without eagletree's trees (`custom_generate=eagletree.hf.decoding(head)`), side by side.

    python benchmarks/hf_generate.py --prompts mtbench:16 --max-new-tokens 128 --batch-size 8 --rounds 2 [--folder]

The same model object and kernels (transformers' own: nothing packed), the same chat-templated prompts, greedy:
per round, plain `generate` and `generate` with the trees one prompt at a time, then both on left-padded batches of
--batch-size, alternating which goes first; prints tokens/s of each and the ratio, and checks the answers: with
trees, one at a time, equal to plain one at a time (batched answers are compared with plain batched, whose left
padding changes transformers' numerics at near-ties). `--folder` also times the head exported as `hf-generate`
(`custom_generate=FOLDER, trust_remote_code=True`: transformers loads generate.py at every call) one prompt at a
time, in the same rotation. Say which CPU it ran on; run it with nothing else running.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
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
    ap.add_argument("--folder", action="store_true", help="also the hf-generate export folder, one prompt at a time")
    args = ap.parse_args(argv)
    for name in ("max_new_tokens", "batch_size", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def run(model, batches, max_new_tokens: int, extra: dict) -> tuple[float, list[list[int]]]:
    """(seconds, each prompt's answer ids) of `generate` over the batches with the options `extra` (none: plain)."""
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
    methods = {"plain": {}, "trees": {"custom_generate": hf.decoding(head, tree=args.tree)}}
    if args.folder:
        folder = {"custom_generate": exported_folder(head), "trust_remote_code": True, "eagletree_tree": args.tree}
        methods["folder"] = folder
    rates, same = {}, True
    for r in range(args.rounds):
        for mode, batches in (("1", single), (str(size), batched)):
            names = [name for name in methods if mode == "1" or name != "folder"]
            got = {}
            for name in names if r % 2 == 0 else names[::-1]:
                seconds, answers = run(model, batches, args.max_new_tokens, methods[name])
                rates.setdefault(f"{name} {mode}", []).append(sum(map(len, answers)) / seconds)
                got[name] = answers
            same &= all(answers == got["plain"] for answers in got.values())
    print(
        f"{args.target} + {head_to_load(args.target, args.head)}, {len(texts)} prompts x {args.max_new_tokens} tokens, "
        f"greedy, tree {args.tree}, {args.rounds} rounds, threads {torch.get_num_threads()}"
    )
    print("| generate | tokens/s (median) | each round |\n|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    for name, mode in [("trees", "1"), ("trees", str(size))] + [("folder", "1")] * args.folder:
        ratio = statistics.median(t / p for t, p in zip(rates[f"{name} {mode}"], rates[f"plain {mode}"]))
        print(f"{name} / plain at {mode} a call: {ratio:.2f}x")
    print(f"answers with trees equal plain generate's: {same}")
    return 0 if same else 1


def exported_folder(head) -> str:
    """The head exported as hf-generate (in its own precision) into a new temporary folder."""
    from eagletree.export.convert import export_head

    dtype = next(head.parameters()).dtype
    return str(export_head(head, tempfile.mkdtemp(prefix="eagletree-hf-generate-") + "/trees", "hf-generate", dtype))


if __name__ == "__main__":
    raise SystemExit(main())

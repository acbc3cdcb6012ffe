"""Tokens per target pass of several draft heads on the same held-out prompts, with the paired difference.

    .venv/bin/python benchmarks/heads.py eagletree/heads/smollm2-135m runs/NEW/head [--prompts 60]
    .venv/bin/python benchmarks/heads.py eagletree/heads/smollm2-135m --prompts mtbench:40 --copy both

--prompts N takes held-out ShareGPT prompts (below); mtbench[:N] MT-bench first turns (with a table per
category) and humaneval[:N] or humaneval:A-B HumanEval problems. --copy off|on|both: decode with the head
alone, with copied spans of earlier text in the tree too, or both (each head twice, "+copy" rows paired with
the first row).
--datastore auto|none|both: copied rows also copy from the head folder's datastore.npz (retrieved spans; auto,
"+copy+store" rows where the head has one), never (none), or both (each copied row twice).
--draft-vocab head|full|both: each head drafts over its own draft vocabulary, over the target's whole
vocabulary, or both ("full vocab" rows).

Every head decodes every prompt (greedy unless --temperature, EAGLE-2 tree of --budget nodes unless --tree);
decoding is lossless, so at T = 0 the heads' answers must be the same token for token, which is checked
(against each other; the tests compare decoding with plain greedy decoding). A head's tokens/pass is its total
new tokens over its total target passes. The difference to the first head is paired by prompt, with a 95% bootstrap
interval over prompts: 30 prompts of 64 tokens leave a few percent of noise, which this makes visible.
The prompts are the first user turns of held-out ShareGPT conversations after the first --offset ones, less
the first --skip-prompts of them: `python -m eagletree.train.evaluate` uses 20 conversations for agreement,
then its --prompts (30 in docs/recipe.md's evaluation), so the defaults measure on other prompts than the evaluation.
Each head drafts in the precision it was saved in (a shipped head: bf16).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from eagletree.bench import load_prompts, ratio_interval, sharegpt_heldout, spec_count
from eagletree.draft import HeadError, load_head
from eagletree.files import write_json_atomic
from eagletree.loading import load_models
from eagletree.prompts import by_category, mtbench_subset
from eagletree.search.store import DATASTORE
from eagletree.train.evaluate import heldout_prompts, tokens_per_pass


def main(argv=None) -> int:
    """Decode the prompts with every head row, print the tables (and -o the JSON); 1 when answers differ."""
    ap = _parser()
    args = ap.parse_args(argv)
    benchmark = _check_args(ap, args)
    prompts, categories = _prompts(ap, args, benchmark)
    target, tok, _, _ = load_models(args.target, pack="auto")
    configs = _configs(args, _load_heads(ap, args, target))
    labels = [row_label(path, vocab, copy, store) for path, _, vocab, copy, store in configs]
    earlier = _earlier_run(ap, args, benchmark, prompts) if args.pair_with else None
    if earlier is not None:
        labels.insert(0, row_label(*_config_of(earlier["heads"][0])) + " (earlier run)")
    decoded = _decode(args, target, tok, prompts, configs, labels, earlier)
    if decoded is None:
        return 1
    rows, hashes = decoded
    report = _print_table(args, benchmark, prompts, configs, labels, rows, earlier)
    if categories is not None:
        print(category_table(categories, rows, labels))
    if args.out:
        write_json_atomic(
            Path(args.out), {"settings": vars(args), "categories": categories, "answers": hashes, "heads": report}
        )
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line (its description is this module's docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+", help="head folders; the first is the baseline")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument(
        "--prompts", default="60", help="N held-out ShareGPT prompts, mtbench[:N], humaneval[:N] or humaneval:A-B"
    )
    ap.add_argument(
        "--copy",
        default="off",
        choices=["off", "on", "both"],
        help="copied spans in the tree: off (the head alone), on, or both (each head twice)",
    )
    ap.add_argument(
        "--datastore",
        default="auto",
        choices=["auto", "none", "both"],
        help="copied rows copy from the head's datastore.npz too (auto), not (none), or both (two rows)",
    )
    ap.add_argument(
        "--offset",
        type=int,
        default=20,
        help="held-out conversations skipped before the prompts (N held-out prompts only)",
    )
    ap.add_argument(
        "--skip-prompts",
        type=int,
        default=30,
        help="then this many prompts skipped (the evaluation's; N held-out prompts only)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument(
        "--tree",
        default="eagle2",
        choices=["eagle2", "optimal", "auto"],
        help="the tree search; auto: the CLI's default, cost-aware on this machine (--budget its maximum)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (answers checked identical across rows); > 0: sampled with --seed + prompt index "
        "(rows' answers differ; the chi-square tests check the distribution)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--draft-vocab",
        default="head",
        choices=["head", "full", "both"],
        help="draft over each head's own draft vocabulary, over the target's whole vocabulary "
        "(DraftHead.widen_vocab; a head with an lm_head of its own keeps its vocabulary), or both "
        '(each head twice, "full vocab" rows)',
    )
    ap.add_argument("-o", "--out", default=None, help="also write the per-prompt results to this JSON file")
    ap.add_argument(
        "--pair-with",
        default=None,
        help="a JSON file an earlier run of this script wrote (-o) on the same prompts: its first row "
        "becomes the baseline row, paired by prompt (answers checked identical by hash)",
    )
    return ap


def _check_args(ap, args) -> str | None:
    """Refuse values out of range (ap.error); returns the benchmark --prompts names, or None for N held-out
    prompts (then args.prompts becomes that number)."""
    benchmark = None if args.prompts.isdigit() else args.prompts
    if benchmark is None:
        args.prompts = int(args.prompts)
    for name, value in (
        ("prompts", args.prompts if benchmark is None else 1),
        ("max-new-tokens", args.max_new_tokens),
        ("budget", args.budget),
        ("depth", args.depth),
        ("top-k", args.top_k),
    ):
        if value < 1:
            ap.error(f"--{name} must be >= 1, got {value}")
    if args.temperature < 0:
        ap.error(f"--temperature must be >= 0, got {args.temperature}")
    for name, value in (("offset", args.offset), ("skip-prompts", args.skip_prompts), ("seed", args.seed)):
        if value < 0:
            ap.error(f"--{name} must be >= 0, got {value}")
    missing = [h for h in args.heads if not Path(h, "config.json").is_file()]
    if missing:
        ap.error(f"not a saved head (no config.json): {', '.join(missing)}")
    return benchmark


def _prompts(ap, args, benchmark):
    """(prompts, MT-bench category per prompt or None)."""
    categories = None
    if benchmark is not None:
        try:
            prompts = load_prompts(benchmark)
        except (ValueError, FileNotFoundError) as e:
            ap.error(str(e))
        if benchmark.startswith("mtbench"):
            categories = [q.category for q in mtbench_subset(spec_count(benchmark, "mtbench"))]
    else:
        opening = heldout_prompts(sharegpt_heldout()[args.offset :], args.skip_prompts + args.prompts)
        prompts = opening[args.skip_prompts :]
        if len(prompts) < args.prompts:
            ap.error(
                f"--prompts {args.prompts}: only {len(prompts)} held-out prompts after --offset {args.offset} "
                f"and --skip-prompts {args.skip_prompts}"
            )
    return prompts, categories


def _load_heads(ap, args, target) -> list[tuple]:
    """(path, head, vocab) per head and --draft-vocab vocabulary ("head" or "full")."""
    device = next(target.parameters()).device
    vocabs = {"head": ["head"], "full": ["full"], "both": ["head", "full"]}[args.draft_vocab]
    heads = []
    for path in args.heads:
        for vocab in vocabs:
            try:
                head = load_head(path, device=device).eval()
                head.check_target(target.config)
            except HeadError as e:
                ap.error(f"{path}: {e}")
            if vocab == "full":
                if not head.can_widen_vocab():
                    why = (
                        "drafts over the full vocabulary already"
                        if head.config.draft_vocab_size is None
                        else f"scores tokens with its own lm_head ({head.config.draft_vocab_size} rows)"
                    )
                    print(f"{path} {why}: no separate full-vocabulary row", file=sys.stderr)
                    if len(vocabs) > 1:
                        continue  # its 'head' row is the same configuration
                    vocab = "head"
                else:
                    head.widen_vocab()
            heads.append((path, head, vocab))
    return heads


def _configs(args, heads) -> list[tuple]:
    """The rows to decode: (path, head, vocab, copy, datastore) per head and --copy / --datastore setting."""
    copies = {"off": [False], "on": [True], "both": [False, True]}[args.copy]
    stores = {"auto": ["auto"], "none": [None], "both": [None, "auto"]}[args.datastore]
    configs = [
        (path, head, vocab, copy, store if copy and Path(path, DATASTORE).is_file() else None)
        for path, head, vocab in heads
        for copy in copies
        for store in (stores if copy else [None])
    ]
    return list(dict.fromkeys(configs))  # a head without a datastore: one copied row


def _earlier_run(ap, args, benchmark, prompts) -> dict:
    """The --pair-with file, refused (ap.error) when made with other settings or on another number of prompts."""
    earlier = json.loads(Path(args.pair_with).read_text())
    defaults = {"temperature": 0.0, "seed": 0, "tree": "eagle2"}  # for files written without these settings
    same = {
        k: earlier["settings"].get(k, defaults.get(k))
        for k in (
            "prompts",
            "max_new_tokens",
            "budget",
            "depth",
            "top_k",
            "offset",
            "skip_prompts",
            "target",
            "temperature",
            "seed",
            "tree",
        )
    }
    if not args.temperature > 0:  # (as `sampled` in _decode)
        same.pop("seed")  # greedy decoding does not use it
    if benchmark is not None:  # MT-bench, HumanEval or a file: the held-out offsets choose nothing
        same.pop("offset")
        same.pop("skip_prompts")
    if same != {k: getattr(args, k) for k in same} or len(earlier["answers"]) != len(prompts):
        ap.error(f"--pair-with {args.pair_with}: made with other settings {same}")
    return earlier


def _config_of(row: dict) -> tuple:
    """(head, draft_vocab, copy, datastore) of a row of an earlier run's file."""
    return row["head"], row.get("draft_vocab", "head"), row["copy"], row.get("datastore")


def _decode(args, target, tok, prompts, configs, labels, earlier):
    """(rows, hashes): per prompt, (new tokens, passes) of every row (the earlier run's first) and the hash of
    its answer; None (said on stderr) when greedy rows decoded different answers."""
    options = {
        "budget": args.budget,
        "depth": args.depth,
        "top_k_draft": args.top_k,
        "tree": args.tree,
        "temperature": args.temperature,
    }
    sampled = args.temperature > 0
    rows, hashes = [], []
    for i, prompt in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
        row, first = [], None
        if earlier is not None:
            row.append((earlier["heads"][0]["new_tokens"][i], earlier["heads"][0]["passes"][i]))
        for label, (_, head, _, copy, store) in zip(labels[len(labels) - len(configs) :], configs):
            answers = []
            r = tokens_per_pass(
                head,
                target,
                tok,
                [prompt],
                args.max_new_tokens,
                answers=answers,
                copy=copy,
                store=store,
                seed=args.seed + i if sampled else None,
                **options,
            )
            answer = answers[0][1]
            if first is None:
                first = answer
            elif not sampled and not torch.equal(first, answer):
                print(
                    f"error: prompt {i}: {label} decoded another answer than {labels[0]}; decoding must be lossless",
                    file=sys.stderr,
                )
                return None
            row.append((r["new_tokens"], r["passes"]))
        digest = hashlib.sha1(first.numpy().tobytes()).hexdigest()
        if earlier is not None and not sampled and earlier["answers"][i] != digest:
            print(
                f"error: prompt {i}: the answer differs from the one in {args.pair_with} (same settings and "
                "prompts: decoding must be lossless, or the target or its kernels changed)",
                file=sys.stderr,
            )
            return None
        hashes.append(digest)
        rows.append(row)
    return rows, hashes


def _print_table(args, benchmark, prompts, configs, labels, rows, earlier) -> list[dict]:
    """Print tokens/pass per row with the paired difference to the first; returns the rows for the JSON file."""
    sampled = args.temperature > 0
    base_new, base_passes = [r[0][0] for r in rows], [r[0][1] for r in rows]
    source = benchmark or "held-out ShareGPT"
    tree = {"eagle2": "EAGLE-2", "optimal": "optimal", "auto": "auto (cost-aware) up to"}[args.tree]
    answers_note = (
        "the same answers from every row"
        if not sampled
        else f"sampled answers (seed {args.seed} + prompt index), different in every row"
    )
    print(
        f"{len(prompts)} prompts ({source}) x {args.max_new_tokens} new tokens, {tree} {args.budget} nodes "
        f"(depth {args.depth}, top-k {args.top_k}), T = {args.temperature:g}; {answers_note}\n"
    )
    print("| head | tokens/pass | vs first (95% interval over prompts) |\n|---|---|---|")
    report = []
    for j, label in enumerate(labels):
        new, passes = [r[j][0] for r in rows], [r[j][1] for r in rows]
        tpp = sum(new) / sum(passes)
        if j == 0:
            versus = "—"
        else:
            interval = ratio_interval(new, passes, base_new, base_passes)
            spread = "one prompt: no interval" if interval is None else f"{interval[0]:+.1%} .. {interval[1]:+.1%}"
            versus = f"{tpp / (sum(base_new) / sum(base_passes)) - 1:+.1%} ({spread})"
        print(f"| {label} | {tpp:.3f} | {versus} |")
        if earlier is not None and j == 0:
            config = _config_of(earlier["heads"][0])
        else:
            path, _, vocab, copy, store = configs[j - (earlier is not None)]
            config = (path, vocab, copy, store)
        report.append(
            {
                "head": config[0],
                "draft_vocab": config[1],
                "copy": config[2],
                "datastore": config[3],
                "tokens_per_pass": tpp,
                "new_tokens": new,
                "passes": passes,
            }
        )
    return report


def row_label(path: str, vocab: str, copy: bool, store=None) -> str:
    """A row's name in the tables: the head folder and what it drafts with."""
    return (
        path + (" (full vocab)" if vocab == "full" else "") + (" +copy" if copy else "") + ("+store" if store else "")
    )


def category_table(categories, rows, labels) -> str:
    """Tokens/pass per MT-bench category (columns) for every row, as in the EAGLE papers' tables."""
    names = list(dict.fromkeys(categories))
    lines = ["", "| head | " + " | ".join(names) + " | mean |", "|---|" + "---|" * (len(names) + 1)]
    for j, label in enumerate(labels):
        table = by_category(categories, [r[j][0] for r in rows], [r[j][1] for r in rows])
        lines.append(f"| {label} | " + " | ".join(f"{table[c]:.2f}" for c in names) + f" | {table['mean']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

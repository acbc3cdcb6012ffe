"""An upper bound on what retrieval from the target's own earlier answers could add to the hybrid tree.

    .venv/bin/python benchmarks/datastore_bound.py --prompts mtbench:40 --store runs/distill/smollm2-greedy-96.jsonl

Copied spans come from the context. Retrieval drafting (REST) copies from a corpus instead: what followed
the context's last tokens in other texts. Here the corpus is a distilled file (`eagletree distill`: the
target's own greedy answers to training prompts), its assistant turns indexed by n-grams of up to
--max-ngram tokens (matches then extended back to 16). Each prompt is decoded with the shipped head and
copied spans (EAGLE-2, --budget nodes, greedy, 1 thread, no datastore); at every pass start the context's longest suffix
is looked up in the store, and of its --spans most recent occurrences the continuation that agrees longest
with the target's answer counts (m tokens agree). A pass that gave k tokens is credited max(k, m + 1).

It is an upper bound: the real run's pass boundaries are kept, the retrieved span costs no node budget,
and the best of several spans is chosen knowing the answer (the "first span" column takes the most
recent occurrence's instead).

The spans retrieval actually adds to the tree are measured by `benchmarks/heads.py --datastore both`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from eagletree.bench import load_prompts
from eagletree.decode import decode_steps, encode_prompt
from eagletree.loading import SHIPPED_HEADS, load_models
from eagletree.records import is_header
from eagletree.search.copy import NgramIndex

TARGET = "smollm2-135m"
SEPARATOR = -1  # between answers: never in a context, so no match or span crosses it


def store_tokens(path: Path, tok) -> list[int]:
    """The assistant turns of a chat JSONL file, tokenized, one SEPARATOR after each."""
    tokens = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if is_header(record):  # (a record file's first line: what wrote it)
                    continue
                messages = record["messages"]
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{n}: not a chat record with messages: {e}") from None
            for m in messages:
                if m.get("role") == "assistant" and m.get("content"):
                    tokens += tok(m["content"], add_special_tokens=False)["input_ids"] + [SEPARATOR]
    if not tokens:
        raise SystemExit(f"{path}: no assistant turns")
    return tokens


def retrieved(
    store: NgramIndex, context: list[int], truth: list[int], spans: int, span_len: int
) -> tuple[int, int, int]:
    """(match length, tokens the most recent occurrence's continuation gets right, the best of `spans` occurrences'),
    looking up the end of `context` among the store's tokens."""
    # the context goes in as the suffix after the store: a match's end lies in the store, its continuation too
    found = [(n, end) for n, end in store.matches(per_ngram=spans, suffix=context) if end < len(store)]
    if not found:
        return 0, 0, 0
    longest = found[0][0]
    agree = []
    for _, end in [m for m in found if m[0] == longest][:spans]:
        m = 0
        for t, want in zip(store.tokens[end : end + span_len], truth):
            if t != want:  # the separator never equals a token
                break
            m += 1
        agree.append(m)
    return longest, agree[0], max(agree)


def parse_args(argv) -> tuple[argparse.Namespace, Path, list]:
    """The command line checked: (args, the store's path, the prompts); exits with a usage error otherwise."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="mtbench:40", help="as bench's: mtbench[:N], humaneval:A-B, heldout:N")
    ap.add_argument("--store", required=True, help="a distilled JSONL file (eagletree distill): the corpus")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--max-ngram", type=int, default=8, help="the longest context suffix looked up")
    ap.add_argument("--spans", type=int, default=8, help="occurrences of the longest match tried")
    ap.add_argument("--span-len", type=int, default=16, help="tokens of each retrieved continuation")
    args = ap.parse_args(argv)
    for name in ("max_new_tokens", "budget", "max_ngram", "spans", "span_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    store_path = Path(args.store)
    if not store_path.is_file():
        ap.error(f"--store {store_path}: no such file")
    try:
        prompts = load_prompts(args.prompts)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    return args, store_path, prompts


def main(argv=None) -> int:
    args, store_path, prompts = parse_args(argv)
    torch.set_num_threads(1)
    target, tok, head, _ = load_models(TARGET, SHIPPED_HEADS[TARGET], pack="auto", head_dtype=None)
    store = NgramIndex(store_tokens(store_path, tok), max_ngram=args.max_ngram)
    print(f"store: {store_path} ({len(store):,} tokens)", file=sys.stderr)
    new = passes = first_total = best_total = 0
    by_match: dict[int, Counter] = {}
    for prompt in tqdm(prompts, desc="prompts", unit="prompt"):
        context = encode_prompt(tok, prompt).flatten().tolist()
        counts, answer = [], []
        for tokens in decode_steps(
            target,
            tok,
            head,
            prompt,
            max_new_tokens=args.max_new_tokens,
            budget=args.budget,
            depth=6,
            top_k_draft=10,
            tree="eagle2",
            copy=True,
            store=None,
        ):
            counts.append(len(tokens))
            answer += tokens
        at = 0
        for k in counts:
            n, first, best = retrieved(store, context + answer[:at], answer[at:], args.spans, args.span_len)
            first_total += max(k, first + 1)
            best_total += max(k, best + 1)
            cell = by_match.setdefault(min(n, args.max_ngram), Counter())
            cell["passes"] += 1
            cell["beaten"] += best + 1 > k
            cell["first_agree"] += first
            at += k
        new += len(answer)
        passes += len(counts)

    print(
        f"\n{len(prompts)} prompts ({args.prompts}) x {args.max_new_tokens} new tokens, shipped head + copied spans, "
        f"EAGLE-2 {args.budget} nodes, T = 0; store {store_path.name}, {len(store):,} tokens\n"
    )
    base = new / passes
    print("| | tokens/pass | vs the run |\n|---|---|---|")
    print(f"| the run (head + copied spans) | {base:.3f} | |")
    for label, total in (
        ("+ retrieval, most recent occurrence (bound)", first_total),
        (f"+ retrieval, best of {args.spans} occurrences (bound)", best_total),
    ):
        print(f"| {label} | {total / passes:.3f} | {total / passes / base - 1:+.1%} |")
    print(
        "\n| longest match in the store | passes | passes a retrieved span beats | most recent span's agreeing "
        "tokens (mean) |\n|---|---|---|---|"
    )
    for n in sorted(by_match):
        c = by_match[n]
        print(
            f"| {n if n < args.max_ngram else f'{n}+'} | {c['passes']} | {c['beaten']} | "
            f"{c['first_agree'] / c['passes']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode a fixed set of real prompts with every tree kind and print what each pass did, as JSON lines.

Run before and after a change that must not alter decoding; the two outputs must be identical
(`diff`). Greedy rows carry tokens, accepted lengths and the tree's predicted value per pass (the
tree itself); sampled rows carry the tokens their seeded draws gave. `auto` is left out: its trees
follow live timings.
"""

import hashlib
import json
import sys

import torch

from eagletree import generate
from eagletree.draft import load_head
from eagletree.target import load_target

PROMPTS = [
    "Write a haiku about a lighthouse keeper.",
    "Explain in three sentences why the sky is blue.",
    'def fizzbuzz(n):\n    """Return the fizzbuzz string for n."""\n',
]
CASES = [
    dict(tree="eagle2", budget=60, copy=False),
    dict(tree="eagle2", budget=60, copy=True),
    dict(tree="eagle2", budget=8, copy=True),
    dict(tree="optimal", budget=60, copy=True),
    dict(tree="chain", budget=6),
    dict(tree="sequoia", budget=16),
    dict(tree="eagle2", budget=60, copy=True, temperature=0.8, top_p=0.95, seed=7),
    dict(tree="optimal", budget=32, copy=False, temperature=1.0, top_k=50, seed=3),
    dict(head=None, tree="eagle2", budget=16, copy=True),
]


def main(max_new_tokens: int = 40) -> None:
    torch.manual_seed(0)
    model, tok = load_target("smollm2-135m")
    head = load_head("eagletree/heads/smollm2-135m", target_config=model.config)
    for case in CASES:
        options = dict(case)
        use = options.pop("head", head)
        for prompt in PROMPTS:
            out = generate(
                model, tok, use, [{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens, **options
            )
            row = {
                "case": case if "head" not in case else {**case, "head": None},
                "prompt": prompt[:20],
                "tokens": out.token_ids,
                "lengths": out.stats.accepted_lengths,
                "predicted": hashlib.sha256(
                    json.dumps([round(p, 9) for p in out.stats.predicted]).encode()
                ).hexdigest()[:16],
                "copied": out.stats.copied_tokens,
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))

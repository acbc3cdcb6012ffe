"""A synthetic target and drafter for checking the acceptance rules (tests and the prepared GPU run).

Both are seeded functions of the context over a tiny vocabulary, so the true distribution of the
tokens decoding emits is known in closed form and a chi-square test can compare it with what tree
acceptance emits; the drafter roughly agrees with the target, so acceptance and rejection both happen.
"""

from __future__ import annotations

import hashlib

import torch

from ..errors import InvalidValue
from .tree import DraftTree

MODES = ("deterministic", "sampled", "replacement")


def _seeded(tag: str, context: tuple) -> torch.Generator:
    digest = hashlib.sha256(f"{tag}{context}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


class SyntheticPair:
    """Target logits and draft distributions over `vocab` tokens as deterministic functions of the context."""

    def __init__(self, vocab: int, device="cpu"):
        self.vocab, self.device = vocab, torch.device(device)
        self._logits, self._draft = {}, {}

    def logits(self, context: tuple) -> torch.Tensor:
        if context not in self._logits:
            self._logits[context] = (torch.randn(self.vocab, generator=_seeded("target", context)) * 1.3).to(
                self.device
            )
        return self._logits[context]

    def draft(self, context: tuple) -> torch.Tensor:
        if context not in self._draft:
            noise = torch.randn(self.vocab, generator=_seeded("draft", context)).to(self.device)
            self._draft[context] = torch.softmax(self.logits(context) + noise, -1)
        return self._draft[context]


def synthetic_tree(
    pair: SyntheticPair, context: tuple, mode: str, generator: torch.Generator, widths=(3, 2)
) -> tuple[DraftTree, torch.Tensor]:
    """A tree after `context` (`widths` children per node and level) and the target's logits at its nodes.

    mode: "deterministic" (each node's top-k draft tokens), "sampled" (drawn from the draft without
    replacement, with `generator` on the pair's device) or "replacement" (drawn with replacement).
    """
    if mode not in MODES:
        raise InvalidValue(f"mode must be one of {MODES}, got {mode!r}")
    tokens, parents, contexts, frontier = [context[-1]], [-1], [context], [0]
    for width in widths:
        nxt = []
        for u in frontier:
            q = pair.draft(contexts[u])
            if mode == "deterministic":
                picks = torch.topk(q, width).indices.tolist()
            else:
                picks = torch.multinomial(q, width, replacement=mode == "replacement", generator=generator).tolist()
            for t in picks:
                tokens.append(t)
                parents.append(u)
                contexts.append(contexts[u] + (t,))
                nxt.append(len(tokens) - 1)
        frontier = nxt
    sampled = mode != "deterministic"
    dists = torch.stack([pair.draft(c) for c in contexts]) if sampled else None
    tree = DraftTree(tokens, parents, draft_dists=dists, sampled=sampled, with_replacement=mode == "replacement")
    return tree, torch.stack([pair.logits(c) for c in contexts])

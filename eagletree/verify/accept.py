"""Acceptance: walk a verified draft tree top-down and pick the tokens the target would have produced.

Greedy acceptance is vectorized over the tree. Sampling follows the lossless rules of
docs/design.md; it moves the tree's target distributions to the host once per step
(O(1) syncs) and walks only the nodes it visits.
"""

from __future__ import annotations

import torch

from ..errors import InvalidValue
from .tree import DraftTree, TreeError


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Apply temperature, top-k and top-p exactly as `model.generate(do_sample=True)` does, in its order."""
    # transformers is imported here, not at the top: it takes seconds to load and only sampling needs it.
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if temperature <= 0:
        raise InvalidValue(f"sampling needs temperature > 0, got {temperature}")
    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k is not None and top_k != 0:
        scores = TopKLogitsWarper(top_k=top_k)(None, scores)
    if top_p is not None and top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p)(None, scores)
    return scores


def target_probs(logits, temperature=1.0, top_k=None, top_p=None) -> torch.Tensor:
    """[N, vocab] logits -> the distributions plain sampling draws from."""
    return torch.softmax(warp_logits(logits, temperature, top_k, top_p), dim=-1)


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest root path whose every token is the target's argmax after its parent.

    Walked on the host from one read-back of the argmaxes (a tree has tens of nodes; the tensor form of the walk
    cost a dozen small operations per sequence and pass). Among siblings with the same token (a sampled tree's
    repeats) only the first in draft order is ever tried."""
    best = logits.argmax(dim=-1).tolist()  # [N]
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    correct_child: dict[int, int] = {}  # node -> its first child holding the target's argmax after it
    for v in range(1, len(tokens)):
        u = parents[v]
        if tokens[v] == best[u] and u not in correct_child:
            correct_child[u] = v
    path = [0]
    while path[-1] in correct_child:
        path.append(correct_child[path[-1]])
    return path, best[path[-1]]


def _sample(p: torch.Tensor, generator) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def _normalized(p: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = p.sum()
    # Exact arithmetic never empties the residual; float rounding can, and then p itself is right.
    return p / total if total > 0 else fallback


def _host_probs(logits: torch.Tensor, temperature, top_k, top_p):
    """Row v -> the target distribution after node v, in float64 on the host.

    On an accelerator all rows are warped there and copied once (one sync per step); on the CPU
    only the rows the walk visits (at most depth + 1) are warped.
    """
    if logits.device.type != "cpu":
        probs = target_probs(logits, temperature, top_k, top_p).to("cpu", torch.float64)
        return lambda v: probs[v].clone()
    return lambda v: target_probs(logits[v : v + 1], temperature, top_k, top_p)[0].double()


def accept_sampling(tree: DraftTree, probs, generator=None) -> tuple[list[int], int]:
    """Lossless multi-candidate speculative sampling over the tree.

    `probs` is the target distributions [N, vocab], or a function v -> distribution after node v.
    """
    if isinstance(probs, torch.Tensor):
        table = probs.detach().to("cpu", torch.float64)
        probs = lambda v: table[v].clone()  # noqa: E731
    tokens = tree.tokens.tolist()
    children = tree.children()
    dists = tree.draft_dists.to("cpu", torch.float64) if tree.sampled else None
    coin = lambda: float(torch.rand((), generator=generator, dtype=torch.float64))  # noqa: E731
    path, u = [0], 0
    while True:
        p = probs(u)
        q = dists[u].clone() if tree.sampled else None
        if tree.sampled:
            q = _normalized(q, q)
        nxt = None
        for c in children[u]:
            x = tokens[c]
            if not tree.sampled:
                # Top-k drafted child: accept with p(x); otherwise remove x and renormalize.
                if coin() < p[x]:
                    nxt = c
                    break
                rest = p.clone()
                rest[x] = 0.0
                p = _normalized(rest, p)
            else:
                if coin() < min(1.0, float(p[x] / q[x])):
                    nxt = c
                    break
                p = _normalized((p - q).clamp_min(0.0), p)
                if not tree.with_replacement:
                    q[x] = 0.0
                    q = _normalized(q, q)
        if nxt is None:
            # All children rejected (the residual) or a leaf (the bonus token).
            return path, _sample(p, generator)
        path.append(nxt)
        u = nxt


def accept_tree(
    tree: DraftTree, logits: torch.Tensor, temperature: float = 0.0, top_k=None, top_p=None, generator=None
):
    """(accepted node indices from the root, next token) for target logits [N, vocab] (row v: after v)."""
    if logits.dim() != 2 or logits.shape[0] != len(tree):
        raise TreeError(f"logits must be [N={len(tree)}, vocab], got shape {tuple(logits.shape)}")
    vocab = logits.shape[1]
    if int(tree.tokens.max()) >= vocab:
        v = int(tree.tokens.argmax())
        raise TreeError(f"node {v} has token id {int(tree.tokens[v])}; expected 0 <= id < {vocab} (the logits' vocab)")
    if tree.sampled and tree.draft_dists.shape[1] != vocab:
        raise TreeError(f"draft_dists has vocab {tree.draft_dists.shape[1]}, but the logits have {vocab}")
    if temperature is None or temperature == 0.0:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, _host_probs(logits, temperature, top_k, top_p), generator)

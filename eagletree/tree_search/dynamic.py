"""Dynamic draft trees: EAGLE-2's expand-and-rerank, and the exact optimum under a node budget.

A node's value is the product of draft probabilities along its root path; a tree's worth is
E[tokens/pass] = 1 + the sum of its non-root values. Values never grow along a path, so the top
nodes by value (ties toward the shallower, earlier node) always form a connected tree.

Two forms of each method:
- reference (`eagle2_tree`, `optimal_tree`): `child_probs(path) -> [vocab]`, plain Python, for
  tests and analysis;
- batched (`eagle2_search`, `optimal_search`): one `expand` call per depth level for the whole
  frontier, tensors on the drafter's device, no Python loop per node. Both build the same trees.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Protocol

import torch

from ..verify import DraftTree

PROB_TOLERANCE = 1e-3


def check_search_args(budget, depth, top_k) -> None:
    for name, value in (("budget", budget), ("depth", depth), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_distribution(probs: torch.Tensor, where: str = "draft distribution") -> torch.Tensor:
    """Raise ValueError unless `probs` (1-D or [F, vocab]) holds finite, non-negative rows summing to 1."""
    if torch.isnan(probs).any():
        raise ValueError(f"{where} contains NaN")
    if (probs < 0).any():
        raise ValueError(f"{where} has a negative probability {float(probs.min())}")
    sums = probs.sum(-1, dtype=torch.float32)
    worst = float((sums - 1).abs().max())
    if worst > PROB_TOLERANCE:
        bad = float(sums.flatten()[(sums.flatten() - 1).abs().argmax()])
        raise ValueError(f"{where} sums to {bad:.6f}; expected 1 (tolerance {PROB_TOLERANCE})")
    return probs


def _tree_from_selection(tokens, parents, probs, values, order) -> DraftTree:
    """DraftTree of the root plus `order` (node ids in rank order, parents always ranked first)."""
    remap = {0: 0}
    for rank, v in enumerate(order, start=1):
        remap[v] = rank
    new_parents = [-1] + [remap[parents[v]] for v in order]
    tree = DraftTree([tokens[0]] + [tokens[v] for v in order], new_parents,
                     draft_probs=[1.0] + [probs[v] for v in order])
    tree.values = torch.tensor([1.0] + [values[v] for v in order], dtype=torch.float64)
    tree.node_ids = [0] + list(order)  # the search's node ids (the ids `expand` saw), per tree node
    return tree


# ---------------------------------------------------------------------------------------------
# Reference forms
# ---------------------------------------------------------------------------------------------


class _Nodes:
    """Growing node table for the reference searches: node 0 is the root."""

    def __init__(self, root_token):
        self.tokens, self.parents, self.probs, self.values, self.depths = [int(root_token)], [-1], [1.0], [1.0], [0]
        self.paths = [()]

    def children(self, child_probs, u, top_k):
        """Create u's top_k children with non-zero probability; return their ids."""
        probs = check_distribution(torch.as_tensor(child_probs(self.paths[u])).double(),
                                   f"child_probs{self.paths[u]}")
        q, tok = torch.topk(probs, min(top_k, probs.numel()))  # ties: lower token id first
        made = []
        for p, t in zip(q.tolist(), tok.tolist()):
            if p <= 0:
                continue
            self.tokens.append(t)
            self.parents.append(u)
            self.probs.append(p)
            self.values.append(self.values[u] * p)
            self.depths.append(self.depths[u] + 1)
            self.paths.append(self.paths[u] + (t,))
            made.append(len(self.tokens) - 1)
        return made

    def key(self, v):  # rank order: higher value, then shallower, then created earlier
        return (-self.values[v], self.depths[v], v)

    def tree(self, chosen) -> DraftTree:
        order = sorted(chosen, key=self.key)
        return _tree_from_selection(self.tokens, self.parents, self.probs, self.values, order)


def eagle2_tree(child_probs: Callable, root_token: int, budget: int = 60, depth: int = 6, top_k: int = 10) -> DraftTree:
    """EAGLE-2: grow top_k frontier nodes per level, then keep the budget-1 best drafted nodes."""
    check_search_args(budget, depth, top_k)
    nodes = _Nodes(root_token)
    frontier, drafted = [0], []
    for _ in range(depth):
        candidates = [c for u in frontier for c in nodes.children(child_probs, u, top_k)]
        drafted += candidates
        frontier = sorted(candidates, key=nodes.key)[:top_k]
        if not frontier:
            break
    return nodes.tree(sorted(drafted, key=nodes.key)[: budget - 1])


def optimal_tree(child_probs: Callable, root_token: int, budget: int = 60, depth: int = 6, top_k: int = 10) -> DraftTree:
    """The budget-node tree (each node among its parent's top_k) with the largest sum of path products.

    Best-first: a child is never worth more than its parent, so popping the highest value from a
    heap of candidates yields the global top nodes in order, each after its parent.
    """
    check_search_args(budget, depth, top_k)
    nodes = _Nodes(root_token)
    heap = [nodes.key(c) for c in nodes.children(child_probs, 0, top_k)]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < budget - 1:
        _, d, v = heapq.heappop(heap)
        chosen.append(v)
        if d < depth:
            for c in nodes.children(child_probs, v, top_k):
                heapq.heappush(heap, nodes.key(c))
    return nodes.tree(chosen)


# ---------------------------------------------------------------------------------------------
# Batched forms
# ---------------------------------------------------------------------------------------------


class Expand(Protocol):
    def __call__(self, nodes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, level: int) -> torch.Tensor:
        """Draft distributions [F, vocab] after each frontier node.

        nodes: [F] ids of the frontier nodes (creation order, root = 0); tokens: [F] their tokens;
        parents: [F] their parents' ids; level: the depth of the children being drafted (1 = root's).
        """


class _Table:
    """Node table of the batched searches, as growing tensors on one device."""

    def __init__(self, root_token, device):
        self.tokens = torch.tensor([int(root_token)], device=device)
        self.parents = torch.tensor([-1], device=device)
        self.probs = torch.ones(1, dtype=torch.float64, device=device)
        self.values = torch.ones(1, dtype=torch.float64, device=device)

    def grow(self, expand, frontier, top_k, level, token_map=None):
        """Draft top_k children for every frontier node; return (new ids, their values; -inf = none)."""
        probs = expand(frontier, self.tokens[frontier], self.parents[frontier], level)
        check_distribution(probs, f"drafter output at level {level}")
        q, tok = torch.topk(probs, min(top_k, probs.shape[-1]), dim=-1)  # [F, k]
        q = q.double()  # path products in float64; the [F, V] table stays in the drafter's precision
        if token_map is not None:  # a draft vocabulary: its ids -> target ids
            tok = token_map.to(tok.device)[tok]
        value = torch.where(q > 0, self.values[frontier, None] * q, -math.inf)
        start = self.tokens.numel()
        self.tokens = torch.cat([self.tokens, tok.flatten()])
        self.parents = torch.cat([self.parents, frontier.repeat_interleave(q.shape[1])])
        self.probs = torch.cat([self.probs, q.flatten()])
        self.values = torch.cat([self.values, value.flatten()])
        ids = torch.arange(start, self.tokens.numel(), device=frontier.device)
        return ids, value.flatten()

    def best(self, ids, values, count):
        """The `count` best of `ids` by value (stable: earlier ids win ties), dropping -inf."""
        order = torch.sort(values, descending=True, stable=True).indices[:count]
        order = order[torch.isfinite(values[order])]
        return ids[order]

    def tree(self, drafted_ids) -> DraftTree:
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        probs, values = self.probs.tolist(), self.values.tolist()
        return _tree_from_selection(tokens, parents, probs, values, drafted_ids.tolist())


def _search(expand: Expand, root_token, budget, depth, top_k, width, device, token_map=None,
            min_gain=0.0) -> DraftTree:
    check_search_args(budget, depth, top_k)
    table = _Table(root_token, device)
    frontier = torch.zeros(1, dtype=torch.long, device=device)
    drafted, drafted_values = [], []
    for level in range(1, depth + 1):
        ids, values = table.grow(expand, frontier, top_k, level, token_map)
        drafted.append(ids)
        drafted_values.append(values)
        frontier = table.best(ids, values, width)
        if frontier.numel() == 0:
            break
        # A child is worth at most its parent times its probability, so the next level can add at
        # most the frontier's total value: stop once that is below what drafting a level costs.
        if min_gain > 0 and level < depth and float(table.values[frontier].sum()) < min_gain:
            break
    ids, values = torch.cat(drafted), torch.cat(drafted_values)
    return table.tree(table.best(ids, values, budget - 1))


def eagle2_search(expand: Expand, root_token: int, budget=60, depth=6, top_k=10, device="cpu",
                  token_map=None) -> DraftTree:
    """Batched EAGLE-2: the frontier is the top_k nodes of each level; same tree as `eagle2_tree`.

    `token_map` (draft id -> target id) is for drafters over a reduced draft vocabulary.
    """
    return _search(expand, root_token, budget, depth, top_k, width=top_k, device=device, token_map=token_map)


def optimal_search(expand: Expand, root_token: int, budget=60, depth=6, top_k=10, device="cpu",
                   token_map=None, min_gain=0.0) -> DraftTree:
    """Batched optimum: a beam of budget-1 nodes per level loses no node of the global top budget-1.

    min_gain > 0 stops drafting deeper once the next level could add less than that many expected
    tokens (the tree is then optimal for the levels drafted).
    """
    return _search(expand, root_token, budget, depth, top_k, width=budget - 1, device=device, token_map=token_map,
                   min_gain=min_gain)


def path_expand(child_probs: Callable) -> Expand:
    """Adapt a reference drafter `child_probs(path)` to the batched interface (for tests and analysis)."""
    paths = {0: ()}  # node id -> tokens from the root; a frontier node's parent was expanded before it

    def expand(nodes, tokens, parents, level):
        out = []
        for v, t, u in zip(nodes.tolist(), tokens.tolist(), parents.tolist()):
            if v not in paths:
                paths[v] = paths[u] + (t,)
            out.append(torch.as_tensor(child_probs(paths[v]), dtype=torch.float64))
        return torch.stack(out)

    return expand

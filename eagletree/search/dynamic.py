"""Dynamic draft trees: EAGLE-2's expand-and-rerank, and the exact optimum under a node budget.

A node's value is the product of draft probabilities along its root path; a tree's worth is
E[tokens/pass] = 1 + the sum of its non-root values. Values never grow along a path, so the top
nodes by value (ties toward the shallower, earlier node) always form a connected tree.

Two forms of each method:
- reference (`eagle2_tree`, `optimal_tree`): `child_probs(path) -> [vocab]`, plain Python, for
  tests and analysis;
- batched (`eagle2_search`, `optimal_search`): one `expand` call per depth level for the whole
  frontier, the distributions on the drafter's device and read back once per level as their top-k; the
  node table is host lists (tens to hundreds of nodes a step, where tensor operations per node or per
  parent would cost more than the Python). Both build the same trees.

The reference forms build their trees here; the batched ones run `batched.search_steps`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from ..verify import DraftTree
from .batched import Expand, SearchSpec, drive, search_steps
from .checks import check_distribution, check_search_args
from .selection import agreed, exclusive_scales, tree_from_selection

# ---------------------------------------------------------------------------------------------
# Reference forms
# ---------------------------------------------------------------------------------------------


class _Nodes:
    """Growing node table for the reference searches: node 0 is the root."""

    def __init__(self, root_token, copies=None):
        self.tokens, self.parents, self.probs, self.values, self.depths = [int(root_token)], [-1], [1.0], [1.0], [0]
        self.paths = [()]
        self.copies = copies
        # node -> (copy trie, its children lists, trie node) on the same path: the root's trie, or one
        # looked up under a head node (`look_up`)
        self.trie_node = {0: (copies, copies.children(), 0)} if copies is not None else {}
        self.lookup = copies.lookup if copies is not None else None
        self.copy_info = {}

    def _add(self, u, t, p) -> int:
        self.tokens.append(t)
        self.parents.append(u)
        self.probs.append(p)
        self.values.append(self.values[u] * p)
        self.depths.append(self.depths[u] + 1)
        self.paths.append(self.paths[u] + (t,))
        return len(self.tokens) - 1

    def look_up(self, nodes) -> None:
        """Give each of `nodes` not on a copied path the copies of the context extended by its path."""
        for u in nodes if self.lookup is not None else ():
            if u not in self.trie_node:
                trie = self.lookup(self.paths[u])
                if trie is not None:
                    self.trie_node[u] = (trie, trie.children(), 0)

    def children(self, child_probs, u, top_k, head=True):
        """Create u's top_k children with non-zero probability (head=True) and its copied ones; return their ids."""
        made, by_token = [], {}
        if head:
            probs = check_distribution(
                torch.as_tensor(child_probs(self.paths[u])).double(), f"child_probs{self.paths[u]}"
            )
            q, tok = torch.topk(probs, min(top_k, probs.numel()))  # ties: lower token id first
            for p, t in zip(q.tolist(), tok.tolist()):
                if p > 0:
                    by_token[t] = self._add(u, t, p)
                    made.append(by_token[t])
        trie, kids, at = self.trie_node.get(u, (None, None, None))
        copied, merged = [], []
        for c in kids[at] if trie is not None else ():
            t, a = trie.tokens[c], trie.factors[c]
            v = by_token.get(t)
            if v is None:
                v = self._add(u, t, a)
                made.append(v)
                self.copy_info[v] = trie.info[c]
            else:
                merged.append((v, self.probs[v]))
                self.probs[v] = agreed(a, self.probs[v])  # one node: the head and a copy agree
                self.copy_info[v] = trie.info[c] + (True,)  # the head proposed it too
            copied.append(v)
            self.trie_node[v] = (trie, kids, c)
        if copied:
            copy_scale, head_scale = exclusive_scales(
                [u] * len(copied), [self.probs[v] for v in copied], [u] * len(merged), [q for _, q in merged]
            )
            for v in made:
                self.probs[v] *= copy_scale.get(u, 1.0) if v in copied else head_scale[u]
        for v in made:
            self.values[v] = self.values[u] * self.probs[v]
        return made

    def key(self, v):  # rank order: higher value, then shallower, then created earlier
        return (-self.values[v], self.depths[v], v)

    def tree(self, chosen) -> DraftTree:
        order = sorted(chosen, key=self.key)
        return tree_from_selection(
            self.tokens,
            self.parents,
            self.probs,
            self.values,
            order,
            self.copy_info if self.copies is not None else None,
        )


def eagle2_tree(
    child_probs: Callable, root_token: int, budget: int = 60, depth: int = 6, top_k: int = 10, copies=None
) -> DraftTree:
    """EAGLE-2: grow top_k frontier nodes per level, then keep the budget-1 best drafted nodes.

    `copies` (a `copy.CopyTrie`): its continuations are drafted too, to the trie's depth; the head
    drafts under the frontier only, and copied children of frontier nodes may enter the frontier.
    With `copies.lookup`, each level's best top_k nodes not on a copied path get the copies of the
    context extended by their path as well. A node's children with copies among them are valued
    so that they sum to at most 1 (`exclusive_scales`).
    """
    check_search_args(budget, depth, top_k)
    nodes = _Nodes(root_token, copies)
    frontier, drafted, level = [0], [], 0
    while True:
        level += 1
        candidates = [c for u in frontier for c in nodes.children(child_probs, u, top_k)]
        others = [u for u in nodes.trie_node if nodes.depths[u] == level - 1 and u not in frontier]
        drafted += candidates + [c for u in others for c in nodes.children(child_probs, u, top_k, head=False)]
        best = sorted(candidates, key=nodes.key)[:top_k]
        nodes.look_up(best)  # copies also start under the level's best nodes
        frontier = best if level < depth else []
        if not frontier and not any(nodes.depths[u] == level for u in nodes.trie_node):
            break
    return nodes.tree(sorted(drafted, key=nodes.key)[: budget - 1])


def optimal_tree(
    child_probs: Callable, root_token: int, budget: int = 60, depth: int = 6, top_k: int = 10, copies=None
) -> DraftTree:
    """The budget-node tree (each node among its parent's top_k) with the largest sum of path products.

    Best-first: a child is never worth more than its parent, so popping the highest value from a
    heap of candidates yields the global top nodes in order, each after its parent. `copies` (a
    `copy.CopyTrie`) adds the copied continuations as candidates too, to their own depth, and with
    `copies.lookup` those looked up after each chosen node not on a copied path.
    """
    check_search_args(budget, depth, top_k)
    nodes = _Nodes(root_token, copies)
    heap = [nodes.key(c) for c in nodes.children(child_probs, 0, top_k)]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < budget - 1:
        _, d, v = heapq.heappop(heap)
        chosen.append(v)
        nodes.look_up([v])
        for c in nodes.children(child_probs, v, top_k, head=d < depth):
            heapq.heappush(heap, nodes.key(c))
    return nodes.tree(chosen)


# ---------------------------------------------------------------------------------------------
# Batched forms
# ---------------------------------------------------------------------------------------------


def eagle2_search(
    expand: Expand, root_token: int, budget=60, depth=6, top_k=10, device="cpu", token_map=None, copies=None
) -> DraftTree:
    """Batched EAGLE-2: the frontier is the top_k nodes of each level; same tree as `eagle2_tree`.

    `token_map` (draft id -> target id) is for drafters over a reduced draft vocabulary; `copies`
    (a `copy.CopyTrie`) adds copied continuations as candidates (see `optimal_search`).
    """
    spec = SearchSpec(budget, depth, top_k, top_k, device, token_map)
    return drive(search_steps(expand is not None, root_token, spec, copies), expand)


def optimal_search(
    expand: Expand,
    root_token: int,
    budget=60,
    depth=6,
    top_k=10,
    device="cpu",
    token_map=None,
    min_gain=0.0,
    copies=None,
) -> DraftTree:
    """Batched optimum: a beam of budget-1 nodes per level loses no node of the global top budget-1.

    min_gain > 0 stops drafting deeper once the next level could add less than that many expected
    tokens (the tree is then optimal for the levels drafted). `copies` (a `copy.CopyTrie`) adds
    its copied continuations as candidates, valued by their calibrated acceptance, to the trie's
    own depth (beyond the head's): a copied token equal to a head candidate is that node (valued by
    `agreed`), and the head also drafts under copied nodes of the beam. The result is
    `optimal_tree(..., copies=)`'s: the best budget-node tree over head and copy candidates.
    """
    spec = SearchSpec(budget, depth, top_k, budget - 1, device, token_map, min_gain)
    return drive(search_steps(expand is not None, root_token, spec, copies), expand)


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

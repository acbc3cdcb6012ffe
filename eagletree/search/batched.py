"""The batched searches as generators, and their drivers.

A search yields each level's drafter request and receives its distributions (or their top-k, read back for a whole
batch at once: `readback.top_k_lists`), so several searches can draft level by level together: `drive` runs one
with a drafter, `drive_batch` several with a batch drafter. `search_steps` is EAGLE-2's search and the optimum's
(by its beam `width`), with copied spans grafted in (`table.NodeTable.graft`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from .checks import check_search_args
from .readback import top_k_lists
from .table import LevelNodes, NodeTable


class Expand(Protocol):
    def __call__(self, nodes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, level: int) -> torch.Tensor:
        """Draft distributions [F, vocab] after each frontier node.

        nodes: [F] ids of the frontier nodes (creation order, root = 0); tokens: [F] their tokens;
        parents: [F] their parents' ids; level: the depth of the children being drafted (1 = root's).
        """


class SharedFloor:
    """The best `count` node values drafted so far by the searches of a batch that share one node budget.

    Each search's node worth less than the last of them can never be among the batch's best `count` (nor
    anything below it), so no search drafts, looks up or grafts under it."""

    def __init__(self, count: int):
        self.count, self.best = count, []

    def add(self, values: list[float]) -> float:
        """Add a finished level's values; returns the floor (-inf until `count` values are known)."""
        self.best = heapq.nlargest(self.count, self.best + values)
        return self.best[-1] if len(self.best) == self.count > 0 else -math.inf


def drive(search, expand: Expand):
    """Run a search generator (`search_steps`, `static_steps`) with a drafter; returns its tree."""
    try:
        request = next(search)
        while True:
            request = search.send(expand(*request))
    except StopIteration as done:
        return done.value


def drive_batch(searches: list, expand_batch, top_k: int | None = None, token_map=None) -> list:
    """Run several search generators level by level, each level's requests in one `expand_batch(requests)` call
    ([(search index, nodes, tokens, parents, level)] -> one distribution per request); returns their trees.
    With `top_k` (the searches' own, for `search_steps`), each level's distributions reach them as `TopK`s read
    back for the whole batch at once."""
    trees: list = [None] * len(searches)
    waiting = {}

    def advance(i, value):
        try:
            waiting[i] = searches[i].send(value)
        except StopIteration as done:
            trees[i] = done.value

    for i in range(len(searches)):
        advance(i, None)
    while waiting:
        asked = sorted(waiting.items())
        waiting.clear()
        drafted = expand_batch([(i, *request) for i, request in asked])
        if top_k is not None:
            level = max(request[-1] for _, request in asked)
            drafted = top_k_lists(drafted, top_k, level, token_map)
        for (i, _), probs in zip(asked, drafted):
            advance(i, probs)
    return trees


@dataclass(frozen=True)
class SearchSpec:
    """What one batched search drafts: at most `budget` nodes (root included); the head to `depth` levels, `top_k`
    children per drafted node and a beam of `width` nodes per level (EAGLE-2: top_k; the optimum: budget - 1).
    `device` and `token_map` (draft id -> target id) are the drafter's; `min_gain` > 0 stops drafting deeper once the
    next level could add fewer expected tokens than that."""

    budget: int
    depth: int
    top_k: int
    width: int
    device: object = "cpu"
    token_map: torch.Tensor | None = None
    min_gain: float = 0.0


def search_steps(drafts: bool, root_token, spec: SearchSpec, copies=None, shared=None):
    """The batched searches as a generator: yields each level's drafter request (`NodeTable.request`), receives its
    distributions, returns the DraftTree. drafts=False: copied spans alone. `shared`: the batch's SharedFloor."""
    budget, depth, top_k, width = spec.budget, spec.depth, spec.top_k, spec.width
    token_map, min_gain = spec.token_map, spec.min_gain
    check_search_args(budget, depth, top_k)
    table = NodeTable(root_token, spec.device)
    frontier = [0] if drafts else []
    drafted = []
    # Copy tries being grafted: (trie, trie node -> table node, the level of its root). The root's
    # trie first; with `copies.lookup`, one more under each of a level's best nodes not on a copied path.
    tries = [(copies, {0: 0}, 0)] if copies is not None else []
    lookup = copies.lookup if copies is not None else None
    on_copy = {0}  # table nodes with a trie of their own or on a copied path
    # The budget-1 best values of the finished levels (they never change once a level is done): a node
    # worth less than the last of them is never chosen, nor is anything below it (a child is worth at
    # most its parent), so nothing is drafted, looked up or grafted under it. The tree is the same.
    best_kept, floor = [], -math.inf
    level = 0
    while True:
        level += 1
        # The head drafts to `depth` under the frontier; copied spans go on to their own depth.
        grown = (
            table.grow((yield table.request(frontier, level)), frontier, top_k, level, token_map) if frontier else []
        )
        nodes = LevelNodes(table, grown)
        head_ids, tries = _graft_level(table, tries, level, frontier, nodes, floor)
        drafted += nodes.ids
        found = [x for x in (table.values[v] for v in nodes.ids) if x > -math.inf]
        best_kept = heapq.nlargest(budget - 1, best_kept + found)
        if len(best_kept) == budget - 1 > 0:
            floor = best_kept[-1]
        if shared is not None:
            floor = max(floor, shared.add(found))
        best = table.best(head_ids, width)  # values as the grafts left them
        worth = [v for v in best if table.values[v] >= floor]
        if lookup is not None:
            tries += _look_up(table, lookup, worth, on_copy, level)
        frontier = worth if level < depth else []
        # A child is worth at most its parent times its probability, so the next level can add at
        # most the best nodes' total value: stop once that is below what drafting a level costs.
        if min_gain > 0 and frontier and sum(table.values[v] for v in best) < min_gain:
            frontier = []
        if not frontier and not any(level < start + trie.depth for trie, _, start in tries):
            break
    return table.tree(table.best(drafted, budget - 1), with_copies=copies is not None)


def _graft_level(table: NodeTable, tries: list, level: int, frontier: list[int], nodes: LevelNodes, floor: float):
    """Graft each copy trie's nodes of this level: (the level's nodes the head can expand, its new children and the
    copied nodes under the frontier; the tries that may still place nodes deeper)."""
    head_ids = list(nodes.ids)
    live = []
    for trie, placed, start in tries:
        if start < level <= start + trie.depth:
            head_ids += table.graft(trie, level - start, placed, frontier, nodes, floor)
            if not any(c in placed for c in trie.by_level(level - start)):
                continue  # nothing of this trie placed at this level: nothing deeper can be
        live.append((trie, placed, start))
    return head_ids, live


def _look_up(table: NodeTable, lookup, nodes: list[int], on_copy: set, level: int) -> list:
    """The copy tries of the context extended by each of `nodes`' paths, for nodes not on a copied path."""
    on_copy.update(table.copy_info)
    found = []
    for v in nodes:
        if v in on_copy:
            continue
        path, u = [], v
        while u > 0:
            path.append(table.tokens[u])
            u = table.parents[u]
        trie = lookup(tuple(reversed(path)))
        on_copy.add(v)
        if trie is not None:
            found.append((trie, {0: v}, level))
    return found

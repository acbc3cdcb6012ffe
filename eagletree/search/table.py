"""The node table of the batched searches, and the index of one search level's nodes that copy grafts use."""

from __future__ import annotations

import math

import torch

from ..verify import DraftTree
from .readback import TopK, top_k_lists
from .selection import agreed, exclusive_scales, tree_from_selection


class NodeTable:
    """Node table of the batched searches: host lists (a step's tree has tens to hundreds of nodes, and on a CPU
    each small tensor operation costs more than the Python it replaces); the drafter's distributions stay tensors
    on its device, read back once per level as their top-k."""

    def __init__(self, root_token, device):
        self.device = device
        self.tokens, self.parents, self.probs, self.values = [int(root_token)], [-1], [1.0], [1.0]
        self.copy_info: dict[int, tuple[int, int]] = {}

    def request(self, frontier: list[int], level: int) -> tuple:
        """What the drafter is asked for the frontier: (nodes, tokens, parents, level), as `Expand` takes them."""
        on = dict(device=self.device)
        return (
            torch.tensor(frontier, **on),
            torch.tensor([self.tokens[u] for u in frontier], **on),
            torch.tensor([self.parents[u] for u in frontier], **on),
            level,
        )

    def grow(self, probs, frontier: list[int], top_k, level, token_map=None) -> list[int]:
        """Add top_k children of every frontier node from its drafted distribution (or their `TopK`, read back for
        a whole batch); return their ids (value -inf: probability 0)."""
        q, tok = (probs if isinstance(probs, TopK) else top_k_lists([probs], top_k, level, token_map)[0]).lists
        start, values = len(self.tokens), self.values
        for u, qs, ts in zip(frontier, q, tok):
            self.tokens.extend(map(int, ts))
            self.parents.extend([u] * len(qs))
            self.probs.extend(qs)
            parent_value = values[u]
            values.extend([parent_value * p if p > 0 else -math.inf for p in qs])
        return list(range(start, len(self.tokens)))

    def graft(self, copies, level, placed, frontier, nodes: LevelNodes, floor=-math.inf) -> list[int]:
        """Add the copy trie's nodes at depth `level` under their placed parents, merging with equal head children.

        Parents worth less than `floor` get none (nothing under them can be chosen), nor do unplaced ones.

        Where a parent gets copied children, its children are revalued to sum to at most 1
        (`exclusive_scales`). `nodes`: this level's nodes so far (the head's new children, then copies grafted by
        earlier tries), extended in place with the new copied nodes. Returns the copied nodes the head can expand
        next (those under this level's frontier: the drafter has their parents' state).
        """
        level_nodes = [c for c in copies.by_level(level) if copies.parents[c] in placed]
        parents = [placed[copies.parents[c]] for c in level_nodes]
        if floor > -math.inf:
            keep = [self.values[u] >= floor for u in parents]
            level_nodes = [c for c, ok in zip(level_nodes, keep) if ok]
            parents = [u for u, ok in zip(parents, keep) if ok]
        if not level_nodes:
            return []
        expanded = set(frontier)
        new, can_expand, merged = [], [], []  # new: (parent, token, estimate) of each new copied node
        next_id = len(self.tokens)
        for c, u in zip(level_nodes, parents):
            t, a = copies.tokens[c], copies.factors[c]
            v = nodes.child.get((u, t))
            if v is not None and self.values[v] == -math.inf:
                v = None  # a head child of probability 0 proposes nothing: the copy is a node of its own
            if v is None:
                v = next_id + len(new)
                new.append((u, t, a))
                if u in expanded:
                    can_expand.append(v)
                self.copy_info[v] = copies.info[c]
            else:
                merged.append((v, u, a))
                self.copy_info[v] = copies.info[c] + (True,)  # the head proposed it too
            placed[c] = v
        self._value_copies(nodes, new, merged)
        return can_expand

    def _value_copies(self, nodes: LevelNodes, new: list, merged: list) -> None:
        """Value a level's copied nodes: the `merged` ones (node, parent, estimate) the head proposed too, the head's
        other children of their parents, and the `new` ones (parent, token, estimate), added to the table."""
        head_q = [self.probs[v] for v, _, _ in merged]
        merged_p = [agreed(a, q) for (_, _, a), q in zip(merged, head_q)]  # one node: the head and a copy agree
        copy_scale, head_scale = exclusive_scales(
            [u for u, _, _ in new] + [u for _, u, _ in merged],
            [a for _, _, a in new] + merged_p,
            [u for _, u, _ in merged],
            head_q,
        )
        for (v, u, _), p in zip(merged, merged_p):
            self.probs[v] = p * copy_scale.get(u, 1.0)
            self.values[v] = self.values[u] * self.probs[v]
        done = {v for v, _, _ in merged}
        for u, r in head_scale.items():  # the head's other children of a parent with copies share what copies leave
            for v in nodes.children.get(u, ()):
                if v not in done and self.values[v] > -math.inf:
                    self.probs[v] *= r
                    self.values[v] = self.values[u] * self.probs[v]
        for u, t, a in new:
            self.tokens.append(t)
            self.parents.append(u)
            self.probs.append(a * copy_scale.get(u, 1.0))
            self.values.append(self.values[u] * self.probs[-1])
            nodes.add(len(self.tokens) - 1)

    def best(self, ids: list[int], count: int) -> list[int]:
        """The `count` best of `ids` by value (stable: earlier ids win ties), dropping -inf."""
        order = sorted(ids, key=lambda v: -self.values[v])[:count]  # (ids ascend, so stable = earlier first)
        return [v for v in order if self.values[v] > -math.inf]

    def tree(self, drafted_ids: list[int], with_copies=False) -> DraftTree:
        return tree_from_selection(
            self.tokens, self.parents, self.probs, self.values, drafted_ids, self.copy_info if with_copies else None
        )


class LevelNodes:
    """One search level's nodes (a contiguous id range), indexed by parent and (parent, token), so that each graft
    costs its own nodes, not the level's. The indexes are built at the first graft (most levels have none)."""

    def __init__(self, table: NodeTable, ids: list[int]):
        self.table, self.ids = table, list(ids)
        self._children: dict[int, list[int]] | None = None
        self._child: dict[tuple[int, int], int] = {}

    def _index(self) -> None:
        self._children = {}
        for v in self.ids:
            self._note(v)

    def _note(self, v: int) -> None:
        u = self.table.parents[v]
        self._children.setdefault(u, []).append(v)
        self._child[(u, self.table.tokens[v])] = v

    @property
    def children(self) -> dict[int, list[int]]:
        if self._children is None:
            self._index()
        return self._children

    @property
    def child(self) -> dict[tuple[int, int], int]:
        if self._children is None:
            self._index()
        return self._child

    def add(self, v: int) -> None:
        self.ids.append(v)
        if self._children is not None:
            self._note(v)

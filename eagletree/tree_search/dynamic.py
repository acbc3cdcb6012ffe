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
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from ..verify import DraftTree

PROB_TOLERANCE = 1e-3


def check_search_args(budget, depth, top_k) -> None:
    for name, value in (("budget", budget), ("depth", depth), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_distribution(probs: torch.Tensor, where: str = "draft distribution") -> torch.Tensor:
    """Raise ValueError unless `probs` (1-D or [F, vocab]) holds finite, non-negative rows summing to 1.

    Two passes over the probabilities (row sums, minimum): a NaN anywhere makes its row's sum NaN. This
    runs at every drafting level, where four full-size passes cost 2-3x as much."""
    sums = probs.sum(-1, dtype=torch.float32)
    # one read back to the host (a GPU stalls once per level, not three times)
    nan, low, worst = torch.stack(
        [sums.isnan().any().double(), probs.min().double(), (sums - 1).abs().max().double()]
    ).tolist()
    if nan:
        raise ValueError(f"{where} contains NaN")
    if low < 0:
        raise ValueError(f"{where} has a negative probability {low}")
    if worst > PROB_TOLERANCE:
        bad = float(sums.flatten()[(sums.flatten() - 1).abs().argmax()])
        raise ValueError(f"{where} sums to {bad:.6f}; expected 1 (tolerance {PROB_TOLERANCE})")
    return probs


class TopK(NamedTuple):
    """A request's top-k children read back to the host: lists [F][k] of probabilities (float64) and target ids."""

    probs: list
    tokens: list

    @property
    def lists(self) -> tuple[list, list]:
        return self.probs, self.tokens


def top_k_lists(probs: list[torch.Tensor], top_k: int, level: int, token_map=None) -> list[TopK]:
    """The top_k children of every row of several requests' distributions ([F_i, V] each, checked), as host lists:
    one check, one top-k and one read back for the whole batch (each costs tens of microseconds on a CPU).

    Distributions marked `softmax_rows` (a list whose producer made every row by a softmax, as the batch drafter
    does) cannot be negative or sum to anything but 1; only a NaN can spoil them (from a NaN or infinite logit), and
    top-k ranks a NaN first, so their check is on the values read back instead of two passes over [F, V]."""
    where = f"drafter output at level {level}"
    counts = [p.shape[0] for p in probs]
    table = probs[0] if len(probs) == 1 else torch.cat(probs)
    softmax_rows = getattr(probs, "softmax_rows", False)
    if not softmax_rows:
        check_distribution(table, where)
    q, tok = torch.topk(table, min(top_k, table.shape[-1]), dim=-1)  # [F, k]
    if token_map is not None:  # a draft vocabulary: its ids -> target ids
        tok = token_map.to(tok.device)[tok]
    # path products in float64 (Python floats); the [F, V] table stays in the drafter's precision
    if q.device.type == "cpu":
        q, tok = q.tolist(), tok.tolist()
    else:  # one read back (one wait for the device); token ids < 2^53 are exact in float64
        q, tok = torch.stack([q.double(), tok.double()]).tolist()
    if softmax_rows and any(x != x for row in q for x in row):
        raise ValueError(f"{where} contains NaN")
    out, start = [], 0
    for n in counts:
        out.append(TopK(q[start : start + n], tok[start : start + n]))
        start += n
    return out


def _tree_from_selection(tokens, parents, probs, values, order, copy_info=None) -> DraftTree:
    """DraftTree of the root plus `order` (node ids in rank order, parents always ranked first)."""
    remap = {0: 0}
    for rank, v in enumerate(order, start=1):
        remap[v] = rank
    new_parents = [-1] + [remap[parents[v]] for v in order]
    depths = [0] * len(new_parents)
    for i in range(1, len(new_parents)):
        depths[i] = depths[new_parents[i]] + 1
    # (parents ranked first and distinct sibling tokens: what the checks of DraftTree() would find, by construction)
    tree = DraftTree.trusted(
        [tokens[0]] + [tokens[v] for v in order], new_parents, [1.0] + [probs[v] for v in order], depths
    )
    tree.values = torch.tensor([1.0] + [values[v] for v in order], dtype=torch.float64)
    tree.node_ids = [0] + list(order)  # the search's node ids (the ids `expand` saw), per tree node
    if copy_info is not None:
        tree.copy_info = [None] + [copy_info.get(v) for v in order]
    return tree


def agreed(copy_rate: float, head_prob: float) -> float:
    """The estimate of a token both a copied span and the head propose: 1 - (1 - a)(1 - q), as if either
    signal alone would have found it. Two independent sources agreeing are right more often than either
    (such nodes are accepted more often than the larger estimate alone says: docs/results.md), so the larger
    estimate alone undervalues them, and a path's
    product compounds that along chains where head and copy keep agreeing."""
    return 1.0 - (1.0 - copy_rate) * (1.0 - head_prob)


COPY_MASS = 0.99  # the most a node's copied children are worth together: the head's others keep a little


def _exclusive(copy_parents, copy_probs, merged_parents, merged_head_probs) -> tuple[dict, dict]:
    """Per parent with copied children: (scale of its copied children, scale of its other head children).

    At most one child of a node is accepted, so its children's estimates should sum to at most 1:
    copied children (estimate p each, `agreed` for one the head proposed too)
    worth M > COPY_MASS together are scaled to that, and the head's other children keep their share
    of what the copies leave, (1 - M) / (1 - the head's probability of the copied tokens it proposed).
    """
    mass, head_mass = {}, {}
    for u, p in zip(copy_parents, copy_probs):
        mass[u] = mass.get(u, 0.0) + p
    for u, q in zip(merged_parents, merged_head_probs):
        head_mass[u] = head_mass.get(u, 0.0) + q
    copy_scale = {u: COPY_MASS / m for u, m in mass.items() if m > COPY_MASS}
    head_scale = {}
    for u, m in mass.items():
        rest = 1.0 - head_mass.get(u, 0.0)
        head_scale[u] = min(1.0, (1.0 - min(m, COPY_MASS)) / rest) if rest > 0 else 0.0
    return copy_scale, head_scale


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
            copy_scale, head_scale = _exclusive(
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
        return _tree_from_selection(
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
    so that they sum to at most 1 (`_exclusive`).
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


class Expand(Protocol):
    def __call__(self, nodes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, level: int) -> torch.Tensor:
        """Draft distributions [F, vocab] after each frontier node.

        nodes: [F] ids of the frontier nodes (creation order, root = 0); tokens: [F] their tokens;
        parents: [F] their parents' ids; level: the depth of the children being drafted (1 = root's).
        """


class _Table:
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

    def graft(self, copies, level, placed, frontier, nodes: _Level, floor=-math.inf) -> list[int]:
        """Add the copy trie's nodes at depth `level` under their placed parents, merging with equal head children.

        Parents worth less than `floor` get none (nothing under them can be chosen), nor do unplaced ones.

        Where a parent gets copied children, its children are revalued to sum to at most 1
        (`_exclusive`). `nodes`: this level's nodes so far (the head's new children, then copies grafted by earlier
        tries), extended in place with the new copied nodes. Returns the copied nodes the head can expand next
        (those under this level's frontier: the drafter has their parents' state).
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
        head_q = [self.probs[v] for v, _, _ in merged]
        merged_p = [agreed(a, q) for (_, _, a), q in zip(merged, head_q)]  # one node: the head and a copy agree
        copy_scale, head_scale = _exclusive(
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
        return can_expand

    def best(self, ids: list[int], count: int) -> list[int]:
        """The `count` best of `ids` by value (stable: earlier ids win ties), dropping -inf."""
        order = sorted(ids, key=lambda v: -self.values[v])[:count]  # (ids ascend, so stable = earlier first)
        return [v for v in order if self.values[v] > -math.inf]

    def tree(self, drafted_ids: list[int], with_copies=False) -> DraftTree:
        return _tree_from_selection(
            self.tokens, self.parents, self.probs, self.values, drafted_ids, self.copy_info if with_copies else None
        )


class _Level:
    """One search level's nodes (a contiguous id range), indexed by parent and (parent, token), so that each graft
    costs its own nodes, not the level's. The indexes are built at the first graft (most levels have none)."""

    def __init__(self, table: _Table, ids: list[int]):
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


def search_steps(
    drafts: bool,
    root_token,
    budget,
    depth,
    top_k,
    width,
    device,
    token_map=None,
    min_gain=0.0,
    copies=None,
    shared=None,
):
    """The batched searches as a generator: yields each level's drafter request (`_Table.request`), receives its
    distributions, returns the DraftTree. drafts=False: copied spans alone. `shared`: the batch's SharedFloor."""
    check_search_args(budget, depth, top_k)
    table = _Table(root_token, device)
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
        nodes = _Level(table, grown)
        head_ids = list(nodes.ids)  # and the copied nodes the head can expand
        live = []
        for trie, placed, start in tries:
            if start < level <= start + trie.depth:
                head_ids += table.graft(trie, level - start, placed, frontier, nodes, floor)
                if not any(c in placed for c in trie.by_level(level - start)):
                    continue  # nothing of this trie placed at this level: nothing deeper can be
            live.append((trie, placed, start))
        tries = live
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


def _look_up(table: _Table, lookup, nodes: list[int], on_copy: set, level: int) -> list:
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


def eagle2_search(
    expand: Expand, root_token: int, budget=60, depth=6, top_k=10, device="cpu", token_map=None, copies=None
) -> DraftTree:
    """Batched EAGLE-2: the frontier is the top_k nodes of each level; same tree as `eagle2_tree`.

    `token_map` (draft id -> target id) is for drafters over a reduced draft vocabulary; `copies`
    (a `copy.CopyTrie`) adds copied continuations as candidates (see `optimal_search`).
    """
    steps = search_steps(
        expand is not None, root_token, budget, depth, top_k, top_k, device, token_map=token_map, copies=copies
    )
    return drive(steps, expand)


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
    steps = search_steps(
        expand is not None, root_token, budget, depth, top_k, budget - 1, device, token_map, min_gain, copies
    )
    return drive(steps, expand)


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

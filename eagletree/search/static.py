"""Static tree shapes: a chain, Medusa-style choice lists, and Sequoia's optimal shape.

A shape is (parents, ranks): node i > 0 is its parent's ranks[i]-th most probable child (0-based).
Filled with a drafter's tokens it becomes a DraftTree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import InvalidValue
from ..verify import DraftTree
from .batched import Expand, drive
from .checks import check_distribution, check_search_args


@dataclass
class Shape:
    parents: list[int]  # parents[0] = -1
    ranks: list[int]  # ranks[0] = -1 (the root); ranks[i]: 0 = parent's most probable child
    expected_tokens: float | None = None  # under the per-rank acceptance it was optimized for

    @property
    def depth(self) -> int:
        depth = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            depth[i] = depth[self.parents[i]] + 1
        return max(depth)


def chain_shape(length: int) -> Shape:
    """A chain of `length` drafted tokens (tree of width 1)."""
    check_search_args(length + 1, max(length, 1), 1)
    return Shape([-1] + list(range(length)), [-1] + [0] * length)


def choices_shape(choices: Sequence[Sequence[int]]) -> Shape:
    """Medusa-style choice list: each entry is the rank path from the root, e.g. (0, 1) = 2nd child of the 1st."""
    index = {(): 0}
    parents, ranks = [-1], [-1]
    if not all(
        isinstance(c, (list, tuple)) and all(isinstance(r, int) and not isinstance(r, bool) for r in c) for c in choices
    ):
        raise InvalidValue(f"tree paths must be rank paths such as [(0,), (1,), (0, 0)], got {list(choices)[:4]}")
    for path in sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c)):
        if not path or any(r < 0 for r in path):
            raise InvalidValue(f"choice {path} must be a non-empty tuple of ranks >= 0")
        if path[:-1] not in index:
            raise InvalidValue(f"choice {path} has no parent {path[:-1]} in the list")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
    return Shape(parents, ranks)


def acceptance_rows(accept_by_rank, depth: int) -> list[list[float]]:
    """Per-depth acceptance rows for `depth` levels: one list of per-rank probabilities for every depth, or a list
    of such rows (row d-1 for children at depth d; the last row repeats below the measured depths)."""
    nested = (
        len(accept_by_rank) > 0
        and not isinstance(accept_by_rank[0], (int, float))
        and getattr(accept_by_rank[0], "__len__", None) is not None
    )
    rows = [[float(x) for x in row] for row in accept_by_rank] if nested else [[float(x) for x in accept_by_rank]]
    if not rows or not rows[0] or len({len(r) for r in rows}) != 1:
        raise InvalidValue(
            f"accept_by_rank must be one non-empty row of probabilities or rows of equal length, got {accept_by_rank}"
        )
    for row in rows:
        if any(not 0.0 <= x <= 1.0 or math.isnan(x) for x in row):
            raise InvalidValue(f"accept_by_rank must hold probabilities in [0, 1], got {row}")
    return [rows[min(d, len(rows) - 1)] for d in range(depth)]


def _sequoia_dp(rows: list[list[float]], budget: int, depth: int):
    """f[d][n]: best value of a subtree of n nodes (root included, root worth 1) and depth <= d, whose root sits
    at depth `depth - d` (its children accept with rows[depth - d]); choice[(d, r, m)]: the nodes given to the
    rank-r child when m nodes hang under ranks r.. of such a root."""
    k, n_max = len(rows[0]), budget
    neg = -math.inf
    f = [[neg] * (n_max + 1) for _ in range(depth + 1)]
    # h[r][m]: best value of m nodes hung under ranks r..k-1 (consecutive from r) with subtree depth <= d-1.
    choice = {}
    for d in range(depth + 1):
        f[d][1] = 1.0
        if d == 0:
            continue
        p = rows[depth - d]
        h = [[neg] * (n_max + 1) for _ in range(k + 1)]
        for r in range(k + 1):
            h[r][0] = 0.0
        for r in range(k - 1, -1, -1):
            for m in range(1, n_max):
                best, arg = neg, None
                for j in range(1, m + 1):  # j nodes in the rank-r child's subtree
                    if f[d - 1][j] == neg or h[r + 1][m - j] == neg:
                        continue
                    value = p[r] * f[d - 1][j] + h[r + 1][m - j]
                    if value > best + 1e-15:
                        best, arg = value, j
                h[r][m] = best
                choice[(d, r, m)] = arg
        for n in range(2, n_max + 1):
            f[d][n] = 1.0 + h[0][n - 1]
    return f, choice


def _sequoia_shape(choice, n: int, depth: int, value: float) -> Shape:
    parents, ranks = [-1], [-1]

    def build(node, n, d):
        m, r = n - 1, 0
        while m > 0:
            j = choice[(d, r, m)]
            parents.append(node)
            ranks.append(r)
            build(len(parents) - 1, j, d - 1)
            m, r = m - j, r + 1

    build(0, n, depth)
    return breadth_first(Shape(parents, ranks, expected_tokens=value))


def breadth_first(shape: Shape) -> Shape:
    """The same tree with its nodes ordered by depth (stable), so the nodes down to any depth are a prefix:
    what cutting a tree near the end of a generation takes."""
    depth = [0] * len(shape.parents)
    for i in range(1, len(shape.parents)):
        depth[i] = depth[shape.parents[i]] + 1
    order = sorted(range(len(depth)), key=lambda i: (depth[i], i))
    new = {old: k for k, old in enumerate(order)}
    return Shape(
        [-1] + [new[shape.parents[i]] for i in order[1:]],
        [shape.ranks[i] for i in order],
        expected_tokens=shape.expected_tokens,
    )


def sequoia_tree(accept_by_rank, budget: int, depth: int) -> Shape:
    """Sequoia's dynamic program: the static shape with the most expected tokens per pass.

    accept_by_rank[r] = probability that the parent's (r+1)-th ranked draft token is the accepted
    one; or rows of these, row d-1 for children at depth d (acceptance measured by depth). A node's
    children occupy ranks 0..m-1 (no gaps). O(budget^2 * depth * k).
    """
    check_search_args(budget, depth, 1)
    rows = acceptance_rows(accept_by_rank, depth)
    f, choice = _sequoia_dp(rows, budget, depth)
    # The best size: values are non-negative, but a rank with p = 0 adds nothing; prefer fewer nodes.
    n_best = max(range(1, budget + 1), key=lambda n: (round(f[depth][n], 12), -n))
    return _sequoia_shape(choice, n_best, depth, f[depth][n_best])


def static_tree(child_probs: Callable, root_token: int, shape: Shape) -> DraftTree:
    """Fill a shape with a drafter's ranked tokens (reference form: one call per internal node)."""
    tokens, probs, paths = [int(root_token)], [1.0], [()]
    for i in range(1, len(shape.parents)):
        u = shape.parents[i]
        q = check_distribution(torch.as_tensor(child_probs(paths[u])).double(), f"child_probs{paths[u]}")
        top_q, top_t = torch.topk(q, shape.ranks[i] + 1)
        tokens.append(int(top_t[-1]))
        probs.append(float(top_q[-1]))
        paths.append(paths[u] + (tokens[-1],))
    return DraftTree(tokens, shape.parents, draft_probs=probs)


def static_search(expand: Expand, root_token: int, shape: Shape, device="cpu", token_map=None) -> DraftTree:
    """Batched form of `static_tree`: one drafter call per depth level."""
    return drive(static_steps(root_token, shape, device, token_map), expand)


def static_steps(root_token: int, shape: Shape, device="cpu", token_map=None):
    """`static_search` as a generator (as `batched.search_steps`): yields each level's request, returns the tree."""
    parents = torch.tensor(shape.parents, device=device)
    ranks = torch.tensor(shape.ranks, device=device)
    n = len(shape.parents)
    depth = torch.zeros(n, dtype=torch.long, device=device)
    for i in range(1, n):  # shape metadata only (small, built once per shape)
        depth[i] = depth[shape.parents[i]] + 1
    tokens = torch.full((n,), int(root_token), device=device)
    probs = torch.ones(n, dtype=torch.float64, device=device)
    for level in range(1, int(depth.max()) + 1 if n > 1 else 1):
        children = (depth == level).nonzero().flatten()
        frontier = torch.unique(parents[children])  # sorted node ids
        q = (yield (frontier, tokens[frontier], parents[frontier], level)).double()
        check_distribution(q, f"drafter output at level {level}")
        top_q, top_t = torch.topk(q, int(ranks[children].max()) + 1, dim=-1)
        row = torch.searchsorted(frontier, parents[children])
        picked = top_t[row, ranks[children]]
        tokens[children] = picked if token_map is None else token_map.to(picked.device)[picked]
        probs[children] = top_q[row, ranks[children]]
    return DraftTree(tokens.cpu(), shape.parents, draft_probs=probs.cpu().float())

"""How the dynamic searches value copied nodes, and the DraftTree of the nodes they choose.

A node's value is the product of draft probabilities along its root path. A copied span's node is valued by its
calibrated acceptance, one both a copy and the head propose by `agreed`, and a parent's children with copies among
them are scaled to sum to at most 1 (`exclusive_scales`).
"""

from __future__ import annotations

import torch

from ..verify import DraftTree


def tree_from_selection(tokens, parents, probs, values, order, copy_info=None) -> DraftTree:
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


def exclusive_scales(copy_parents, copy_probs, merged_parents, merged_head_probs) -> tuple[dict, dict]:
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

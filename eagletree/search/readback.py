"""The top-k read-back: each drafting level's distributions checked, ranked and read back to the host at once.

The batched searches keep their node tables as host lists; the distributions stay on the drafter's device and
only their top-k children come back, once per level for the whole batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import InvalidValue
from .checks import check_distribution


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
    top-k ranks a NaN first, so their check is on the values read back instead of two passes over [F, V].

    A request whose rows are one row broadcast (stride 0 along its rows: a block head's level, the same
    distribution after every node) is checked and ranked once, its lists repeated on the host."""
    where = f"drafter output at level {level}"
    counts = [p.shape[0] for p in probs]
    shared = [n > 1 and p.stride(0) == 0 for p, n in zip(probs, counts)]
    rows = [p[:1] if one else p for p, one in zip(probs, shared)]
    table = rows[0] if len(rows) == 1 else torch.cat(rows)
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
        raise InvalidValue(f"{where} contains NaN")
    out, start = [], 0
    for n, one in zip(counts, shared):
        m = 1 if one else n
        qs, ts = q[start : start + m], tok[start : start + m]
        out.append(TopK(qs * n, ts * n) if one else TopK(qs, ts))  # (the lists are only read)
        start += m
    return out

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
        raise InvalidValue(f"{where} contains NaN")
    out, start = [], 0
    for n in counts:
        out.append(TopK(q[start : start + n], tok[start : start + n]))
        start += n
    return out

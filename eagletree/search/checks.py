"""The checks every tree search makes: of its arguments, and of each distribution its drafter returns."""

from __future__ import annotations

import torch

from ..errors import InvalidValue

PROB_TOLERANCE = 1e-3


def check_search_args(budget, depth, top_k) -> None:
    """Raise ValueError unless budget, depth and top_k are integers >= 1."""
    for name, value in (("budget", budget), ("depth", depth), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidValue(f"{name} must be an integer >= 1, got {value!r}")


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
        raise InvalidValue(f"{where} contains NaN")
    if low < 0:
        raise InvalidValue(f"{where} has a negative probability {low}")
    if worst > PROB_TOLERANCE:
        bad = float(sums.flatten()[(sums.flatten() - 1).abs().argmax()])
        raise InvalidValue(f"{where} sums to {bad:.6f}; expected 1 (tolerance {PROB_TOLERANCE})")
    return probs

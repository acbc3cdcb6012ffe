"""Draft vocabulary: the V' most frequent target tokens; drafting then costs V'/V of a full lm_head.

Tokens outside it are never drafted; verification stays lossless because the target decides.
d2t[i] = target id of draft id i; t2d = boolean mask over the target vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import InvalidValue


def check_draft_vocab(d2t: torch.Tensor, target_vocab: int) -> None:
    if d2t.dim() != 1 or d2t.numel() == 0:
        raise InvalidValue(
            f"draft vocabulary must be a non-empty 1-D tensor of target ids, got shape {tuple(d2t.shape)}"
        )
    if int(d2t.min()) < 0 or int(d2t.max()) >= target_vocab:
        raise InvalidValue(
            f"draft vocabulary ids must lie in [0, {target_vocab}), got [{int(d2t.min())}, {int(d2t.max())}]"
        )
    if torch.unique(d2t).numel() != d2t.numel():
        raise InvalidValue("draft vocabulary repeats a target id; each target token may appear once")


def build_draft_vocab(token_streams: Iterable[Iterable[int]], size: int, target_vocab: int, always=()) -> torch.Tensor:
    """The `size` most frequent target ids in the streams (plus `always`, e.g. EOS), sorted ascending."""
    return draft_vocab_from_counts(token_counts(token_streams, target_vocab), size, target_vocab, always)


def token_counts(token_streams: Iterable[Iterable[int]], target_vocab: int) -> torch.Tensor:
    """[target_vocab] int64: how often each target id occurs in the streams (summed over processes, they make one
    count)."""
    counts = torch.zeros(target_vocab, dtype=torch.long)
    for stream in token_streams:
        ids = torch.as_tensor(list(stream), dtype=torch.long)
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < target_vocab:
            raise InvalidValue(f"token id {int(ids.max())} is outside the target vocabulary [0, {target_vocab})")
        counts += torch.bincount(ids, minlength=target_vocab)
    return counts


def draft_vocab_from_counts(counts: torch.Tensor, size: int, target_vocab: int, always=()) -> torch.Tensor:
    """The `size` most frequent ids of `counts` [target_vocab] (ties: lower id first; too little data: the lowest
    unused ids), `always` among them, sorted ascending."""
    if not 0 < size <= target_vocab:
        raise InvalidValue(f"draft vocabulary size must be in [1, {target_vocab}], got {size}")
    chosen = dict.fromkeys(int(t) for t in always)
    how_often = counts.tolist()
    ranked = sorted((t for t, n in enumerate(how_often) if n > 0), key=lambda t: (-how_often[t], t))
    for token in [*ranked, *range(target_vocab)]:
        if len(chosen) >= size:
            break
        chosen.setdefault(token)
    chosen = list(chosen)[:size]
    d2t = torch.tensor(sorted(chosen), dtype=torch.long)
    check_draft_vocab(d2t, target_vocab)
    return d2t


def t2d_mask(d2t: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[target_vocab] bool: which target tokens the head can draft."""
    mask = torch.zeros(target_vocab, dtype=torch.bool)
    mask[d2t] = True
    return mask


def target_to_draft(d2t: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """[target_vocab] long: draft id of each target id, -1 where it is not in the draft vocabulary."""
    out = torch.full((target_vocab,), -1, dtype=torch.long)
    out[d2t] = torch.arange(d2t.numel())
    return out

"""A bench row: the timed runs it is made of, their running totals, and the check that a greedy run emitted plain
decoding's tokens."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..decode import encode_prompt
from .inputs import Method


@dataclass
class Run:
    """One timed decoding of one prompt."""

    token_ids: list[int]
    seconds: float  # from the prompt's tokens to the last token, prefill included
    first_seconds: float  # until the first pass (the prefill, for plain decoding) has emitted its tokens
    accepted_lengths: list[int]  # tokens emitted per target pass, the first included
    predicted: list[float] = field(default_factory=list)
    steps: list | None = None  # (DraftTree, accepted) per pass, when recorded
    batch: bool = False  # a batch of prompts decoded together: tokens and passes of all its sequences

    @property
    def passes(self) -> int:
        return len(self.accepted_lengths)

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first pass (sampled outputs differ in length, so the prefill's share does);
        a batch's: its throughput, every sequence's tokens over the batch's seconds, prefill included."""
        if self.batch:
            return len(self.token_ids) / self.seconds if self.seconds > 0 else float("nan")
        rest = len(self.token_ids) - (self.accepted_lengths[0] if self.accepted_lengths else 0)
        return rest / (self.seconds - self.first_seconds) if rest > 0 else float("nan")


def first_difference(got: list[int], want: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), or None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def logit_gap(model, tok, messages, want: list[int], got: list[int], k: int) -> float | None:
    """At the first difference k: a plain forward's logit of plain decoding's token minus the other output's."""
    if k >= min(len(want), len(got)):
        return None  # one output stopped earlier
    ids = encode_prompt(tok, messages).tolist() + want[:k]
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
    return float(logits[want[k]] - logits[got[k]])


def empty_row() -> dict:
    """The running totals of one (method, temperature) row, filled by `add_run`."""
    return dict(
        rate=[],
        e2e=[],
        first=[],
        ratio=[],
        same=[],
        new=0,
        passes=0,
        predicted=[],
        lengths=Counter(),
        mismatches=[],
    )


def add_run(row: dict, m: Method, run: Run, ref: Run, same: Run | None) -> None:
    """Add one run to its row; `ref` is plain decoding with stock kernels, `same` with the target's own."""
    row["rate"].append(run.decode_rate)
    row["ratio"].append(run.decode_rate / ref.decode_rate)  # NaN (dropped) where either has one pass
    if m.name != "plain":  # like for like: against plain decoding with the same kernels
        row["same"].append(run.decode_rate / (same or ref).decode_rate)
    row["e2e"].append(len(run.token_ids) / run.seconds)
    row["first"].append(run.first_seconds)
    row["new"] += len(run.token_ids)
    row["passes"] += run.passes
    row["predicted"] += run.predicted
    row["lengths"].update(run.accepted_lengths)


def check_same_tokens(row: dict, model, tok, messages, i: int, m: Method, run: Run, ref: Run, log) -> None:
    """Record in the row, and log, where a greedy run's tokens first differ from plain decoding's (prompt `i`)."""
    if (k := first_difference(run.token_ids, ref.token_ids)) is None:
        return
    gap = logit_gap(model, tok, messages, ref.token_ids, run.token_ids, k)
    row["mismatches"].append(
        {
            "prompt": i,
            "position": k,
            "got": run.token_ids[k : k + 8],
            "plain": ref.token_ids[k : k + 8],
            "logit_gap": gap,
        }
    )
    log(
        f"MISMATCH {m.label} on prompt {i}: first difference at token {k}: "
        f"{run.token_ids[k : k + 8]} vs plain {ref.token_ids[k : k + 8]}"
        + ("" if gap is None else f" (logit gap {gap:.4f} in a plain forward; near 0: a near-tie)")
    )

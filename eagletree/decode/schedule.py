"""Batch policy: which prompts join the batch (in order, as places free up: continuous batching) and which
live sequences the head drafts for in a pass."""

from __future__ import annotations

import statistics

from ..errors import InvalidValue
from ..search.searchers import AutoSearcher


class PromptQueue:
    """The prompts waiting for a place in the batch, in order: (key, ids, stats) jobs taken as places free up."""

    def __init__(self, jobs):
        self._jobs = iter(jobs)
        self._ahead = next(self._jobs, None)  # the next job, if any

    @property
    def waiting(self) -> bool:
        """Whether a prompt waits for a place: while one does, every sequence may draft (`worth_drafting`)."""
        return self._ahead is not None

    def take(self, places: int) -> list[tuple]:
        """The next jobs, at most `places` of them, in order."""
        taken = []
        while self._ahead is not None and len(taken) < places:
            taken.append(self._ahead)
            self._ahead = next(self._jobs, None)
        return taken


def worth_drafting(live, reach: list[int], searcher, waiting: bool) -> list[bool]:
    """Which live sequences may draft this pass (`reach`: the nodes each one's tree may have): all of them, but
    with tree "auto", several sequences and no prompt `waiting` for a place, those that would end the batch last."""
    if not waiting and len(live) > 1 and isinstance(searcher, AutoSearcher):
        return late_sequences(reach, [seq.tree_rate for seq in live])
    return [True] * len(live)


def drafting_sequences(live, depths: list[int], late: list[bool], has_drafter: bool, searcher):
    """([whether the head drafts for each live sequence], whether it drafts this pass): for those that may
    (`late`), may draft a level (`depths`) and have committed tokens it has not read, when the searcher drafts
    this step (tree "auto" pauses drafting where trees do not pay)."""
    could = [d >= 1 and bool(s.pending) and has_drafter and k for s, d, k in zip(live, depths, late)]
    drafting = any(could) and searcher.drafts(len(live))
    return [c and drafting for c in could], drafting


def late_sequences(lefts: list[int], rates: list[float]) -> list[bool]:
    """Which sequences of a batch that no prompt waits to join are worth drafting for: those that would finish
    after the batch's estimated end (the most passes any sequence needs drafting) if they decoded plainly.

    Once nothing waits for a place, the batch takes as long as its longest-running answer: a sequence that
    finishes early leaves its place empty. A pass costs a fixed part (reading the weights) plus a part per row,
    and a tree adds rows for fewer extra tokens than rows (at most one accepted token a node), so drafted nodes
    pay only where they cut the number of passes the batch still needs. The batch's end is estimated as the most
    passes any sequence needs drafting (`lefts[i] / rates[i]`: tokens left over its tokens per drafted pass);
    a sequence with at most that many tokens left finishes by then even one token a pass, so it decodes plainly
    (its rows leave the passes cheaper), and the others draft, which brings their ends together."""
    if len(lefts) != len(rates) or min(rates, default=1.0) <= 0:
        raise InvalidValue(f"need one positive rate per sequence, got lefts {lefts} and rates {rates}")
    end = max((left / rate for left, rate in zip(lefts, rates)), default=0.0)
    return [left > end for left in lefts]


def end_progress(emitted: list[int], late: list[bool]) -> float:
    """What a pass did for a batch's end, in tokens of a plain pass's worth (one a sequence): the late sequences'
    mean tokens, once per sequence of the pass, when some decoded plainly (`late_sequences`); else the tokens."""
    if any(late) and not all(late):
        return statistics.mean(n for n, k in zip(emitted, late) if k) * len(emitted)
    return float(sum(emitted))

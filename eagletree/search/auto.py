"""tree="auto": the cost-aware searcher, with its drafting pauses and running gains per batch size class."""

from __future__ import annotations

import math
import time
from copy import deepcopy
from dataclasses import replace

import torch

from ..verify import DraftTree
from .batched import SearchSpec, drive_batch, search_steps
from .copy import copy_only
from .cost import LatencyProfile, choose_batch
from .kinds import Searcher


class AutoSearcher(Searcher):
    """tree="auto": the cost-aware tree per step, and no drafting at all while trees do not pay.

    After drafting, the optimal tree's prefix with the most expected tokens per second is kept
    (latency profile of the device, drafting time measured so far, calibrated acceptance). When
    the running estimate of that gain (from break-even, a quarter of the way to each step's; the first
    step decides nothing) says trees are slower than a plain one-token pass, the next steps skip drafting
    (4, then 8, ... up to 64 steps; x4 while a tree would lose more than 10%; each pause halves the
    estimate's distance from break-even) before probing again, so on a device where
    trees do not pay `auto` decodes at about plain speed; where the profile says no tree of any size could
    pay even if every drafted token were accepted (t(N) >= N t(1)), it never drafts. The search width
    follows the budgets chosen lately, and drafting stops early once a deeper level could not pay for itself.
    In a batch each size class (1, 2, 3-4, 5-8, ...) keeps its own running gain and pause (`pauses`): trees that
    lose at 8 sequences a pass may pay for a batch's last few answers.
    The profile's verify times are rescaled by what the passes of this generation actually took (`observe`),
    so drafting (timed live) and verifying are weighed under the same load: on a machine busier than when the
    profile was measured, both are slower, not only drafting. Likewise the trees' values are rescaled by how many
    drafted tokens the passes of this generation accepted against how many their values predicted (`value_scale`):
    calibrated on other text, the values run low or high by a roughly constant factor on the text at hand.
    `clock` times the drafter's calls and the search's own work between them (a stand-in clock makes a
    synthetic machine in tests); both are charged per drafted level.
    """

    LOAD_SMOOTHING = 0.2  # weight of each new pass in the running verify-time ratio
    # The running gain starts at break-even (1) and each drafted step moves it a quarter of the way to that step's
    # estimate: one step's tree says little (its estimate swings widely from step to step, and a rule on the mean of
    # the last two paused drafting through most of answers that trees sped up: docs/results.md).
    GAIN_SMOOTHING = 0.25
    PAUSE_MEMORY = 0.5  # the share of the running gain's distance from 1 left after a pause: the text has moved on
    VALUE_PRIOR = 8.0  # drafted tokens the prior value scale of 1 is worth
    # In a batch, once plain steps of that many sequences have been timed, each drafted step's gain is its measured
    # tokens/s over theirs (everything a step costs, as decoding paid it), not the profile's estimate; a plain step
    # is taken as the reference after the first few drafted steps and then every PLAIN_PROBE drafted steps.
    FIRST_PROBE, PLAIN_PROBE = 4, 32
    # In a batch, a drafted step after a pause (a probe) costs more than its own tree: it first catches the head up
    # on every sequence's committed tokens. A probe measured at less than HOPELESS times the plain rate pauses at
    # once for the longest pause, which is long enough that the probes' measured cost (in plain steps) is at most
    # PROBE_SHARE of the steps paused (never shorter than max_wait, at most MAX_PAUSE): at 8 sequences a pass on 2
    # CPU cores a probe ran at about half the plain rate and cost about 2.5 plain steps, and 8 of them cost 1-3% of a
    # run of 32 answers (docs/results.md).
    HOPELESS, PROBE_SHARE, MAX_PAUSE = 0.6, 0.01, 1024
    # A pass whose verify took STALL times what the profile (scaled by the running load) expects for its rows was
    # stalled (another tenant of the machine, the page faults of a shape not run before): its step says nothing about
    # trees, so it moves neither a batch's running gain nor its plain steps' scale. At 2 a pass on 2 CPU cores one
    # such step (a 41 ms verify where 22 were due) paused the head for 197 steps (docs/results.md).
    STALL, MAX_STALLS = 1.75, 2
    VALUE_SCALE_RANGE = (0.5, 2.0)

    def __init__(
        self,
        profile: LatencyProfile,
        calibrator=None,
        budget: int = 60,
        top_k: int = 10,
        device="cpu",
        token_map=None,
        max_wait: int = 64,
        clock=time.perf_counter,
    ):
        super().__init__(budget, top_k, device, token_map)
        self.initial_profile, self.calibrator, self.max_wait, self.clock = profile, calibrator, max_wait, clock
        self.never = not trees_can_pay(profile, budget)
        self._pays = {}  # batch size -> whether trees can pay at it
        self.t_one = float(profile.verify(1))  # a plain one-token pass
        self.start()

    def start(self) -> None:
        # the profile's drafting cost is updated as drafting is timed: each generation starts from the given one
        self.profile = deepcopy(self.initial_profile)
        # the head's pause state per batch size class (1, 2, 3-4, 5-8, ...): trees that lose at 8 sequences a pass
        # may pay once the batch shrinks to its last few answers, so each class keeps its own running gain
        self.pauses: dict[int, _Pause] = {}
        self.pause = self._pause_for(1)  # the current step's
        self.search_budget = self.budget
        self.draft_s, self.search_s, self.levels = 0.0, 0.0, 0  # so far: drafter and search seconds, levels
        self.catch_up_s = (
            self.initial_profile.draft_s_per_step or None
        )  # a drafted step's own head calls, running mean (`observe_catch_up`); None: untimed
        self.load = None  # measured verify time / the profile's, running (log-space) mean; None: no pass yet
        self.predicted = self.accepted = 0.0  # drafted tokens the verified trees' values predicted, and accepted
        self._pending = None  # the last tree's predicted drafted tokens, until its pass is observed
        self.copy_s = None  # running mean seconds of a step's copy lookups (None: none timed yet)
        self.copy_skip = self.copy_wait = 0  # passes left without copy lookups; the length of the last such pause
        # batches: measured plain step seconds / the profile's pass of that batch, running (None: none timed yet),
        # so a plain step of one batch size is the reference for the others too (a batch shrinks as answers end)
        self.plain_scale: float | None = None
        self.since_plain = 0  # drafted batch steps since the last plain one
        self.probing = False  # this step is a plain reference step (no drafting, no copied spans)
        self.stalled = False  # the last pass's verify took STALL times its expected time
        self.stalls = 0  # passes in a row that took that long (more than MAX_STALLS: the load, not a stall)

    def batch_end(self) -> None:
        """The last prompt has joined the batch: from now on only the answers that end it draft, and a step is
        measured by how far they move (`decode.late_sequences`), so the pauses that drafting for the whole batch
        earned no longer hold."""
        self.pauses.clear()
        self.pause = self._pause_for(1)

    @property
    def measured(self) -> LatencyProfile:
        """The profile with its verify times scaled by `load` (and the drafting cost measured so far)."""
        load = self.load or 1.0
        return replace(
            self.profile,
            verify_s=[t * load for t in self.profile.verify_s],
            batch_verify_s={b: [t * load for t in ts] for b, ts in self.profile.batch_verify_s.items()},
        )

    @property
    def value_scale(self) -> float:
        """Accepted / predicted drafted tokens so far, shrunk toward 1 by VALUE_PRIOR tokens."""
        low, high = self.VALUE_SCALE_RANGE
        scale = (self.accepted + self.VALUE_PRIOR) / (self.predicted + self.VALUE_PRIOR)
        return min(max(scale, low), high)

    def _scaled(self, values: torch.Tensor) -> torch.Tensor:
        return (values * self.value_scale).clamp(max=1.0)

    def observe(self, nodes, seconds, accepted=None, batch=1, copy_s=0.0):
        if copy_s > 0:
            self.copy_s = copy_s if self.copy_s is None else self.copy_s + self.LOAD_SMOOTHING * (copy_s - self.copy_s)
        if self.copy_skip > 0:
            self.copy_skip -= 1
        if self._pending is not None and accepted is not None:
            self.predicted += self._pending
            self.accepted += accepted
        self._pending = None
        expected = float(self.profile.batch_time(batch, nodes))
        self.stalled = False
        if not (seconds > 0 and expected > 0):
            return
        slow = self.load is not None and seconds > self.STALL * self.load * expected
        self.stalls = self.stalls + 1 if slow else 0
        self.stalled = slow and self.stalls <= self.MAX_STALLS
        ratio = min(max(seconds / expected, 0.25), 4.0)  # one pass (a GC pause, a page fault) moves it little
        self.load = ratio if self.load is None else self.load * (ratio / self.load) ** self.LOAD_SMOOTHING

    def drafts(self, batch: int = 1) -> bool:
        due = self.PLAIN_PROBE if self.plain_scale is not None else self.FIRST_PROBE
        if batch > 1 and self.since_plain >= due:
            self.probing = True  # a plain step: the reference the searched ones are measured against
            return False
        if self.never or not self._can_pay(batch):
            return False
        self.pause = self._pause_for(batch)
        if self.pause.skip > 0:
            self.pause.skip -= 1
            return False
        return True

    def _pause_for(self, batch: int) -> _Pause:
        """The pause state of `batch`'s size class: 1, 2, 3-4, 5-8, 9-16, ..."""
        return self.pauses.setdefault((batch - 1).bit_length(), _Pause())

    def plain_rate(self, batch: int) -> float | None:
        """Tokens/s of a plain step of `batch` sequences, from the plain steps timed so far (None: none yet)."""
        if self.plain_scale is None:
            return None
        return batch / (self.plain_scale * float(self.profile.batch_time(batch, batch)))

    def observe_step(self, batch, tokens, seconds, searched, drafted):
        """In a batch: a plain step updates the plain steps' scale. Once a plain step was timed, a drafted step moves
        the running gain by its measured tokens/s over the plain rate at its batch size (and may pause drafting, as
        `_update_gain` does), and a step of copied spans alone that was slower than a plain one pauses them. A step
        whose pass stalled (`STALL`, at most MAX_STALLS in a row) moves neither."""
        self.probing = False
        stalled, self.stalled = self.stalled, False
        if batch < 2 or not (tokens > 0 and seconds > 0):
            return
        if stalled:
            self.since_plain += bool(searched)
            return
        if not searched:
            scale = seconds / float(self.profile.batch_time(batch, batch))
            known = self.plain_scale
            self.plain_scale = scale if known is None else known + self.LOAD_SMOOTHING * (scale - known)
            self.since_plain = 0
            return
        self.since_plain += 1
        if self.plain_scale is None:
            return
        rate = self.plain_rate(batch)
        gain = tokens / seconds / rate
        if drafted:
            self.pause = self._pause_for(batch)
            plain_step = batch / rate  # seconds of a plain step of this batch
            # what the step cost beyond plain steps emitting its tokens, in plain steps
            self.pause.probe_cost = max(seconds - tokens / rate, 0.0) / plain_step
            self._update_gain(gain, hopeless=gain < self.HOPELESS)
        else:
            self._pause_copies(gain < 1.0)

    def _can_pay(self, batch: int) -> bool:
        if batch not in self._pays:
            self._pays[batch] = trees_can_pay(self.initial_profile, self.budget, batch)
        return self._pays[batch]

    def takes_copies(self) -> bool:
        # where no tree can pay, none is built; nor while copied spans alone have lately not paid in a batch
        return super().takes_copies() and not self.never and self.copy_skip == 0 and not self.probing

    def search_batch(self, expand_batch, jobs, rows=None):
        """A job without drafting (the head paused or absent) takes its copied spans alone, pruned by the same
        rule; a step where no job drafts does not change the head's pause. A batch's nodes go where they are
        worth most (`choose_batch`: one pass of that many rows against a plain pass of one row per sequence, the
        `rows` - len(jobs) sequences without a job taking one row each)."""
        batch = max(rows or len(jobs), len(jobs))  # the pass's sequences
        others = batch - len(jobs)  # those decoding plainly
        measured = self.measured
        t_plain = float(measured.batch_time(batch, batch))  # a plain pass: one token per sequence
        # tokens a drafting level must add per sequence to pay for itself
        min_gain = (self.profile.draft_s_per_level + self.profile.search_s_per_level) / t_plain
        fulls, spent, searched = self._search_full(expand_batch, jobs, min_gain)
        values = [f.values[1:] if self.calibrator is None else calibrated_values(f, self.calibrator) for f in fulls]
        scaled = [self._scaled(v) for v in values]
        copied = any(j.copies is not None for j in jobs)
        fixed = (self.copy_s or 0.0) if copied and batch > 1 else 0.0  # (at batch 1 a lookup is a small share)
        if not any(j.drafts for j in jobs):
            counts = choose_batch(scaled, measured, 0, fixed=fixed, others=others)[0]
            if batch == 1 or self.plain_scale is None:  # (else the step's measured gain decides: observe_step)
                self._pause_copies(batch > 1 and max(counts) == 1)
            return self._chosen(fulls, values, counts)
        self._charge_drafting(spent, searched)
        # (`measured` again: it now holds the drafting cost just timed)
        if self.times_step_calls and self.catch_up_s is not None:  # its one call a step, as timed
            calls, fixed = spent[1], fixed + self.catch_up_s
        else:  # its step's calls, each at a level's cost
            calls = spent[1] + self.step_calls
        counts, expected, rate = choose_batch(scaled, self.measured, calls, fixed=fixed, others=others)
        if batch == 1 or self.plain_scale is None:  # (else the step's measured gain moves it: observe_step)
            self._update_gain(rate * t_plain / batch)
        self.search_budget = min(self.budget, max(8, 2 * max(counts)))
        return self._chosen(fulls, values, counts)

    def _search_full(self, expand_batch, jobs, min_gain: float) -> tuple[list[DraftTree], list, float]:
        """Every job's tree of up to search_budget nodes, timed: (the trees, [the drafter's seconds, its batched
        calls], the seconds of the whole search: the drafter's calls and the search's own work between them)."""
        spent = [0.0, 0]

        def timed(requests):
            t = self.clock()
            probs = expand_batch(requests)
            spent[0] += self.clock() - t
            spent[1] += 1
            return probs

        start = self.clock()
        budget = self.search_budget
        searches = [
            search_steps(
                j.drafts,
                j.root,
                SearchSpec(budget, j.depth, self.top_k, budget - 1, self.device, self.token_map, min_gain),
                j.copies,
            )
            for j in jobs
        ]
        fulls = drive_batch(searches, timed, self.top_k, self.token_map)
        return fulls, spent, self.clock() - start

    def observe_catch_up(self, seconds: float) -> None:
        if self.times_step_calls:
            known = self.catch_up_s
            self.catch_up_s = seconds if known is None else known + self.LOAD_SMOOTHING * (seconds - known)

    def _charge_drafting(self, spent: list, searched: float) -> None:
        """Add a drafted step's drafter and search seconds to the profile's per-level drafting cost.

        Per-level cost from the tree's levels only: the head's other calls of a step (`step_calls`: its catch-up
        on the committed tokens) cost about one more level each in steady state (the prompt's first one is paid
        once anyway).
        The search's own work between the calls (top-k, ranking, copy lookups) is charged per level too:
        it is paid before the verify pass as well, and on a CPU it is not small next to the head's calls."""
        self.draft_s += spent[0]
        self.search_s += searched - spent[0]
        self.levels += spent[1]
        self.profile.draft_s_per_level = self.draft_s / max(self.levels, 1)
        self.profile.search_s_per_level = self.search_s / max(self.levels, 1)

    def observe_lookups(self, batch, found):
        # In a batch the lookups cost a share of a step (8 sequences: about 5% of a pass on 2 CPU cores); where none
        # of them found a span they pause as where copied spans chose no node (a sequence alone keeps looking).
        if batch > 1 and not found:
            self._pause_copies(True)

    def _pause_copies(self, idle: bool) -> None:
        """A batch's copied spans alone chose no node: skip looking them up for a while (4 passes, then twice as
        long each time, up to max_wait), as the head's drafting pauses."""
        if idle:
            self.copy_wait = min(2 * self.copy_wait or 4, self.max_wait)
            self.copy_skip = self.copy_wait
        else:
            self.copy_wait = 0

    def _update_gain(self, gain: float, hopeless: bool = False) -> None:
        """One step's estimated speed-up over plain passes moves the running gain; pause drafting if it is < 1
        (`hopeless`: a batch's measured step far below plain, for the longest pause at once).

        One step's estimate is noisy: pause only when the recent ones say trees lose to plain passes. The first
        tree of a generation decides nothing: its first token, the answer's first, is the least predictable (it
        was the answer's lowest estimate on every prompt measured: docs/results.md), and its drafting cost is the
        first measured."""
        p = self.pause  # (the current step's batch size class)
        if p.wait:  # the first tree after a pause
            p.gain = 1.0 - (1.0 - p.gain) * self.PAUSE_MEMORY
        p.gain += self.GAIN_SMOOTHING * (gain - p.gain)
        p.searched += 1
        if p.searched > 1 and p.gain < 1.0:
            longest = max(self.max_wait, min(math.ceil(p.probe_cost / self.PROBE_SHARE), self.MAX_PAUSE))
            p.wait = longest if hopeless else min((4 if p.gain < 0.9 else 2) * p.wait or 4, longest)
            p.skip = p.wait
        else:
            p.wait = 0

    def _chosen(self, fulls: list[DraftTree], values: list[torch.Tensor], counts: list[int]) -> list[DraftTree]:
        """Each tree's prefix of the chosen size; the drafted tokens their (unscaled) values predict are kept for
        `observe`."""
        self._pending = sum(float(v[: n - 1].double().sum()) for v, n in zip(values, counts))
        return [f.prefix(n) for f, n in zip(fulls, counts)]


class _Pause:
    """`AutoSearcher`'s drafting pause for one batch size class."""

    def __init__(self):
        self.gain = 1.0  # running estimate of a tree step's tokens/s over a plain pass's
        self.skip = self.wait = 0  # steps left without drafting; the length of the last pause
        self.searched = 0  # drafted steps so far
        self.probe_cost = 0.0  # in a batch: the last drafted step's cost beyond a plain step's, in plain steps


def trees_can_pay(profile: LatencyProfile, budget: int, batch: int = 1) -> bool:
    """Whether some tree of 2..budget nodes per sequence could beat a plain pass (one token per sequence) on
    this profile at all: at best every drafted token is accepted (N tokens for N nodes), so trees cannot pay
    where t(B N) >= N t(B)."""
    n = torch.arange(2, max(budget, 2) + 1, dtype=torch.float64)
    return bool((n * profile.batch_time(batch, batch) > profile.batch_time(batch, batch * n) * (1 + 1e-9)).any())


def calibrated_values(tree: DraftTree, calibrator) -> torch.Tensor:
    """Path values [N - 1] (float64, the root left out) with the head's draft probabilities calibrated; copied
    nodes' are calibrated already. Host lists: a step's tree has tens of nodes, and the products along parents
    (which precede their children) cost less than the small tensor operations of an ancestor-matrix product."""
    a = calibrator(tree.draft_probs).clamp(1e-30, 1.0).tolist()
    if tree.copy_info is not None:  # a copy the head proposed too is valued like the head's own candidates
        raw = tree.draft_probs.tolist()
        a = [raw[v] if copy_only(info) else a[v] for v, info in enumerate(tree.copy_info)]
    return torch.tensor(tree.products_along(a)[1:], dtype=torch.float64)

"""Tree kinds as searchers: built once per Decoder, started per generation, asked once per step for the tree.

`make_searcher(kind, ...)` returns one of these; the decoding loop calls only `start()`, `drafts()`,
`takes_copies()`, `search(expand, root, depth, copies)` and `observe(...)`, so a new kind is a new class:

- `Eagle2Searcher`: EAGLE-2's dynamic tree (the `budget` nodes of highest path value found by a
  beam of `top_k` per level).
- `OptimalSearcher`: the exact best `budget` nodes under the same drafter.
- `StaticSearcher`: a fixed shape (chain, Sequoia's, or given rank paths), cut to the step's depth.
- `AutoSearcher`: the cost-aware tree: the optimal tree's prefix with the most expected tokens
  per second on this device, and no drafting at all while trees do not pay.

`expand(nodes, tokens, parents, level) -> probs` is the drafter (see draft_heads.Drafter), or None
when the head does not draft this step; `copies` is a CopyTrie of copied spans, or None.
"""

from __future__ import annotations

import time
from copy import deepcopy
from dataclasses import replace

import torch

from ..verify import DraftTree
from .copy import copy_only
from .cost import LatencyProfile, choose_budget
from .dynamic import eagle2_search, optimal_search
from .static import Shape, breadth_first, chain_shape, choices_shape, sequoia_tree, static_search

# Per-rank acceptance for the Sequoia shape until a measured one is passed (the shape, not the output, depends on it).
DEFAULT_ACCEPT_BY_RANK = (0.55, 0.12, 0.05, 0.03, 0.02, 0.01)


class Searcher:
    """A tree kind. `budget`: most nodes per tree (root included); `top_k`: candidates per drafted node."""

    static = False  # a fixed shape: copied spans cannot be grafted into it

    def __init__(self, budget: int, top_k: int, device="cpu", token_map=None):
        self.budget, self.top_k, self.device, self.token_map = budget, top_k, device, token_map

    def start(self) -> None:
        """A new generation begins: forget what the last one taught (the searchers that learn as they go)."""

    def drafts(self) -> bool:
        """Whether the head drafts this step (asked once per step, only when it could)."""
        return True

    def takes_copies(self) -> bool:
        """Whether copied spans are worth building this generation (a one-node budget has no room for them)."""
        return not self.static and self.budget > 1

    def search(self, expand, root: int, depth: int, copies=None) -> DraftTree:
        raise NotImplementedError

    def observe(self, nodes: int, seconds: float, accepted: int | None = None) -> None:
        """Told after each target pass: it verified `nodes` nodes (root included) in `seconds` (verify, accept,
        commit), and `accepted` of its drafted nodes were accepted (None: not told)."""

    def _options(self, copies) -> dict:
        return dict(device=self.device, token_map=self.token_map, copies=copies)


class Eagle2Searcher(Searcher):
    def search(self, expand, root, depth, copies=None):
        return eagle2_search(expand, root, self.budget, depth, self.top_k, **self._options(copies))


class OptimalSearcher(Searcher):
    def search(self, expand, root, depth, copies=None):
        return optimal_search(expand, root, self.budget, depth, self.top_k, **self._options(copies))


class StaticSearcher(Searcher):
    """A fixed shape; near the end of a generation the nodes deeper than the step's depth are cut."""

    static = True

    def __init__(self, shape: Shape, device="cpu", token_map=None):
        super().__init__(len(shape.parents), 1, device, token_map)
        self.shape = breadth_first(shape)  # cut by depth as a prefix

    def search(self, expand, root, depth, copies=None):
        if copies is not None:
            raise ValueError("a static shape takes no copied spans")
        tree = static_search(expand, root, self.shape, device=self.device, token_map=self.token_map)
        return tree.prefix(int((tree.depths <= depth).sum())) if tree.depth > depth else tree


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
        self.t_one = float(profile.verify(1))  # a plain one-token pass
        self.start()

    def start(self) -> None:
        # the profile's drafting cost is updated as drafting is timed: each generation starts from the given one
        self.profile = deepcopy(self.initial_profile)
        self.skip = self.wait = 0  # steps left without drafting; the length of the last pause
        self.search_budget = self.budget
        self.draft_s, self.search_s, self.levels = 0.0, 0.0, 0  # so far: drafter and search seconds, levels
        self.gain = 1.0  # running estimate of a tree step's tokens/s over a plain pass's
        self.searched = 0  # drafted steps so far
        self.load = None  # measured verify time / the profile's, running (log-space) mean; None: no pass yet
        self.predicted = self.accepted = 0.0  # drafted tokens the verified trees' values predicted, and accepted
        self._pending = None  # the last tree's predicted drafted tokens, until its pass is observed

    @property
    def measured(self) -> LatencyProfile:
        """The profile with its verify times scaled by `load` (and the drafting cost measured so far)."""
        return replace(self.profile, verify_s=[t * (self.load or 1.0) for t in self.profile.verify_s])

    @property
    def value_scale(self) -> float:
        """Accepted / predicted drafted tokens so far, shrunk toward 1 by VALUE_PRIOR tokens."""
        low, high = self.VALUE_SCALE_RANGE
        scale = (self.accepted + self.VALUE_PRIOR) / (self.predicted + self.VALUE_PRIOR)
        return min(max(scale, low), high)

    def _scaled(self, values: torch.Tensor) -> torch.Tensor:
        return (values * self.value_scale).clamp(max=1.0)

    def observe(self, nodes, seconds, accepted=None):
        if self._pending is not None and accepted is not None:
            self.predicted += self._pending
            self.accepted += accepted
        self._pending = None
        expected = float(self.profile.verify(nodes))
        if not (seconds > 0 and expected > 0):
            return
        ratio = min(max(seconds / expected, 0.25), 4.0)  # one pass (a GC pause, a page fault) moves it little
        self.load = ratio if self.load is None else self.load * (ratio / self.load) ** self.LOAD_SMOOTHING

    def drafts(self) -> bool:
        if self.never:
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def takes_copies(self) -> bool:
        return super().takes_copies() and not self.never  # where no tree can pay, none is built

    def search(self, expand, root, depth, copies=None):
        """expand=None (the head is paused or absent): the copied spans alone, pruned by the same rule;
        such a step does not change the head's pause."""
        spent = [0.0, 0]  # this tree's drafter seconds and calls

        def timed(nodes, tokens, parents, level):
            t = self.clock()
            probs = expand(nodes, tokens, parents, level)
            spent[0] += self.clock() - t
            spent[1] += 1
            return probs

        t_one = self.t_one * (self.load or 1.0)
        # tokens a drafting level must add to pay for itself
        min_gain = (self.profile.draft_s_per_level + self.profile.search_s_per_level) / t_one
        start = self.clock()
        full = optimal_search(
            timed if expand is not None else None,
            root,
            self.search_budget,
            depth,
            self.top_k,
            min_gain=min_gain,
            **self._options(copies),
        )
        searched = self.clock() - start  # the drafter's calls and the search's own work between them
        values = full.values[1:] if self.calibrator is None else calibrated_values(full, self.calibrator)
        if expand is None:
            return self._chosen(
                full, values, choose_budget(self._scaled(values), self.measured, 0, max_budget=self.search_budget)[0]
            )
        # Per-level cost from the tree's levels only: the drafter's catch-up call on the committed
        # tokens costs about one more level in steady state (the prompt's first one is paid once anyway).
        # The search's own work between the calls (top-k, ranking, copy lookups) is charged per level too:
        # it is paid before the verify pass as well, and on a CPU it is not small next to the head's calls.
        self.draft_s += spent[0]
        self.search_s += searched - spent[0]
        self.levels += spent[1]
        self.profile.draft_s_per_level = self.draft_s / max(self.levels, 1)
        self.profile.search_s_per_level = self.search_s / max(self.levels, 1)
        n, expected, rate = choose_budget(
            self._scaled(values), self.measured, spent[1] + 1, max_budget=self.search_budget
        )
        # One step's estimate is noisy: pause only when the recent ones say trees lose to plain passes. The first
        # tree of a generation decides nothing: its first token, the answer's first, is the least predictable
        # (it was the answer's lowest estimate on every prompt measured: docs/results.md), and its drafting cost is
        # the first measured.
        if self.wait:  # the first tree after a pause
            self.gain = 1.0 - (1.0 - self.gain) * self.PAUSE_MEMORY
        self.gain += self.GAIN_SMOOTHING * (rate * t_one - self.gain)
        self.searched += 1
        if self.searched > 1 and self.gain < 1.0:
            self.wait = min((4 if self.gain < 0.9 else 2) * self.wait or 4, self.max_wait)
            self.skip = self.wait
        else:
            self.wait = 0
        self.search_budget = min(self.budget, max(8, 2 * n))
        return self._chosen(full, values, n)

    def _chosen(self, full: DraftTree, values: torch.Tensor, n: int) -> DraftTree:
        """The tree's n-node prefix; the drafted tokens its (unscaled) values predict are kept for `observe`."""
        self._pending = float(values[: n - 1].double().sum())
        return full.prefix(n)


def trees_can_pay(profile: LatencyProfile, budget: int) -> bool:
    """Whether some tree of 2..budget nodes could beat a one-token pass on this profile at all: at best
    every drafted token is accepted (N tokens for N nodes), so trees cannot pay where t(N) >= N t(1)."""
    n = torch.arange(2, max(budget, 2) + 1, dtype=torch.float64)
    return bool((n * profile.verify(1) > profile.verify(n) * (1 + 1e-9)).any())


def calibrated_values(tree: DraftTree, calibrator) -> torch.Tensor:
    """Path values with the head's draft probabilities calibrated; copied nodes' are calibrated already."""
    a = calibrator(tree.draft_probs).clamp(1e-30, 1.0)
    if tree.copy_info is not None:  # a copy the head proposed too is valued like the head's own candidates
        copied = torch.tensor([copy_only(info) for info in tree.copy_info])
        a = torch.where(copied.to(a.device), tree.draft_probs.to(a.dtype), a)
    a[0] = 1.0
    return torch.exp(tree.ancestors().double() @ a.log())[1:]


def make_searcher(
    kind: str,
    budget: int = 60,
    depth: int = 6,
    top_k: int = 10,
    device="cpu",
    token_map=None,
    accept_by_rank=None,
    paths=None,
    profile: LatencyProfile | None = None,
    calibrator=None,
) -> Searcher:
    """The searcher of a tree kind (decode_config.TreeKind's values). "sequoia" takes `paths` (rank paths, e.g.
    [(0,), (1,), (0, 0)]) to draft that static shape instead of Sequoia's own; "auto" needs the device's latency
    `profile`."""
    if kind == "eagle2":
        return Eagle2Searcher(budget, top_k, device, token_map)
    if kind == "optimal":
        return OptimalSearcher(budget, top_k, device, token_map)
    if kind == "chain":  # the budget counts the root, so a chain drafts at most budget - 1 tokens
        return StaticSearcher(chain_shape(min(depth, budget - 1)), device, token_map)
    if kind == "sequoia":
        shape = (
            choices_shape(paths)
            if paths is not None
            else sequoia_tree(  # no deeper than budget - 1
                accept_by_rank or DEFAULT_ACCEPT_BY_RANK, budget, max(min(depth, budget - 1), 1)
            )
        )
        return StaticSearcher(shape, device, token_map)
    if kind == "auto":
        if profile is None:
            raise ValueError("tree='auto' needs the device's latency profile")
        return AutoSearcher(profile, calibrator, budget, top_k, device, token_map)
    raise ValueError(f"tree must be one of ('eagle2', 'optimal', 'chain', 'sequoia', 'auto'), got {kind!r}")

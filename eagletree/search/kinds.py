"""The Searcher interface, and the tree kinds that learn nothing as they go: EAGLE-2's, the optimal and the static.

`auto.AutoSearcher` is the kind that learns; `searchers.make_searcher` builds each kind by its name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidValue
from ..verify import DraftTree
from .batched import SearchSpec, SharedFloor, drive_batch, search_steps
from .static import Shape, breadth_first, static_steps


class Searcher:
    """A tree kind. `budget`: most nodes per tree (root included); `top_k`: candidates per drafted node."""

    static = False  # a fixed shape: copied spans cannot be grafted into it
    step_calls = 1  # head calls a drafted step makes besides its levels' (`set_drafting`)
    # the step's own calls are timed (`observe_catch_up`) where no level makes a call (a block drafter's levels
    # are free, so a level's cost says nothing of its one call a step)
    times_step_calls = False

    def __init__(self, budget: int, top_k: int, device="cpu", token_map=None):
        self.budget, self.top_k, self.device, self.token_map = budget, top_k, device, token_map

    def set_drafting(self, drafting) -> None:
        """The head's `Drafting`: the calls a drafted step makes besides one per level (its catch-up on the
        accepted tokens, a block drafter's call), which a searcher weighing drafting charges at a level's cost."""
        self.step_calls = drafting.catch_up + drafting.block_calls
        self.times_step_calls = drafting.level_calls == 0

    def observe_catch_up(self, seconds: float) -> None:
        """The seconds of a drafted step's own head calls (before its levels), for the searchers that weigh them."""

    def start(self) -> None:
        """A new generation begins: forget what the last one taught (the searchers that learn as they go)."""

    def drafts(self, batch: int = 1) -> bool:
        """Whether the head drafts this step for a batch of `batch` sequences (asked once per step, only when it
        could)."""
        return True

    def takes_copies(self) -> bool:
        """Whether copied spans are worth building this generation (a one-node budget has no room for them)."""
        return not self.static and self.budget > 1

    def search(self, expand, root: int, depth: int, copies=None) -> DraftTree:
        """One sequence's tree: `search_batch` of one."""
        return self.search_batch(_one(expand), [Job(expand is not None, root, depth, copies)])[0]

    def search_batch(self, expand_batch, jobs: list[Job], rows: int | None = None) -> list[DraftTree]:
        """One tree per job, the drafter asked once per level for every job's frontier: `expand_batch(requests)`
        takes [(job index, nodes, tokens, parents, level)] and returns one distribution per request. `rows`: the
        sequences the pass verifies, the jobs' and those decoding plainly (None: the jobs')."""
        raise NotImplementedError

    def observe(
        self, nodes: int, seconds: float, accepted: int | None = None, batch: int = 1, copy_s: float = 0.0
    ) -> None:
        """Told after each target pass: it verified `nodes` nodes (roots included) of `batch` sequences in
        `seconds` (verify, accept, commit), `accepted` of its drafted nodes were accepted (None: not told), and the
        step's copied spans took `copy_s` seconds to look up."""

    def observe_step(self, batch: int, tokens: float, seconds: float, searched: bool, drafted: bool) -> None:
        """Told after each step: it emitted `tokens` tokens for `batch` sequences in `seconds` in all (drafting,
        search, verify, accept, commit); `searched`: some sequence had a tree searched (drafted or copied spans);
        `drafted`: the head drafted."""

    def observe_lookups(self, batch: int, found: bool) -> None:
        """Told when copied spans were looked up for a step's `batch` sequences: whether any of them found one."""

    def _options(self, copies) -> dict:
        return dict(device=self.device, token_map=self.token_map, copies=copies)


@dataclass
class Job:
    """One sequence's search in a batch: whether the head drafts for it, its root token, depth and copied spans."""

    drafts: bool
    root: int
    depth: int
    copies: object = None


def _one(expand):
    """A one-sequence drafter as `search_batch`'s expand_batch."""
    return lambda requests: [expand(*request[1:]) for request in requests]


class _BudgetSearcher(Searcher):
    """EAGLE-2's and the optimal tree, for a batch under ONE budget of `budget` nodes per sequence: each
    sequence's search may take up to all of it, and the batch verifies the best nodes of all sequences together
    (EAGLE-2's global ranking, extended across sequences: a node is worth its path value wherever it is)."""

    global_budget = True  # False: every sequence its own `budget` nodes (the equal split, for comparison)

    def width(self, budget: int) -> int:
        raise NotImplementedError

    def search_batch(self, expand_batch, jobs, rows=None):
        batch = len(jobs)
        total = self.budget * batch
        # one sequence's most: everything but the other sequences' roots (the equal split: its own budget)
        cap = total - (batch - 1) if self.global_budget else self.budget
        shared = SharedFloor(total - batch) if batch > 1 and self.global_budget else None
        searches = [
            search_steps(
                j.drafts,
                j.root,
                SearchSpec(cap, j.depth, self.top_k, self.width(cap), self.device, self.token_map, 0.0),
                j.copies,
                shared,
            )
            for j in jobs
        ]
        trees = drive_batch(searches, expand_batch, self.top_k, self.token_map)
        if not self.global_budget:
            return trees
        return [t.prefix(n) for t, n in zip(trees, best_nodes([t.values[1:] for t in trees], total))]


class Eagle2Searcher(_BudgetSearcher):
    def width(self, budget):
        return self.top_k


class OptimalSearcher(_BudgetSearcher):
    def width(self, budget):
        return budget - 1


def best_nodes(values: list[torch.Tensor], total: int) -> list[int]:
    """Nodes per tree (roots included) when `total` nodes go to the best path values of all trees together
    (each tree's values best first; ties to the earlier tree)."""
    owner = torch.cat([torch.full((v.numel(),), i) for i, v in enumerate(values)])
    flat = torch.cat([v.double() for v in values])
    order = torch.sort(flat, descending=True, stable=True).indices[: max(total - len(values), 0)]
    order = order[torch.isfinite(flat[order])]
    return (1 + torch.bincount(owner[order].long(), minlength=len(values))).tolist()


class StaticSearcher(Searcher):
    """A fixed shape; near the end of a generation the nodes deeper than the step's depth are cut."""

    static = True

    def __init__(self, shape: Shape, device="cpu", token_map=None):
        super().__init__(len(shape.parents), 1, device, token_map)
        self.shape = breadth_first(shape)  # cut by depth as a prefix

    def search_batch(self, expand_batch, jobs, rows=None):
        if any(j.copies is not None for j in jobs):
            raise InvalidValue("a static shape takes no copied spans")
        trees = drive_batch([static_steps(j.root, self.shape, self.device, self.token_map) for j in jobs], expand_batch)
        return [t.prefix(int((t.depths <= j.depth).sum())) if t.depth > j.depth else t for t, j in zip(trees, jobs)]

"""Tree kinds as searchers: built once per Decoder, started per generation, asked once per step for the tree.

`make_searcher(kind, ...)` returns one of these; the decoding loop calls only `start()`, `drafts(batch)`,
`takes_copies()`, `search_batch(expand_batch, jobs)` (`search(expand, root, depth, copies)` for one sequence)
and `observe(...)`, so a new kind is a new class:

- `Eagle2Searcher`: EAGLE-2's dynamic tree (the `budget` nodes of highest path value found by a
  beam of `top_k` per level).
- `OptimalSearcher`: the exact best `budget` nodes under the same drafter.
- `StaticSearcher`: a fixed shape (chain, Sequoia's, or given rank paths), cut to the step's depth.
- `AutoSearcher`: the cost-aware tree: the optimal tree's prefix with the most expected tokens
  per second on this device, and no drafting at all while trees do not pay.

`expand(nodes, tokens, parents, level) -> probs` is the drafter (see draft.Drafter), or None
when the head does not draft this step; `copies` is a CopyTrie of copied spans, or None.

The interface and the first three kinds live in `kinds.py`, `AutoSearcher` in `auto.py`; this module builds a
kind by its name (and names them all, for the decoding loop, tests and benchmarks).
"""

from __future__ import annotations

from ..errors import InvalidValue
from .auto import AutoSearcher, calibrated_values, trees_can_pay
from .cost import LatencyProfile
from .kinds import Eagle2Searcher, Job, OptimalSearcher, Searcher, StaticSearcher, best_nodes
from .static import chain_shape, choices_shape, sequoia_tree

__all__ = [
    "AutoSearcher",
    "Eagle2Searcher",
    "Job",
    "OptimalSearcher",
    "Searcher",
    "StaticSearcher",
    "best_nodes",
    "calibrated_values",
    "make_searcher",
    "trees_can_pay",
]

# Per-rank acceptance for the Sequoia shape until a measured one is passed (the shape, not the output, depends on it).
DEFAULT_ACCEPT_BY_RANK = (0.55, 0.12, 0.05, 0.03, 0.02, 0.01)


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
    """The searcher of a tree kind (decode.config.TreeKind's values). "sequoia" takes `paths` (rank paths, e.g.
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
            raise InvalidValue("tree='auto' needs the device's latency profile")
        return AutoSearcher(profile, calibrator, budget, top_k, device, token_map)
    raise InvalidValue(f"tree must be one of ('eagle2', 'optimal', 'chain', 'sequoia', 'auto'), got {kind!r}")

"""Measure what a verify step costs on the running device, per tree size, side by side."""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch
from tqdm import tqdm

from ..errors import InvalidValue
from ..target import new_cache, tree_forward, truncate_cache
from .accept import accept_tree
from .engine import commit, prefill
from .tree import DraftTree

COLUMNS = ("mask", "forward", "accept", "accept_t1", "commit")


def synthetic_tree(n: int, depth: int, vocab: int, g: torch.Generator, root: int = 1) -> DraftTree:
    """A random tree shape of n nodes and depth <= depth; tokens distinct within the tree."""
    parents, depths = [-1], [0]
    for _ in range(1, n):
        while True:
            u = int(torch.randint(len(parents), (1,), generator=g))
            if depths[u] < depth:
                break
        parents.append(u)
        depths.append(depths[u] + 1)
    tokens = [root] + [(v * 7919) % vocab for v in range(1, n)]
    return DraftTree(tokens, parents)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_verify(
    model,
    sizes=(1, 4, 8, 16, 32, 64, 128),
    prefix: int = 256,
    depth: int = 6,
    reps: int = 10,
    seed: int = 0,
    progress: bool = True,
    variants: dict | None = None,
) -> dict:
    """Median seconds per component (mask, forward, greedy/T=1 acceptance, KV commit) for each N.

    All sizes are measured round-robin in one loop after one warm-up round, so machine noise
    hits them alike. `variants` ({name: a callable returning a context manager}, e.g. the stock kernels) measures
    each size under every variant in the same loop, their order alternating from round to round; the result is
    then {name: {N: medians}}.
    """
    if reps < 1:
        raise InvalidValue(f"reps must be >= 1, got {reps}")
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    cache = new_cache(model)
    prefill(model, cache, torch.randint(vocab, (prefix,), generator=g).to(device))
    trees = {n: synthetic_tree(n, min(depth, n - 1), vocab, g).to(device) for n in sizes}
    names = list(variants) if variants else [None]
    times = {(v, n): {c: [] for c in COLUMNS} for v in names for n in sizes}
    sampler = torch.Generator().manual_seed(seed + 1)
    for rep in tqdm(range(reps + 1), desc=f"verify cost ({device.type})", disable=not progress):
        for v in names if rep % 2 else names[::-1]:
            with variants[v]() if variants else nullcontext():
                for n in sizes:
                    tree = trees[n]
                    stamps = [time.perf_counter()]
                    allowed, positions = tree.attention_mask(prefix), tree.position_ids(prefix)
                    _sync(device)
                    stamps.append(time.perf_counter())
                    out = tree_forward(model, tree.tokens[None], cache, allowed, positions)
                    _sync(device)
                    stamps.append(time.perf_counter())
                    accepted, _ = accept_tree(tree, out.logits[0])
                    _sync(device)
                    stamps.append(time.perf_counter())
                    accept_tree(tree, out.logits[0], temperature=1.0, generator=sampler)
                    _sync(device)
                    stamps.append(time.perf_counter())
                    commit(cache, prefix, accepted)
                    _sync(device)
                    stamps.append(time.perf_counter())
                    truncate_cache(cache, prefix)
                    if rep:  # round 0 warms up
                        for c, a, b in zip(COLUMNS, stamps, stamps[1:]):
                            times[(v, n)][c].append(b - a)
    medians = {v: {n: {c: statistics.median(x) for c, x in times[(v, n)].items()} for n in sizes} for v in names}
    return medians if variants else medians[None]


def measure_batch_verify(model, batch: int, sizes, prefix: int = 128, depth: int = 6, reps: int = 3, seed: int = 0):
    """Median seconds of one ragged verify pass (`verify.batch.verify_rows`: forward, greedy acceptance, commit)
    of `batch` sequences with n nodes each, for each n of `sizes`; measured round-robin after a warm-up round.
    Each sequence has `prefix` cached tokens."""
    from ..target.ragged import RaggedCache, use_ragged
    from .batch import prefill_rows, verify_rows

    if reps < 1:
        raise InvalidValue(f"reps must be >= 1, got {reps}")
    use_ragged(model)
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    cache = RaggedCache()
    rows = [cache.add_row() for _ in range(batch)]
    prefill_rows(model, cache, rows, [torch.randint(vocab, (prefix + 1,), generator=g).to(device) for _ in rows])
    trees = {n: [synthetic_tree(n, min(depth, n - 1), vocab, g).to(device) for _ in rows] for n in sizes}
    times = {n: [] for n in sizes}
    for rep in range(reps + 1):
        for n in sizes:
            _sync(device)
            t = time.perf_counter()
            verify_rows(model, cache, rows, trees[n])
            _sync(device)
            if rep:  # round 0 warms up
                times[n].append(time.perf_counter() - t)
            cache.lengths = [prefix] * batch
    return [statistics.median(times[n]) for n in sizes]

"""Steps 3-5 for a batch: every sequence's tree verified in ONE target pass, then accepted and committed per
sequence.

Each tree's nodes follow its own sequence's cache row (`target.ragged`): node v of row b sees that row's
committed entries, v's root-path ancestors and v, at position length_b + depth(v), so each node gets exactly
the logits a pass over its sequence alone would give (`verify_step`'s), whatever the other rows hold.
"""

from __future__ import annotations

import time

import torch

from ..target.lean import lean_model
from ..target.ragged import RaggedCache, causal_block, ragged_forward
from .accept import accept_tree
from .engine import StepResult, emitted_tokens
from .tree import DraftTree


def prefill_rows(model, cache: RaggedCache, rows: list[int], prompts: list[torch.Tensor], layers=None):
    """Run each prompt (all but its last token, the first root) causally into its empty cache row, all in one
    pass; returns each row's features ([n, H] hidden states, and EAGLE-3's fused layers), None for a one-token
    prompt."""
    lean = lean_model(model)
    if lean is not None:
        lean.refresh()  # (its fused products are packed again if the weights changed since they were packed)
    todo = [(r, p[:-1]) for r, p in zip(rows, prompts) if p.numel() > 1]
    out: list = [None] * len(rows)
    if not todo:
        return out
    result = ragged_forward(
        model,
        cache,
        [r for r, _ in todo],
        [ids for _, ids in todo],
        [causal_block(ids.numel()) for _, ids in todo],
        [torch.arange(ids.numel()) for _, ids in todo],
        layers,
        logits=False,
        lean=lean,
    )
    hidden = result.split(result.hidden)
    layer_hidden = {k: result.split(h) for k, h in (result.layer_hidden or {}).items()}
    index = {r: i for i, (r, _) in enumerate(todo)}
    for j, r in enumerate(rows):
        if r in index:
            i = index[r]
            out[j] = (hidden[i], {k: h[i] for k, h in layer_hidden.items()} or None)
    return out


def verify_rows(
    model,
    cache: RaggedCache,
    rows: list[int],
    trees: list[DraftTree],
    temperature=0.0,
    top_k=None,
    top_p=None,
    generators=None,
    stop_ids=(),
    layers=None,
) -> list[StepResult]:
    """Verify each row's tree (root = its last emitted token, not yet cached) in one pass, accept, commit each row.

    generators: one torch.Generator (or None) per row, for sampled acceptance. The pass's seconds are every
    row's "verify"; acceptance and commit are timed per row.
    """
    starts = [cache.lengths[r] for r in rows]
    t0 = time.perf_counter()
    out = ragged_forward(
        model,
        cache,
        rows,
        [t.tokens for t in trees],
        [t.ancestors() for t in trees],
        [t.position_ids(s) for t, s in zip(trees, starts)],
        layers,
        lean=lean_model(model),
    )
    t1 = time.perf_counter()
    generators = generators or [None] * len(rows)
    accepted, next_tokens, accept_s = [], [], []
    for tree, logits, generator in zip(trees, out.split(out.logits), generators):
        t = time.perf_counter()
        path, token = accept_tree(tree, logits, temperature, top_k, top_p, generator)
        accepted.append(path)
        next_tokens.append(token)
        accept_s.append(time.perf_counter() - t)
    t2 = time.perf_counter()
    cache.commit(rows, starts, accepted)
    commit_s = (time.perf_counter() - t2) / len(rows)
    hidden = out.split(out.hidden)
    layer_hidden = {k: out.split(h) for k, h in (out.layer_hidden or {}).items()}
    results = []
    for i, (tree, path, token) in enumerate(zip(trees, accepted, next_tokens)):
        tokens, stopped = emitted_tokens(tree, path, token, stop_ids)
        index = torch.tensor(path, device=hidden[i].device)
        results.append(
            StepResult(
                path,
                tokens,
                stopped,
                hidden[i][index],
                {k: h[i][index] for k, h in layer_hidden.items()} or None,
                {"verify": t1 - t0, "accept": accept_s[i], "commit": commit_s},
            )
        )
    return results

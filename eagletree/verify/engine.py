"""One verification step: target pass over the tree, acceptance, KV commit."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..target import TreeForwardOutput, cache_length, keep_cache_positions, tree_forward, truncate_cache
from .accept import accept_tree
from .tree import DraftTree


@dataclass
class StepResult:
    accepted: list[int]  # node indices from the root
    tokens: list[int]  # newly emitted tokens: the accepted path after the root, then the next token
    stopped: bool  # a stop token was emitted; nothing after it is in `tokens`
    hidden: torch.Tensor  # [len(accepted), H] target features of the accepted nodes
    layer_hidden: dict[int, torch.Tensor] | None
    times: dict[str, float] = field(default_factory=dict)  # seconds: verify, accept, commit


def causal_mask(n_new: int, n_cached: int, device=None) -> torch.Tensor:
    """[n_new, n_cached + n_new] bool mask of plain left-to-right attention."""
    chain = torch.ones(n_new, n_new, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(n_new, n_cached, dtype=torch.bool, device=device), chain], dim=1)


def prefill(model, cache, input_ids: torch.Tensor, layers=None) -> TreeForwardOutput | None:
    """Run the prompt tokens [n] causally on top of `cache` (usually all but the root token).

    Returns the features (no logits: the root's pass computes the first ones); nothing to run
    (n = 0, a one-token prompt) returns None.
    """
    start = cache_length(cache)
    n = input_ids.shape[-1]
    if n == 0:
        return None
    positions = torch.arange(start, start + n, device=input_ids.device)
    return tree_forward(
        model, input_ids.reshape(1, n), cache, causal_mask(n, start, input_ids.device), positions, layers, logits=False
    )


def verify_tree(model, cache, tree: DraftTree, layers=None) -> TreeForwardOutput:
    """One target pass over all tree nodes on top of the cache; the cache grows by len(tree)."""
    prefix_len = cache_length(cache)
    device = next(model.parameters()).device
    tree = tree.to(device)
    allowed = tree.attention_mask(prefix_len)
    return tree_forward(model, tree.tokens[None], cache, allowed, tree.position_ids(prefix_len), layers)


def commit(cache, prefix_len: int, accepted: list[int]) -> None:
    """Keep the prefix plus the accepted path's KV entries, contiguously; drop the rest of the tree."""
    if accepted == list(range(len(accepted))):  # already in place (a one-node tree, a chain's accepted start)
        truncate_cache(cache, prefix_len + len(accepted))
    else:
        keep_cache_positions(cache, prefix_len, torch.tensor(accepted, dtype=torch.long))


def emitted_tokens(tree: DraftTree, accepted: list[int], next_token: int, stop_ids=()) -> tuple[list[int], bool]:
    """Tokens this step emits (after the root), cut right after the first stop token."""
    tokens = tree.tokens[accepted[1:]].tolist() + [next_token]
    stops = set(stop_ids)
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1], True
    return tokens, False


def verify_step(
    model, cache, tree: DraftTree, temperature=0.0, top_k=None, top_p=None, generator=None, stop_ids=(), layers=None
) -> StepResult:
    """Verify `tree` (root = last emitted token, not yet cached), accept, and commit the cache."""
    prefix_len = cache_length(cache)
    t0 = time.perf_counter()
    out = verify_tree(model, cache, tree, layers)
    t1 = time.perf_counter()
    accepted, next_token = accept_tree(tree, out.logits[0], temperature, top_k, top_p, generator)
    t2 = time.perf_counter()
    commit(cache, prefix_len, accepted)
    t3 = time.perf_counter()
    tokens, stopped = emitted_tokens(tree, accepted, next_token, stop_ids)
    index = torch.tensor(accepted, device=out.hidden.device)
    layer_hidden = {k: h[0, index] for k, h in out.layer_hidden.items()} if out.layer_hidden else None
    return StepResult(
        accepted,
        tokens,
        stopped,
        out.hidden[0, index],
        layer_hidden,
        {"verify": t1 - t0, "accept": t2 - t1, "commit": t3 - t2},
    )

"""Run a target over new tokens on top of its KV cache with a 4D boolean mask and explicit position ids.

The unmodified HF model gets the mask and the positions; no modeling code is copied or patched.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from ..errors import InvalidValue
from .attention import GQA_SDPA, RAGGED
from .loading import TargetError


@dataclass
class TreeForwardOutput:
    logits: torch.Tensor | None  # [B, n, vocab] float32 (None when not asked for)
    hidden: torch.Tensor  # [B, n, H] last-layer (post-norm) hidden state: the draft head's feature
    layer_hidden: dict[int, torch.Tensor] | None  # layer index -> [B, n, H] output of that decoder layer


def forward_takes(model, name: str) -> bool:
    """Whether the model's forward has a parameter `name` (looking through a torch.compile wrapper)."""
    return name in _forward_parameters(type(getattr(model, "_orig_mod", model)))


@functools.cache
def _forward_parameters(cls) -> frozenset:
    # Once per class: tree_forward asks on every pass.
    return frozenset(inspect.signature(inspect.unwrap(cls.forward)).parameters)


def cache_kwarg(model) -> str:
    """The name forward takes the KV cache under: `past_key_values` (5.17) or `cache` (later 5.x)."""
    return "cache" if forward_takes(model, "cache") else "past_key_values"


def new_cache(model):
    """An empty KV cache of the kind the model's forward expects."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_length(cache) -> int:
    return 0 if cache is None else cache.get_seq_length()


def mask_for_model(model, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, kv] boolean mask (True = may attend) -> the 4D form the model's attention consumes."""
    return mask_for_config(model.config, allowed, dtype)


def mask_for_config(config, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As `mask_for_model`, for the attention implementation named in an HF config.

    SDPA (and `GQA_SDPA`) takes booleans directly; eager attention adds the mask to the scores, so it gets
    0 / -inf.
    """
    mask = allowed[None, None] if allowed.dim() == 2 else allowed[:, None]
    impl = getattr(config, "_attn_implementation", "eager")
    if impl in ("sdpa", GQA_SDPA, RAGGED):
        return mask
    if impl != "eager":
        raise TargetError(f"attention implementation {impl!r} is not supported for tree masks; use 'sdpa' or 'eager'")
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)


def is_causal(allowed: torch.Tensor) -> bool:
    """Whether an [n, kv] mask is plain left-to-right attention: every cached entry, then the new ones causally."""
    if allowed.dim() != 2:
        return False  # a batch's per-row masks (padding)
    n, kv = allowed.shape
    if n == 1:
        return bool(allowed.all())
    return bool(allowed[:, : kv - n].all()) and torch.equal(
        allowed[:, kv - n :].cpu(), torch.ones(n, n, dtype=torch.bool).tril()
    )


@torch.inference_mode()
def tree_forward(model, input_ids, cache, allowed, position_ids, layers=None, logits=True) -> TreeForwardOutput:
    """Run `input_ids` [B, n] on top of `cache` with a [n, cache_len + n] (or [B, n, kv]) bool mask.

    Row i of `allowed` says which cached and new positions token i may attend to; `position_ids`
    [B, n] (or [n]) are the rotary positions. The cache grows by n entries (drop them with
    `keep_cache_positions`). `layers` asks for the outputs of those decoder layers too.
    logits=False skips the lm_head where the model allows (a prompt's prefill needs only features).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if position_ids.dim() == 1:
        position_ids = position_ids[None].expand(input_ids.shape[0], -1)
    kv = cache_length(cache) + input_ids.shape[1]
    if allowed.shape[-2:] != (input_ids.shape[1], kv):
        raise InvalidValue(
            f"mask has shape {tuple(allowed.shape)}, expected [..., {input_ids.shape[1]}, {kv}] "
            f"({input_ids.shape[1]} new tokens on top of {kv - input_ids.shape[1]} cached)"
        )
    layers = list(layers or [])
    n_layers = model.config.num_hidden_layers
    if any(not 0 <= i < n_layers - 1 for i in layers):
        raise InvalidValue(
            f"layers {layers} must be decoder layer indices in [0, {n_layers - 2}] "
            f"(the last layer's output is `hidden`, after the final norm)"
        )
    # A left-to-right mask (a one-node tree, a prompt) is the model's own causal attention: without a mask the
    # model takes its unmasked fast path (SDPA's causal kernel; no per-head copies of grouped key/value heads).
    mask = None if is_causal(allowed) else mask_for_model(model, allowed.to(input_ids.device), model.dtype)
    extra = {} if logits or not forward_takes(model, "logits_to_keep") else {"logits_to_keep": 1}
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        output_hidden_states=True,
        **{cache_kwarg(model): cache},
        **extra,
    )
    if cache is not None and cache_length(cache) != kv:
        raise TargetError(
            f"the model did not extend the KV cache ({cache_length(cache)} entries, expected {kv}); "
            f"its forward ignored the cache argument {cache_kwarg(model)!r}"
        )
    # hidden_states[0] is the embedding output; [i + 1] is decoder layer i's output; the last is post-norm.
    states = out.hidden_states
    layer_hidden = {i: states[i + 1] for i in layers} if layers else None
    return TreeForwardOutput(
        logits=out.logits.float() if logits else None, hidden=states[-1], layer_hidden=layer_hidden
    )


@torch.inference_mode()
def keep_cache_positions(cache, start: int, keep: torch.Tensor) -> None:
    """Keep cache entries [0, start) plus the entries at `start + keep` (in that order); drop the rest.

    The kept entries are gathered before being written back contiguously after `start`, so
    overlapping source and destination ranges are safe.
    """
    n_keep = keep.numel()
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name)  # [B, heads, len, head_dim]
            picked = tensor.index_select(2, keep.to(tensor.device) + start)  # a copy: safe when ranges overlap
            tensor[:, :, start : start + n_keep] = picked
            setattr(layer, name, tensor[:, :, : start + n_keep])
        _set_length(layer, start + n_keep)


def truncate_cache(cache, length: int) -> None:
    """Drop every cache entry at position >= length."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
        _set_length(layer, length)


def _set_length(layer, length: int) -> None:
    # Sliding-window layers count the tokens they have seen separately from the stored keys.
    if hasattr(layer, "cumulative_length"):
        window = getattr(layer, "sliding_window", None)
        if window is not None and length >= window:
            raise TargetError(
                f"context of {length} tokens reached the sliding window ({window}): "
                "tree verification over a rolling cache is not supported"
            )
        layer.cumulative_length = length

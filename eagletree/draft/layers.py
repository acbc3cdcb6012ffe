"""Building blocks the EAGLE-1/2 and EAGLE-3 heads share: the target architecture's own decoder layer,
rebuilt from the target's config with one layer, and the attention inputs of a tree mask."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..target import mask_for_config
from .base import HeadError


def one_layer_config(target_config):
    """A copy of the target's config with one full-attention decoder layer, SDPA, no quantization."""
    cfg = copy.deepcopy(target_config)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"]  # the head's one layer sees the whole context
    cfg.num_hidden_layers = 1
    cfg.use_cache = True
    cfg._attn_implementation = "sdpa"
    for attr in ("quantization_config",):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    return cfg


def layer_config_dict(target_config) -> dict:
    """`one_layer_config` as the plain dict a HeadConfig saves (`layer_config`)."""
    layer_dict = one_layer_config(target_config).to_dict()
    layer_dict.pop("quantization_config", None)
    return layer_dict


def config_from_dict(layer_dict: dict):
    """The transformers config a saved `layer_config` dict describes, with SDPA attention."""
    from huggingface_hub.errors import StrictDataclassError  # (transformers 5 validates its configs so)
    from transformers import AutoConfig  # (transformers loads slowly: only when a head is built)

    values = dict(layer_dict)
    kind = values.pop("model_type", None)
    try:
        config = AutoConfig.for_model(kind, **values)
    except (StrictDataclassError, ValueError, TypeError) as e:
        reason = str(e.__cause__ or e).strip().splitlines()[-1].strip()
        raise HeadError(f"layer_config is not a valid {kind!r} config: {reason}") from e
    config._attn_implementation = "sdpa"
    return config


def build_layer(layer_config):
    """The target architecture's decoder layer and rotary embedding, from transformers itself."""
    from transformers import AutoModel

    cfg = copy.deepcopy(layer_config)
    cfg.vocab_size, cfg.pad_token_id = 1, None  # the throwaway base model's embedding stays tiny
    # float32 whatever the target's config says: a target loaded in bf16 (training's precision=auto) carries
    # dtype=bfloat16, which from_config would give the layer, and the optimizer would then update bf16 weights.
    base = AutoModel.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    layer = base.layers[0]
    # EAGLE's first (only) layer has no input norm: its input is the fc output (EAGLE, vLLM and
    # SGLang all drop it), so the exported weights carry none.
    layer.input_layernorm = nn.Identity()
    return layer, base.rotary_emb


def rms_norm(config):
    """A LLaMA RMSNorm of the config's hidden size and epsilon."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(config.hidden_size, eps=getattr(config, "rms_norm_eps", 1e-6))


def attention_inputs(layer_config, rotary, ref, position_ids, allowed, cache):
    """(position ids [B, T], the 4D mask, rotary embeddings) for a head layer over `ref` [B, T, H].

    `allowed` None means causal over the new positions on top of everything cached.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids[None].expand(ref.shape[0], -1)
    if allowed is None:
        past = 0 if cache is None else cache.get_seq_length()
        t = ref.shape[1]
        allowed = torch.ones(t, past + t, dtype=torch.bool, device=ref.device).tril(diagonal=past)
    mask = mask_for_config(layer_config, allowed.to(ref.device), ref.dtype)
    return position_ids, mask, rotary(ref, position_ids)


def init_linears(modules, std: float) -> None:
    """Normal(0, std) weights and zero biases for every Linear inside `modules` (a fresh head's start)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, nn.Linear):
                nn.init.normal_(sub.weight, std=std)
                if sub.bias is not None:
                    nn.init.zeros_(sub.bias)


@torch.no_grad()
def copy_final_norm(target_model, norm) -> None:
    """Start a head's final norm as the target's (where the target's decoder has a norm with weights)."""
    final_norm = getattr(target_model.get_decoder(), "norm", None)
    if getattr(final_norm, "weight", None) is not None:
        norm.weight.copy_(final_norm.weight)


def new_layer_cache(layer_config):
    """An empty KV cache for a head's one layer."""
    from transformers import DynamicCache

    return DynamicCache(config=layer_config)

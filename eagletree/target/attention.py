"""SDPA that reads grouped key/value heads in place, for tree passes on CPUs.

A verify pass over a tree has several query rows and a mask. For grouped-query attention (SmolLM2:
9 query heads share 3 key/value heads) transformers' SDPA path then copies every cached key and
value once per query head of its group (`repeat_kv`) in every layer, because on CUDA a mask with
`enable_gqa` falls back to the slow math kernel. PyTorch's CPU kernels take `enable_gqa` with a mask
directly, so on CPU the copies are pure cost (a share of every tree pass that grows with the cached
context: docs/results.md). `GQA_SDPA` is transformers' SDPA attention
with that one change (bitwise the same outputs), registered under its own name so that it is chosen
per model (`use_gqa_sdpa`), never process-wide; on other devices it is transformers' SDPA unchanged. A
draft head's one decoder layer uses it too while drafting (`use_gqa_sdpa_layer`: its tree levels are
several masked rows after the whole context).
"""

from __future__ import annotations

import torch

GQA_SDPA = "eagletree_sdpa_gqa"
RAGGED = "eagletree_ragged"  # ragged batches (target.ragged); the project's SDPA outside one


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' `sdpa_attention_forward`, except that on CPU grouped key/value heads are read in place
    (`enable_gqa`) when several masked query rows attend; anything else goes to transformers' own function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    q_len = query.shape[2]
    if (
        query.device.type != "cpu"
        or groups == 1
        or q_len == 1
        or attention_mask is None
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `GQA_SDPA` a known attention implementation (with SDPA's mask), once per process."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(GQA_SDPA, sdpa_gqa_attention)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


def _grouped_on_cpu_sdpa(config, device) -> bool:
    groups = config.num_attention_heads // max(
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads, 1
    )
    return device.type == "cpu" and getattr(config, "_attn_implementation", None) == "sdpa" and groups > 1


def use_gqa_sdpa(model) -> bool:
    """Switch a CPU model on SDPA with grouped key/value heads to `GQA_SDPA`; True if it did.

    Models on other devices (CUDA: a mask with enable_gqa takes the math kernel), with other attention
    implementations or without grouped heads are left as they are.
    """
    if not _grouped_on_cpu_sdpa(model.config, next(model.parameters()).device):
        return False
    register()
    model.set_attn_implementation(GQA_SDPA)
    return True


def use_gqa_sdpa_layer(layer, *configs) -> bool:
    """The same for one decoder layer built outside a model (a draft head's): its attention module's config
    and `configs` (those its masks are made from) switch to `GQA_SDPA`; True if they did."""
    attn = layer.self_attn
    if not _grouped_on_cpu_sdpa(attn.config, next(layer.parameters()).device):
        return False
    register()
    for config in (attn.config, *configs):
        config._attn_implementation = GQA_SDPA
    return True

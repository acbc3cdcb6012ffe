"""EAGLE-1/2 draft head: fc(concat(embedding of token t+1, target feature t)) -> one decoder layer -> feature t+1.

The decoder layer is the target architecture's own transformers class, built from the target's
config with one layer. The target's embedding and lm_head are shared and frozen: they are
passed in at call time and never stored in the head's weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..target import cache_kwarg as _cache_kwarg, mask_for_config
from .base import DraftHead, HeadConfig, HeadError, target_identity  # noqa: F401 (re-exported)



def _layer_config(target_config):
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


def _build_layer(layer_config):
    """The target architecture's decoder layer and rotary embedding, from transformers itself."""
    from transformers import AutoModel

    cfg = copy.deepcopy(layer_config)
    cfg.vocab_size, cfg.pad_token_id = 1, None  # the throwaway base model's embedding stays tiny
    base = AutoModel.from_config(cfg, attn_implementation="sdpa")
    layer = base.layers[0]
    # EAGLE's first (only) layer has no input norm: its input is the fc output (EAGLE, vLLM and
    # SGLang all drop it), so the exported weights carry none.
    layer.input_layernorm = nn.Identity()
    return layer, base.rotary_emb


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


class EagleHead(DraftHead):
    """EAGLE-1/2 feature-level draft head."""

    head_type = "eagle"

    def __init__(self, config: HeadConfig):
        super().__init__()
        from transformers import AutoConfig

        if config.head_type != "eagle":
            raise HeadError(f"head_type {config.head_type!r} is not supported by EagleHead; expected 'eagle'")
        self.config = config
        layer_cfg = dict(config.layer_config)
        self.layer_config = AutoConfig.for_model(layer_cfg.pop("model_type"), **layer_cfg)
        self.layer_config._attn_implementation = "sdpa"
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layer, self.rotary = _build_layer(self.layer_config)
        self._cache_kw = _cache_kwarg(self.layer)
        vocab = config.draft_vocab_size or config.target["vocab_size"]
        # Draft vocabulary maps (identity for a full-vocabulary head): draft id -> target id.
        self.register_buffer("d2t", torch.arange(vocab), persistent=True)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def for_target(cls, target_config, draft_tokens: torch.Tensor | None = None, fc_bias: bool = False) -> "EagleHead":
        """A freshly initialized head for a target (config of the HF model); optional draft vocabulary.

        fc_bias=False (the default) matches EAGLE's LLaMA-3 heads and vLLM, whose fc has no bias.
        """
        cfg = _layer_config(target_config)
        layer_dict = cfg.to_dict()
        layer_dict.pop("quantization_config", None)
        head_cfg = HeadConfig(
            head_type="eagle", hidden_size=target_config.hidden_size, target=target_identity(target_config),
            layer_config=layer_dict, draft_vocab_size=None if draft_tokens is None else int(draft_tokens.numel()),
            fc_bias=fc_bias,
        )
        head = cls(head_cfg)
        if draft_tokens is not None:
            head.set_draft_vocab(draft_tokens)
        std = getattr(target_config, "initializer_range", 0.02)
        for module in head.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        return head

    # -- forward ------------------------------------------------------------------------------

    def forward(self, features, tokens, position_ids, embed, allowed=None, cache=None):
        """Predicted next features [B, T, H].

        features [B, T, H]: target (or predicted) features at positions t; tokens [B, T]: the
        tokens at t+1; embed: the target's (frozen) input embedding; allowed: [T, kv] or
        [B, T, kv] bool mask over cache + new positions (None = causal over the new positions).
        """
        x = self.fc(torch.cat([embed(tokens).to(features.dtype), features], dim=-1))
        position_ids, mask, pos = attention_inputs(self.layer_config, self.rotary, x, position_ids, allowed, cache)
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=pos,
                         use_cache=cache is not None, **{self._cache_kw: cache})
        return out[0] if isinstance(out, tuple) else out

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)


"""EAGLE-3-style head: fuse three target layers, one decoder layer over [embedding; hidden], own norm and lm_head.

fc(concat(low, mid, high layer outputs)) -> hidden h (H). The layer's attention reads
concat(input_layernorm(embedding of the next token), hidden_norm(h)) (2H wide); its residual
stream is h. The output g is the next position's hidden: drafting feeds g back (no fc), and the
draft distribution is lm_head(norm(g)) over the draft vocabulary. The attention and MLP are the
target architecture's own transformers modules with the q/k/v projections widened to 2H inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from ..target import cache_kwarg
from .base import FeatureSpec, HeadConfig, HeadError, target_identity
from .layers import (
    attention_inputs,
    build_layer,
    config_from_dict,
    copy_final_norm,
    init_linears,
    layer_config_dict,
    new_layer_cache,
    rms_norm,
)
from .level import LevelDraftingHead
from .objectives import eagle3_batch_loss, eagle3_loss


def default_fused_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice, as outputs of decoder layers: the inputs of layers 2, L/2 and L-3."""
    return [max(min(1, num_layers - 2), 0), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0)]


class Eagle3Head(LevelDraftingHead):
    """EAGLE-3-style draft head with a draft vocabulary and fused target features."""

    head_type = "eagle3"
    ignored_train_keys = ("l1_weight", "ce_weight", "fc_bias")
    widens_vocab = False  # its own lm_head has rows for its draft vocabulary only

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.layer_config = config_from_dict(config.layer_config)
        h = config.hidden_size
        self.fused_layers = list(config.extra["fused_layers"])
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.layer, self.rotary = build_layer(self.layer_config)
        attn = self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.layer.input_layernorm = rms_norm(self.layer_config)  # on the token embedding
        self.hidden_norm = rms_norm(self.layer_config)
        self.norm = rms_norm(self.layer_config)
        vocab = config.draft_vocab_size or config.target["vocab_size"]
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self._cache_kw = cache_kwarg(self.layer.self_attn)
        self.register_buffer("d2t", torch.arange(vocab), persistent=True)

    @classmethod
    def check_config(cls, config: HeadConfig) -> None:
        """HeadError when the saved layer config is not one transformers builds."""
        config_from_dict(config.layer_config)

    @classmethod
    def for_target(cls, target_model, draft_tokens=None, fused_layers=None) -> Eagle3Head:
        """A new head whose norm and lm_head start from the target's (lm_head rows of the draft vocabulary)."""
        tc = target_model.config
        layers = list(fused_layers or default_fused_layers(tc.num_hidden_layers))
        if any(not 0 <= i < tc.num_hidden_layers - 1 for i in layers) or len(layers) != 3:
            raise HeadError(
                f"fused_layers must be 3 decoder layer indices in [0, {tc.num_hidden_layers - 2}], got {layers}"
            )
        config = HeadConfig(
            head_type=cls.head_type,
            hidden_size=tc.hidden_size,
            target=target_identity(tc),
            layer_config=layer_config_dict(tc),
            fc_bias=False,
            draft_vocab_size=None if draft_tokens is None else int(draft_tokens.numel()),
            extra={"fused_layers": layers},
        )
        head = cls(config)
        if draft_tokens is not None:
            head.set_draft_vocab(draft_tokens)
        init_linears((head.fc, head.layer.self_attn, head.layer.mlp), getattr(tc, "initializer_range", 0.02))
        with torch.no_grad():
            lm = target_model.get_output_embeddings().weight
            head.lm_head.weight.copy_(lm[head.d2t.to(lm.device)].to(head.lm_head.weight.dtype))
        copy_final_norm(target_model, head.norm)
        return head

    @classmethod
    def new(cls, target_model, draft_tokens=None) -> Eagle3Head:
        return cls.for_target(target_model, draft_tokens)

    @classmethod
    def create(cls, target_model, cfg, draft_tokens=None) -> Eagle3Head:
        return cls.for_target(target_model, draft_tokens)

    def fuse(self, layer_states: torch.Tensor) -> torch.Tensor:
        """[..., 3H] concatenated target layer outputs -> [..., H] hidden."""
        return self.fc(layer_states)

    def forward(self, hidden, tokens, position_ids, embed, allowed=None, cache=None):
        """Next hidden [B, T, H] from hidden [B, T, H] at positions t and the tokens at t+1."""
        x, _ = self.layer_inputs(hidden, tokens, embed)
        position_ids, mask, pos = attention_inputs(self.layer_config, self.rotary, hidden, position_ids, allowed, cache)
        attn, _ = self.layer.self_attn(
            hidden_states=x,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=pos,
            use_cache=cache is not None,
            **{self._cache_kw: cache},
        )
        h = hidden + attn
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def layer_inputs(self, hidden, tokens, embed):
        """(the attention input [..., 2H]: concat(normed embedding, normed hidden); the residual stream: hidden)."""
        emb = self.layer.input_layernorm(embed(tokens).to(hidden.dtype))
        return torch.cat([emb, self.hidden_norm(hidden)], dim=-1), hidden

    def has_own_lm_head(self) -> bool:
        return True

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V'] draft logits."""
        return self.lm_head(self.norm(hidden))

    def new_cache(self):
        return new_layer_cache(self.layer_config)

    # -- training and drafting ----------------------------------------------------------------

    def training_loss(self, module, target_lm, embed, features, ids, mask, cfg, generator=None):
        return eagle3_loss(module, target_lm, embed, features, ids, mask, cfg, generator)

    def batch_loss(self, module, target_lm, embed, batch, cfg, generators):
        return eagle3_batch_loss(module, target_lm, embed, batch, cfg, generators)

    def dummy_loss(self, module, embed, lm_weight, lm_bias, device) -> torch.Tensor:
        hidden = self.fuse(torch.zeros(1, 2, 3 * self.config.hidden_size, device=device))
        out = module(hidden, torch.zeros(1, 2, dtype=torch.long, device=device), torch.arange(2, device=device), embed)
        return self.draft_logits(out).float().sum() * 0.0

    @property
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(self.config.hidden_size, tuple(self.fused_layers))

    @classmethod
    def feature_spec_for(cls, target_config, cfg=None) -> FeatureSpec:
        return FeatureSpec(target_config.hidden_size, tuple(default_fused_layers(target_config.num_hidden_layers)))

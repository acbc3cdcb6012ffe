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

from .base import DraftHead, HeadConfig, target_identity
from .eagle import _build_layer, _cache_kwarg, _layer_config, attention_inputs


def default_fused_layers(num_layers: int) -> list[int]:
    """EAGLE-3's choice, as outputs of decoder layers: the inputs of layers 2, L/2 and L-3."""
    return [max(min(1, num_layers - 2), 0), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0)]


def _rms_norm(config):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(config.hidden_size, eps=getattr(config, "rms_norm_eps", 1e-6))


class Eagle3Head(DraftHead):
    """EAGLE-3-style draft head with a draft vocabulary and fused target features."""

    head_type = "eagle3"

    def __init__(self, config: HeadConfig):
        super().__init__()
        from transformers import AutoConfig

        self.config = config
        layer_cfg = dict(config.layer_config)
        self.layer_config = AutoConfig.for_model(layer_cfg.pop("model_type"), **layer_cfg)
        self.layer_config._attn_implementation = "sdpa"
        h = config.hidden_size
        self.fused_layers = list(config.extra["fused_layers"])
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.layer, self.rotary = _build_layer(self.layer_config)
        attn = self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.layer.input_layernorm = _rms_norm(self.layer_config)  # on the token embedding
        self.hidden_norm = _rms_norm(self.layer_config)
        self.norm = _rms_norm(self.layer_config)
        vocab = config.draft_vocab_size or config.target["vocab_size"]
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self._cache_kw = _cache_kwarg(self.layer.self_attn)
        self.register_buffer("d2t", torch.arange(vocab), persistent=True)

    @classmethod
    def for_target(cls, target_model, draft_tokens=None, fused_layers=None) -> "Eagle3Head":
        """A new head whose norm and lm_head start from the target's (lm_head rows of the draft vocabulary)."""
        tc = target_model.config
        layers = list(fused_layers or default_fused_layers(tc.num_hidden_layers))
        if any(not 0 <= i < tc.num_hidden_layers - 1 for i in layers) or len(layers) != 3:
            raise ValueError(f"fused_layers must be 3 decoder layer indices in [0, {tc.num_hidden_layers - 2}], "
                             f"got {layers}")
        cfg = _layer_config(tc)
        layer_dict = cfg.to_dict()
        layer_dict.pop("quantization_config", None)
        config = HeadConfig(head_type="eagle3", hidden_size=tc.hidden_size, target=target_identity(tc),
                            layer_config=layer_dict, fc_bias=False,
                            draft_vocab_size=None if draft_tokens is None else int(draft_tokens.numel()),
                            extra={"fused_layers": layers})
        head = cls(config)
        if draft_tokens is not None:
            head.set_draft_vocab(draft_tokens)
        std = getattr(tc, "initializer_range", 0.02)
        for module in (head.fc, head.layer.self_attn, head.layer.mlp):
            for sub in module.modules():
                if isinstance(sub, nn.Linear):
                    nn.init.normal_(sub.weight, std=std)
                    if sub.bias is not None:
                        nn.init.zeros_(sub.bias)
        with torch.no_grad():
            lm = target_model.get_output_embeddings().weight
            head.lm_head.weight.copy_(lm[head.d2t.to(lm.device)].to(head.lm_head.weight.dtype))
            final_norm = getattr(target_model.get_decoder(), "norm", None)
            if final_norm is not None and getattr(final_norm, "weight", None) is not None:
                head.norm.weight.copy_(final_norm.weight)
        return head

    def fuse(self, layer_states: torch.Tensor) -> torch.Tensor:
        """[..., 3H] concatenated target layer outputs -> [..., H] hidden."""
        return self.fc(layer_states)

    def forward(self, hidden, tokens, position_ids, embed, allowed=None, cache=None):
        """Next hidden [B, T, H] from hidden [B, T, H] at positions t and the tokens at t+1."""
        emb = self.layer.input_layernorm(embed(tokens).to(hidden.dtype))
        x = torch.cat([emb, self.hidden_norm(hidden)], dim=-1)
        position_ids, mask, pos = attention_inputs(self.layer_config, self.rotary, hidden, position_ids, allowed, cache)
        attn, _ = self.layer.self_attn(hidden_states=x, attention_mask=mask, position_ids=position_ids,
                                       position_embeddings=pos, use_cache=cache is not None,
                                       **{self._cache_kw: cache})
        h = hidden + attn
        return h + self.layer.mlp(self.layer.post_attention_layernorm(h))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V'] draft logits."""
        return self.lm_head(self.norm(hidden))

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)

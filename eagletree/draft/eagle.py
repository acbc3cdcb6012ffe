"""EAGLE-1/2 draft head: fc(concat(embedding of token t+1, target feature t)) -> one decoder layer -> feature t+1.

The decoder layer is the target architecture's own transformers class, built from the target's
config with one layer. The target's embedding and lm_head are shared and frozen: they are
passed in at call time and never stored in the head's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ..target import cache_kwarg
from .base import HeadConfig, HeadError, target_identity
from .layers import attention_inputs, build_layer, config_from_dict, layer_config_dict, new_layer_cache
from .level import LevelDraftingHead
from .objectives import eagle_batch_loss, eagle_loss

# The decoder layer's weights that read its input and that write its updates (rescaled by init_from_target).
READS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
WRITES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


class EagleHead(LevelDraftingHead):
    """EAGLE-1/2 feature-level draft head."""

    head_type = "eagle"
    starts_from_target = True

    def __init__(self, config: HeadConfig):
        super().__init__()
        if config.head_type != self.head_type:
            raise HeadError(
                f"head_type {config.head_type!r} is not supported by EagleHead; expected {self.head_type!r}"
            )
        self.config = config
        self.layer_config = config_from_dict(config.layer_config)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layer, self.rotary = build_layer(self.layer_config)
        self._cache_kw = cache_kwarg(self.layer)
        vocab = config.draft_vocab_size or config.target["vocab_size"]
        # Draft vocabulary maps (identity for a full-vocabulary head): draft id -> target id.
        self.register_buffer("d2t", torch.arange(vocab), persistent=True)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def check_config(cls, config: HeadConfig) -> None:
        """HeadError when the saved layer config is not one transformers builds."""
        config_from_dict(config.layer_config)

    @classmethod
    def for_target(cls, target_config, draft_tokens: torch.Tensor | None = None, fc_bias: bool = False) -> EagleHead:
        """A freshly initialized head for a target (config of the HF model); optional draft vocabulary.

        fc_bias=False (the default) matches EAGLE's LLaMA-3 heads and vLLM, whose fc has no bias.
        """
        head_cfg = HeadConfig(
            head_type=cls.head_type,
            hidden_size=target_config.hidden_size,
            target=target_identity(target_config),
            layer_config=layer_config_dict(target_config),
            draft_vocab_size=None if draft_tokens is None else int(draft_tokens.numel()),
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

    @classmethod
    def new(cls, target_model, draft_tokens=None) -> EagleHead:
        return cls.for_target(target_model.config, draft_tokens)

    @classmethod
    def create(cls, target_model, cfg, draft_tokens=None) -> EagleHead:
        head = cls.for_target(target_model.config, draft_tokens, fc_bias=cfg.fc_bias)
        if cfg.init_from_target:
            head.init_from_target(target_model)
        return head

    @torch.no_grad()
    def init_from_target(self, target_model, probe_tokens: torch.Tensor | None = None) -> None:
        """Start as the target's last decoder layer, rescaled to work on features, with fc passing the feature
        half of its input through unchanged (the token embedding half keeps its random init).

        The head's layer has no input norm and reads and writes post-norm features, while the target's last
        layer reads the normed residual stream and adds updates sized for it (on SmolLM2-135M the residual's
        RMS is ~31 and the feature's ~2). So q/k/v are scaled by rms(normed input) / rms(feature) and o_proj and
        down_proj by rms(feature) / rms(residual), measured by one target pass over `probe_tokens` (default:
        256 token ids drawn with a fixed seed): the start then adds the last layer's update at the feature's
        scale instead of one ~15x too large.
        """
        decoder = target_model.get_decoder()
        last = decoder.layers[-1]
        if type(last) is not type(self.layer):
            raise HeadError(
                f"the target's decoder layer is a {type(last).__name__}, the head's a "
                f"{type(self.layer).__name__}: cannot start from it"
            )
        mine = self.layer.state_dict()
        theirs = {k: v for k, v in last.state_dict().items() if k in mine}  # the head's layer has no input norm
        if set(theirs) != set(mine):
            raise HeadError(f"the target's last layer lacks {sorted(set(mine) - set(theirs))}: cannot start from it")
        if not set(READS + WRITES) <= set(mine):
            raise HeadError(
                f"the head's layer lacks {sorted(set(READS + WRITES) - set(mine))}: cannot rescale the "
                f"target's last layer to the feature's scale"
            )
        self.layer.load_state_dict(theirs)  # shapes must match
        residual, normed, feature = _last_layer_scales(target_model, probe_tokens)
        for names, factor in ((READS, normed / feature), (WRITES, feature / residual)):
            for name in names:
                self.layer.get_parameter(name).mul_(factor)
        h = self.config.hidden_size
        self.fc.weight[:, h:] = torch.eye(h, dtype=self.fc.weight.dtype, device=self.fc.weight.device)
        if self.fc.bias is not None:
            self.fc.bias.zero_()

    # -- forward ------------------------------------------------------------------------------

    def forward(self, features, tokens, position_ids, embed, allowed=None, cache=None):
        """Predicted next features [B, T, H].

        features [B, T, H]: target (or predicted) features at positions t; tokens [B, T]: the
        tokens at t+1; embed: the target's (frozen) input embedding; allowed: [T, kv] or
        [B, T, kv] bool mask over cache + new positions (None = causal over the new positions).
        """
        x, _ = self.layer_inputs(features, tokens, embed)
        position_ids, mask, pos = attention_inputs(self.layer_config, self.rotary, x, position_ids, allowed, cache)
        out = self.layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=pos,
            use_cache=cache is not None,
            **{self._cache_kw: cache},
        )
        return out[0] if isinstance(out, tuple) else out

    def layer_inputs(self, features, tokens, embed):
        """(the layer's attention input, its residual stream) [..., H] each: fc(concat(embedding, feature))."""
        x = self.fc(torch.cat([embed(tokens).to(features.dtype), features], dim=-1))
        return x, x

    def new_cache(self):
        return new_layer_cache(self.layer_config)

    # -- training and drafting ----------------------------------------------------------------

    def training_loss(self, module, target_lm, embed, features, ids, mask, cfg, generator=None):
        return eagle_loss(module, target_lm, embed, features, ids, mask, cfg, generator)

    def batch_loss(self, module, target_lm, embed, batch, cfg, generators):
        return eagle_batch_loss(module, target_lm, embed, batch, cfg, generators)

    def dummy_loss(self, module, embed, lm_weight, lm_bias, device) -> torch.Tensor:
        hidden = torch.zeros(1, 2, self.config.hidden_size, device=device)
        out = module(hidden, torch.zeros(1, 2, dtype=torch.long, device=device), torch.arange(2, device=device), embed)
        return out.float().sum() * 0.0


def _rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean(-1).sqrt().mean().item()


@torch.no_grad()
def _last_layer_scales(target_model, probe_tokens: torch.Tensor | None) -> tuple[float, float, float]:
    """RMS of the target's residual stream entering its last layer, of that layer's normed input, and of the
    final post-norm features, over one pass of probe_tokens [T] (the first 16 positions left out)."""
    device = next(target_model.parameters()).device
    if probe_tokens is None:
        generator = torch.Generator().manual_seed(0)
        probe_tokens = torch.randint(0, target_model.config.vocab_size, (256,), generator=generator)
    if probe_tokens.dim() != 1 or probe_tokens.numel() < 32:
        raise HeadError(
            f"probe_tokens must be one sequence of at least 32 token ids, got shape {tuple(probe_tokens.shape)}"
        )
    decoder = target_model.get_decoder()
    states = decoder(input_ids=probe_tokens[None].to(device), output_hidden_states=True).hidden_states
    entering = states[-2][0, 16:]
    normed = decoder.layers[-1].input_layernorm(entering)
    return _rms(entering), _rms(normed), _rms(states[-1][0, 16:])

"""Block (DFlash-style) draft head: one call drafts a whole block of k tokens.

The target's hidden states from several layers (shallow to deep) are concatenated, projected and normed
(`fc`, `hidden_norm`): the context. Every draft layer reads the context through its own k/v projections, as
keys and values in front of the block's own. The block is the root (the last committed token, which the target
has not read yet) followed by k-1 mask tokens, embedded with the target's frozen embedding; attention within the
block is bidirectional, and a block position sees the context before the root. The block's outputs, through the
head's `norm` and the target's lm_head (rows of the draft vocabulary), give k-1 distributions in one call: of
the token 1, 2, ... k-1 past the root. They do not depend on one another's tokens, so a tree over them is
searched like Medusa's levels (`follows_drafts` False), and the context's keys and values are cached per layer
(they depend on the target's features alone).

The layers follow the published DFlash drafter (Qwen3 layers: q/k norms, no biases) so that its exports load in
the engines that serve DFlash.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import DraftHead, Drafting, FeatureSpec, HeadConfig, HeadError, target_identity
from .layers import config_from_dict, copy_final_norm, init_linears, layer_config_dict, rms_norm
from .objectives import dflash_loss


def default_context_layers(num_layers: int, count: int) -> list[int]:
    """The anchors' choice of target layers (outputs of decoder layers, 0-based): `count` evenly spaced from the
    second to the fourth from last (the middle one alone for count 1), within [0, num_layers - 2] for tiny targets."""
    top = max(num_layers - 2, 0)
    if count == 1:
        return [min(num_layers // 2, top)]
    start, end = min(1, top), min(max(num_layers - 3, 1), top)
    return [round(start + i * (end - start) / (count - 1)) for i in range(count)]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, heads, T, d] with cos/sin [B, T, d]."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + turned * sin[:, None]


class BlockLayer(nn.Module):
    """One draft layer: the block's queries attend to the context's keys/values and the block's own."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.heads
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.q_norm, self.k_norm = LlamaRMSNorm(self.head_dim, eps=eps), LlamaRMSNorm(self.head_dim, eps=eps)
        self.input_layernorm, self.post_attention_layernorm = rms_norm(config), rms_norm(config)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, count: int) -> torch.Tensor:
        """[B, T, H] -> [B, count, T, d]."""
        return proj(x).view(*x.shape[:2], count, self.head_dim).transpose(1, 2)

    def context_kv(self, context: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv_heads, C, d] of context positions [B, C, H] (rotated to their positions)."""
        keys = rotate(self.k_norm(self._heads(context, self.k_proj, self.kv_heads)), cos, sin)
        return keys, self._heads(context, self.v_proj, self.kv_heads)

    def forward(self, x, cos, sin, keys, values, allowed) -> torch.Tensor:
        """The block x [B, Q, H] after this layer; keys/values [B, kv_heads, C, d] the context's, `allowed`
        [B, Q, C + Q] bool over them and then the block's own positions (None: all of them)."""
        h = self.input_layernorm(x)
        q = rotate(self.q_norm(self._heads(h, self.q_proj, self.heads)), cos, sin)
        k = rotate(self.k_norm(self._heads(h, self.k_proj, self.kv_heads)), cos, sin)
        k, v = (
            torch.cat([keys.to(k.dtype), k], dim=2),
            torch.cat([values.to(k.dtype), self._heads(h, self.v_proj, self.kv_heads)], 2),
        )
        mask = None if allowed is None else allowed[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlashHead(DraftHead):
    """config.extra: block_size (k: the root and k-1 drafted positions), num_layers, target_layers (the target
    layers whose outputs form the context), mask_token_id (the target token embedded at the masked positions),
    num_target_layers (the target's decoder layers, which exports name)."""

    head_type = "dflash"
    own_train_keys = ("block_size", "draft_layers", "block_anchors", "block_gamma", "mask_token_id")
    ignored_train_keys = ("l1_weight", "ttt_steps", "ttt_decay", "fc_bias")

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.check_config(config)
        self.layer_config = config_from_dict(config.layer_config)
        h, extra = config.hidden_size, config.extra
        self.block_size, self.mask_token_id = int(extra["block_size"]), int(extra["mask_token_id"])
        self.target_layers = [int(i) for i in extra["target_layers"]]
        self.fc = nn.Linear(len(self.target_layers) * h, h, bias=False)
        self.hidden_norm = rms_norm(self.layer_config)
        self.layers = nn.ModuleList(BlockLayer(self.layer_config) for _ in range(int(extra["num_layers"])))
        self.norm = rms_norm(self.layer_config)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary = LlamaRotaryEmbedding(config=self.layer_config)
        vocab = config.draft_vocab_size or config.target["vocab_size"]
        self.register_buffer("d2t", torch.arange(vocab), persistent=True)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def check_config(cls, config: HeadConfig) -> None:
        """HeadError naming the value when the saved config cannot build a block head."""
        extra = config.extra
        keys = ("block_size", "num_layers", "target_layers", "mask_token_id", "num_target_layers")
        missing = [k for k in keys if k not in extra]
        if missing:
            raise HeadError(f"a dflash head's config.extra lacks {missing}")
        if not isinstance(extra["block_size"], int) or extra["block_size"] < 2:
            raise HeadError(
                f"block_size must be an integer >= 2 (the root and a drafted token), got {extra['block_size']!r}"
            )
        if not isinstance(extra["num_layers"], int) or extra["num_layers"] < 1:
            raise HeadError(f"num_layers must be an integer >= 1, got {extra['num_layers']!r}")
        vocab = config.target["vocab_size"]
        if not isinstance(extra["mask_token_id"], int) or not 0 <= extra["mask_token_id"] < vocab:
            raise HeadError(f"mask_token_id must be a token id in [0, {vocab}), got {extra['mask_token_id']!r}")
        config_from_dict(config.layer_config)

    @classmethod
    def for_target(
        cls, target_model, draft_tokens=None, block_size: int = 8, num_layers: int = 2, mask_token_id: int = -1
    ) -> DFlashHead:
        """A new head: its final norm starts as the target's, its other weights random."""
        tc = target_model.config
        mask_token_id = default_mask_token(tc) if mask_token_id < 0 else mask_token_id
        config = HeadConfig(
            head_type=cls.head_type,
            hidden_size=tc.hidden_size,
            target=target_identity(tc),
            layer_config=layer_config_dict(tc),
            fc_bias=False,
            draft_vocab_size=None if draft_tokens is None else int(draft_tokens.numel()),
            extra={
                "block_size": int(block_size),
                "num_layers": int(num_layers),
                "target_layers": list(context_spec(tc, num_layers).layers),
                "mask_token_id": int(mask_token_id),
                "num_target_layers": int(tc.num_hidden_layers),
            },
        )
        head = cls(config)
        if draft_tokens is not None:
            head.set_draft_vocab(draft_tokens)
        init_linears([head], getattr(tc, "initializer_range", 0.02))
        copy_final_norm(target_model, head.norm)
        return head

    @classmethod
    def new(cls, target_model, draft_tokens=None) -> DFlashHead:
        return cls.for_target(target_model, draft_tokens)

    @classmethod
    def create(cls, target_model, cfg, draft_tokens=None) -> DFlashHead:
        return cls.for_target(target_model, draft_tokens, cfg.block_size, cfg.draft_layers, cfg.mask_token_id)

    # -- what it reads and how it drafts -------------------------------------------------------

    @property
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(self.config.hidden_size, tuple(self.target_layers))

    @classmethod
    def feature_spec_for(cls, target_config, cfg=None) -> FeatureSpec:
        return context_spec(target_config, cfg.draft_layers if cfg is not None else 2)

    @property
    def drafting(self) -> Drafting:
        # the catch-up call drafts the whole block: no call per level; level L reads position L's distribution
        return Drafting(max_depth=self.block_size - 1, follows_drafts=False, batched=True, catch_up=1, level_calls=0)

    def make_drafter(self, target_model):
        from .block_drafter import BlockDrafter

        return BlockDrafter(self, target_model).single()

    def make_batch_drafter(self, target_model):
        from .block_drafter import BlockDrafter

        return BlockDrafter(self, target_model)

    # -- forward ------------------------------------------------------------------------------

    def context(self, layer_states: torch.Tensor) -> torch.Tensor:
        """[..., n_layers * H] concatenated target layer outputs -> [..., H] context features."""
        return self.hidden_norm(self.fc(layer_states))

    def block_inputs(self, roots: torch.Tensor, embed) -> torch.Tensor:
        """The embedded blocks [n, k, H] of roots [n]: each root, then k-1 mask tokens."""
        tokens = torch.full((roots.numel(), self.block_size), self.mask_token_id, dtype=torch.long, device=roots.device)
        tokens[:, 0] = roots
        return embed(tokens)

    def run_block(self, x, positions, context_kv, allowed) -> torch.Tensor:
        """The block outputs [B, Q, H] (after the final norm) of block inputs x [B, Q, H] at `positions` [B, Q];
        `context_kv(i)` gives layer i's context keys and values, `allowed` [B, Q, C + Q]."""
        cos, sin = self.rotary(x, positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, *context_kv(i), allowed)
        return self.norm(x)

    def forward(self, layer_states, ids, anchors, embed) -> torch.Tensor:
        """Training: the outputs [n, k, H] of the blocks rooted at `anchors` [n] of one sequence (ids [T], the
        target's layer outputs [T, n_layers * H]); block b sees positions < anchors[b] and itself."""
        t, k = ids.shape[0], self.block_size
        context = self.context(layer_states)[None]  # [1, T, H]
        x = self.block_inputs(ids[anchors], embed).to(context.dtype).reshape(1, -1, context.shape[-1])
        positions = (anchors[:, None] + torch.arange(k, device=ids.device)).reshape(1, -1)
        cos, sin = self.rotary(context, torch.arange(t, device=ids.device)[None])
        block_of = torch.arange(anchors.numel(), device=ids.device).repeat_interleave(k)
        allowed = torch.cat(
            [
                torch.arange(t, device=ids.device)[None] < anchors[block_of][:, None],  # the context before its root
                block_of[:, None] == block_of[None],  # its own block, both ways
            ],
            dim=1,
        )[None]
        out = self.run_block(x, positions, lambda i: self.layers[i].context_kv(context, cos, sin), allowed)
        return out[0].view(anchors.numel(), k, -1)

    # -- training -----------------------------------------------------------------------------

    def training_loss(self, module, target_lm, embed, features, ids, mask, cfg, generator=None):
        return dflash_loss(module, target_lm, embed, features, ids, mask, cfg, generator)

    def dummy_loss(self, module, embed, lm_weight, lm_bias, device) -> torch.Tensor:
        states = torch.zeros(2, len(self.target_layers) * self.config.hidden_size, device=device)
        out = module(
            states,
            torch.zeros(2, dtype=torch.long, device=device),
            torch.ones(1, dtype=torch.long, device=device),
            embed,
        )
        return F.linear(out, lm_weight, lm_bias).float().sum() * 0.0


def context_spec(target_config, draft_layers: int) -> FeatureSpec:
    """The context a new head reads: one target layer per draft layer, as the anchors, and at least three."""
    count = max(3, int(draft_layers))
    return FeatureSpec(target_config.hidden_size, tuple(default_context_layers(target_config.num_hidden_layers, count)))


def default_mask_token(target_config) -> int:
    """The target token a new head embeds at masked positions when the run names none: the target's pad token,
    else its BOS, else its last token (the embedding is frozen; training learns what it means there)."""
    for key in ("pad_token_id", "bos_token_id"):
        value = getattr(target_config, key, None)
        if isinstance(value, int) and 0 <= value < target_config.vocab_size:
            return value
    return target_config.vocab_size - 1

"""Medusa heads: K residual blocks on the target's last feature, head k drafting the token k steps ahead.

A second drafter for static trees: head k's distribution does not depend on the drafted tokens
before it, so one call per level serves the whole frontier.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import DraftHead, Drafting, HeadConfig, HeadError, target_identity
from .objectives import medusa_loss


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class MedusaHead(DraftHead):
    """config.extra: num_heads (K), num_layers (residual blocks per head), own_lm_head (bool)."""

    head_type = "medusa"
    ignored_train_keys = ("noise", "ttt_steps", "ttt_decay", "l1_weight", "ce_weight", "fc_bias")
    own_train_keys = ("medusa_heads",)

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        h, k = config.hidden_size, int(config.extra.get("num_heads", 4))
        layers = int(config.extra.get("num_layers", 1))
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(h) for _ in range(layers)]) for _ in range(k))
        vocab = config.draft_vocab_size or config.target["vocab_size"]
        self.own_lm_head = bool(config.extra.get("own_lm_head", False))
        self.lm_heads = nn.ModuleList(nn.Linear(h, vocab, bias=False) for _ in range(k)) if self.own_lm_head else None
        self.register_buffer("d2t", torch.arange(vocab), persistent=True)

    def has_own_lm_head(self) -> bool:
        return self.own_lm_head

    @classmethod
    def for_target(
        cls, target_config, draft_tokens=None, num_heads: int = 4, num_layers: int = 1, own_lm_head: bool = False
    ) -> MedusaHead:
        config = HeadConfig(
            head_type=cls.head_type,
            hidden_size=target_config.hidden_size,
            target=target_identity(target_config),
            layer_config={},
            draft_vocab_size=None if draft_tokens is None else int(draft_tokens.numel()),
            extra={"num_heads": num_heads, "num_layers": num_layers, "own_lm_head": own_lm_head},
        )
        head = cls(config)
        if draft_tokens is not None:
            head.set_draft_vocab(draft_tokens)
        for block in head.blocks:
            for res in block:
                nn.init.zeros_(res.linear.weight)  # start as the identity: head k begins as the target's own lm_head
                nn.init.zeros_(res.linear.bias)
        return head

    @classmethod
    def new(cls, target_model, draft_tokens=None) -> MedusaHead:
        return cls.for_target(target_model.config, draft_tokens)

    @classmethod
    def create(cls, target_model, cfg, draft_tokens=None) -> MedusaHead:
        return cls.for_target(target_model.config, draft_tokens, num_heads=cfg.medusa_heads)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, features: torch.Tensor, shared_weight=None, shared_bias=None) -> torch.Tensor:
        """[..., H] -> [K, ..., V'] draft logits (own lm_heads, or the target's shared lm_head weight)."""
        hs = torch.stack([block(features) for block in self.blocks])
        if self.lm_heads is not None:
            return torch.stack([lm(h) for lm, h in zip(self.lm_heads, hs)])
        return torch.nn.functional.linear(hs, shared_weight, shared_bias)

    def training_loss(self, module, target_lm, embed, features, ids, mask, cfg, generator=None):
        return medusa_loss(module, target_lm, embed, features, ids, mask, cfg, generator)

    def dummy_loss(self, module, embed, lm_weight, lm_bias, device) -> torch.Tensor:
        return module(torch.zeros(2, self.config.hidden_size, device=device), lm_weight, lm_bias).float().sum() * 0.0

    @property
    def drafting(self) -> Drafting:
        # head k reads the committed feature only: one call at the commit drafts every level, K levels deep
        return Drafting(max_depth=self.num_heads, follows_drafts=False, catch_up=1, level_calls=0)

    def make_drafter(self, target_model) -> MedusaDrafter:
        return MedusaDrafter(self, target_model)


class MedusaDrafter:
    """The `Drafter` of Medusa heads: level L drafts with head L from the last committed feature."""

    def __init__(self, head: MedusaHead, target_model):
        from .drafter import sliced_lm_head

        self.head = head
        self.lm_weight, self.lm_bias = sliced_lm_head(head, target_model, next(head.parameters()).dtype)
        self.token_map = None if head.config.draft_vocab_size is None else head.d2t
        self.level_probs = None

    @torch.inference_mode()
    def extend(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Take the newest committed feature; its head k predicts the token k steps after the next root."""
        logits = self.head(features[-1].to(self.lm_weight.dtype), self.lm_weight, self.lm_bias)  # [K, V']
        self.level_probs = torch.softmax(logits.float(), -1)
        return self.level_probs[0]

    def begin_tree(self) -> None:
        """Nothing to forget: Medusa's levels read only the committed feature, never drafted nodes."""

    def __call__(self, nodes, tokens, parents, level):
        if self.level_probs is None:
            raise RuntimeError("call extend() with the prompt's target features before drafting")
        if level > self.head.num_heads:
            raise HeadError(
                f"Medusa head has {self.head.num_heads} heads; cannot draft level {level} (use depth <= "
                f"{self.head.num_heads})"
            )
        return self.level_probs[level - 1].expand(nodes.numel(), -1)

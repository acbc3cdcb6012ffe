"""The drafter the tree search calls: one head call per depth level for the whole frontier.

State for one sequence: the head's KV cache of the committed prefix (extended after every
verification with the target's real features, never recomputed) and, during one step, the
tree part of the cache with a tree mask: each frontier node sees the prefix, its drafted
ancestors and itself.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..packing import (
    apply_choice,
    draft_kernel_choice,
    is_packed,
    pack_linears,
    packed_linear,
    packed_weight,
    packing_problem,
)
from ..target.attention import use_gqa_sdpa_layer


@runtime_checkable
class Drafter(Protocol):
    """What `make_drafter(head, target)` returns for every head type; the decoding loop and the searches use only this.

    The head's state is the committed prefix (never recomputed) plus, during one step, the tree drafted so far.
    """

    token_map: torch.Tensor | None  # draft id -> target id ([V'] long), or None for the full vocabulary

    def extend(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Commit m positions: the target's features [m, F] and the token after each; drops any drafted tree.
        Returns the root's child distribution [V']."""

    def begin_tree(self) -> None:
        """Forget the drafted tree (not the committed prefix): the next search starts again from the root."""

    def __call__(self, nodes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, level: int) -> torch.Tensor:
        """Expand one search level: frontier node ids [F] (numbered by the search), their tokens (draft ids) and
        parent node ids (0 = the root) -> child distributions [F, V']. level 1 is the root's own children."""


def sliced_lm_head(head, target_model, dtype=None):
    """The target's lm_head weight (and bias) restricted to the head's draft vocabulary, cached on the head.

    Slicing once per head (not per generation) keeps drafting at V'/V of a full lm_head's cost.
    `dtype` (default: the target's) is the drafter's precision, which may be lower than the target's.
    """
    lm_head = target_model.get_output_embeddings()
    weight, bias = lm_head.weight.detach(), getattr(lm_head, "bias", None)
    bias = None if bias is None else bias.detach()
    dtype = dtype or weight.dtype
    if head.config.draft_vocab_size is None and dtype == weight.dtype:
        return weight, bias
    key = (weight.data_ptr(), weight.dtype, weight.device, head.d2t.data_ptr(), dtype)
    cached = head._lm_slice
    if cached is None or cached[0] != key:
        rows = slice(None) if head.config.draft_vocab_size is None else head.d2t.to(weight.device)
        cached = (key, weight[rows].to(dtype).contiguous(), None if bias is None else bias[rows].to(dtype))
        object.__setattr__(head, "_lm_slice", cached)  # a plain attribute, not a registered buffer
    return cached[1], cached[2]


def draft_kernels(head, target_model, lm_weight, lm_bias) -> tuple:
    """(the lm_head slice packed or None, the kernel choice or None) a drafter runs with: where the target runs
    oneDNN-packed kernels (--pack; never inside stock_kernels(target)), so does the head (its Linears packed here),
    at the row counts where the target's measured choice (--pack auto) found them faster (its layer has the
    target's layer shapes), or, drafting in another precision, where its own measured choice did."""
    if not is_packed(target_model) or packing_problem(head):
        return None, None
    if not is_packed(head):
        pack_linears(head)
    choice = draft_kernel_choice(head, target_model, lm_weight, lm_bias)
    apply_choice(head, choice)
    return (None if lm_weight is None else packed_weight(head, lm_weight)), choice


def lm_probs(hidden: torch.Tensor, lm_weight, lm_bias, lm_packed, choice) -> torch.Tensor:
    """[..., H] features -> [..., V'] draft distributions through the lm_head slice (packed where `choice` packs)."""
    hidden = hidden.to(lm_weight.dtype)
    if lm_packed is not None and (choice is None or choice.packs(hidden)):
        logits = packed_linear(hidden, lm_packed, lm_bias)
    else:
        logits = torch.nn.functional.linear(hidden, lm_weight, lm_bias)
    return torch.softmax(logits.float(), dim=-1)


class TreeDrafter:
    """The `Drafter` of EAGLE-1/2 and EAGLE-3 heads: one head call per level for the whole frontier."""

    def __init__(self, head, target_model):
        self.head = head
        self.embed = target_model.get_input_embeddings()
        # The head may run in a lower precision than the target (drafts are only proposals; the
        # target's own pass decides): target features are cast to it on the way in.
        self.dtype = next(head.parameters()).dtype
        full = head.config.draft_vocab_size is None
        self.own_lm_head = head.has_own_lm_head()  # EAGLE-3: its own norm and lm_head
        self.lm_weight, self.lm_bias = (
            (None, None) if self.own_lm_head else sliced_lm_head(head, target_model, self.dtype)
        )
        self.lm_packed, self.kernel_choice = draft_kernels(head, target_model, self.lm_weight, self.lm_bias)
        self.token_map = None if full else head.d2t  # draft id -> target id, for the search
        # On CPU each level's rows read the cached grouped key/value heads in place (bitwise the same outputs).
        use_gqa_sdpa_layer(head.layer, head.layer_config)
        self.cache = head.new_cache()
        self.committed = 0
        self.root_probs = None

    def draft_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] predicted features -> [..., V'] draft distributions (through the target's lm_head)."""
        if self.own_lm_head:
            return torch.softmax(self.head.draft_logits(hidden).float(), dim=-1)
        return lm_probs(hidden, self.lm_weight, self.lm_bias, self.lm_packed, self.kernel_choice)

    def _truncate(self, length: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]

    @torch.inference_mode()
    def extend(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Commit positions: target features [m, H] at the next m positions and the token after each.

        Drops the previous step's tree entries first. Returns the root's child distribution: the
        head's prediction after the last of these positions. (EAGLE-3: features are the fused
        layers' outputs, [m, 3H].)
        """
        self._truncate(self.committed)
        features = self.head.fuse(features.to(self.dtype))
        m = features.shape[0]
        positions = torch.arange(self.committed, self.committed + m, device=features.device)
        out = self.head(features[None], next_tokens[None], positions, self.embed, cache=self.cache)[0]
        self.committed += m
        self.root_feature = out[-1]
        self.root_probs = self.draft_probs(out[-1])
        self.begin_tree()
        return self.root_probs

    def begin_tree(self) -> None:
        """Forget any drafted tree (cache entries and node tables): the next search starts from the root."""
        self._truncate(self.committed)
        device = self.root_feature.device
        # Per run node: its cache slot, its output feature and its ancestor row over the slots.
        self.node_slot = torch.full((64,), -1, dtype=torch.long, device=device)
        self.slot_feats = self.root_feature.new_zeros(0, self.root_feature.shape[-1])
        self.slot_rows = torch.zeros(0, 0, dtype=torch.bool, device=device)

    @torch.inference_mode()
    def __call__(self, nodes: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, level: int) -> torch.Tensor:
        if self.root_probs is None:
            raise RuntimeError("call extend() with the prompt's target features before drafting")
        if level == 1:
            self.begin_tree()  # a new search: forget any earlier tree
            return self.root_probs[None]
        device = self.slot_feats.device
        nodes, tokens, parents = nodes.to(device), tokens.to(device), parents.to(device)
        f, s = nodes.numel(), self.slot_feats.shape[0]
        # Row 0 of these tables stands for the root (its feature; no drafted ancestors), row 1 + slot for a run node.
        parent_row = torch.where(parents > 0, self.node_slot[parents.clamp(min=0)], -1) + 1
        feats = torch.cat([self.root_feature[None], self.slot_feats])[parent_row]
        rows = torch.zeros(f, s + f, dtype=torch.bool, device=device)
        rows[:, :s] = torch.cat([torch.zeros(1, s, dtype=torch.bool, device=device), self.slot_rows])[parent_row]
        rows[torch.arange(f, device=device), s + torch.arange(f, device=device)] = True
        allowed = torch.cat([torch.ones(f, self.committed, dtype=torch.bool, device=device), rows], dim=1)
        # The root sits at position committed - 1, so a node at depth d sits at committed - 1 + d.
        positions = torch.full((f,), self.committed + level - 2, device=device)
        out = self.head(feats[None], tokens[None], positions, self.embed, allowed=allowed, cache=self.cache)[0]
        # Record the new slots.
        if int(nodes.max()) >= self.node_slot.numel():
            grow = torch.full((2 * int(nodes.max()) + 1,), -1, dtype=torch.long, device=device)
            grow[: self.node_slot.numel()] = self.node_slot
            self.node_slot = grow
        self.node_slot[nodes] = s + torch.arange(f, device=device)
        old = self.slot_rows
        self.slot_rows = torch.zeros(s + f, s + f, dtype=torch.bool, device=device)
        self.slot_rows[:s, :s] = old
        self.slot_rows[s:] = rows
        self.slot_feats = torch.cat([self.slot_feats, out])
        return self.draft_probs(out)

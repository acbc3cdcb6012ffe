"""Drafting with a block head (draft/dflash.py): one head call per step drafts every level, for every sequence.

Each row (sequence) keeps its committed context as keys and values per draft layer, written in place into one
cache [rows, kv_heads, capacity, d] per layer (a row's slots hold its positions in commit order; RoPE carries
the positions, so gaps are harmless). `extend` commits the rows' new target features and, in the same call,
drafts each row's block: the root, then k-1 mask tokens. Level L of a search reads the block's position L: the
same distribution for every node of the level, whatever its parent (the head's `follows_drafts` is False).
"""

from __future__ import annotations

import torch

from ..errors import InvalidValue
from .base import HeadError
from .batch_drafter import RowView, SoftmaxRows
from .drafter import sliced_lm_head


class BlockDrafter:
    """The batch drafter of a `DFlashHead` (the single-sequence `Drafter` is one row of it: `single`)."""

    def __init__(self, head, target_model):
        self.head = head
        self.embed = target_model.get_input_embeddings()
        self.dtype = next(head.parameters()).dtype
        self.lm_weight, self.lm_bias = sliced_lm_head(head, target_model, self.dtype)
        self.token_map = None if head.config.draft_vocab_size is None else head.d2t
        self.reset()

    def reset(self) -> None:
        """Drop every row (a new decoding run)."""
        self.keys: list[torch.Tensor | None] = [None] * len(self.head.layers)
        self.values: list[torch.Tensor | None] = [None] * len(self.head.layers)
        self.lengths: list[int] = []  # cache slots each row holds
        self.positions: list[int] = []  # each row's next committed position
        self.level_probs: list[torch.Tensor | None] = []  # each row's [k-1, V'] from its last block

    @property
    def capacity(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def _grow(self, rows: int, capacity: int) -> None:
        """Cache tensors of at least `rows` rows and `capacity` slots, the old entries kept."""
        layer = self.head.layers[0]
        device = self.head.d2t.device
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                have_rows, have_cap = (0, 0) if old is None else old.shape[::2]
                if have_rows >= rows and have_cap >= capacity:
                    continue
                new = torch.zeros(
                    max(rows, have_rows),
                    layer.kv_heads,
                    max(capacity, have_cap),
                    layer.head_dim,
                    dtype=self.dtype,
                    device=device,
                )
                if old is not None:
                    new[:have_rows, :, :have_cap] = old
                store[i] = new

    def add_row(self) -> int:
        self.lengths.append(0)
        self.positions.append(0)
        self.level_probs.append(None)
        self._grow(len(self.lengths), max(self.capacity, 1))
        return len(self.lengths) - 1

    def keep_rows(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.head.d2t.device)
        for store in (self.keys, self.values):
            for i, cache in enumerate(store):
                store[i] = cache[index] if cache is not None else None
        self.lengths = [self.lengths[r] for r in keep]
        self.positions = [self.positions[r] for r in keep]
        self.level_probs = [self.level_probs[r] for r in keep]

    def reserve(self, length: int) -> None:
        """Room for `length` context entries in every row, made now."""
        self._grow(len(self.lengths), length)

    @torch.inference_mode()
    def extend(self, rows: list[int], features: list[torch.Tensor], next_tokens: list[torch.Tensor], positions=None):
        """Commit target features ([m, F] each) and the token after each, for several rows, and draft each row's
        block rooted at its last token, all in one head call. positions: each row's [m] ascending positions from
        its next one on (a gap: positions the head is not shown); None: the next m positions."""
        head, device = self.head, self.head.d2t.device
        where = [
            self._positions(r, f.shape[0], None if positions is None else positions[i])
            for i, (r, f) in enumerate(zip(rows, features))
        ]
        counts = [f.shape[0] for f in features]
        context = head.context(torch.cat(features).to(device, self.dtype))[None]  # [1, M, H]
        slot_rows = torch.tensor([r for r, m in zip(rows, counts) for _ in range(m)], device=device)
        slots = torch.cat([torch.arange(self.lengths[r], self.lengths[r] + m) for r, m in zip(rows, counts)]).to(device)
        for r, m, pos in zip(rows, counts, where):
            self.lengths[r] += m
            self.positions[r] = int(pos[-1]) + 1
        self._grow(len(self.lengths), max(self.lengths[r] for r in rows))
        cos, sin = head.rotary(context, torch.cat(where).to(device)[None])
        index = torch.tensor(rows, device=device)
        kept = max(self.lengths[r] for r in rows)

        def context_kv(i):  # layer i's keys and values of the new entries go into the cache first
            k, v = head.layers[i].context_kv(context, cos, sin)  # [1, kv_heads, M, d]
            self.keys[i][slot_rows, :, slots] = k[0].transpose(0, 1)
            self.values[i][slot_rows, :, slots] = v[0].transpose(0, 1)
            return self.keys[i][index, :, :kept], self.values[i][index, :, :kept]

        roots = torch.stack([t[-1] for t in next_tokens]).to(device)
        x = head.block_inputs(roots, self.embed).to(self.dtype)  # [R, k, H]
        k = head.block_size
        block_pos = torch.tensor([self.positions[r] for r in rows], device=device)[:, None] + torch.arange(
            k, device=device
        )
        filled = (
            torch.arange(kept, device=device)[None]
            < torch.tensor([self.lengths[r] for r in rows], device=device)[:, None]
        )
        allowed = torch.cat(
            [filled[:, None].expand(-1, k, -1), torch.ones(len(rows), k, k, dtype=torch.bool, device=device)], 2
        )
        out = head.run_block(x, block_pos, context_kv, allowed)[:, 1:]  # [R, k-1, H]
        logits = torch.nn.functional.linear(out.to(self.lm_weight.dtype), self.lm_weight, self.lm_bias)
        probs = torch.softmax(logits.float(), dim=-1)
        for i, r in enumerate(rows):
            self.level_probs[r] = probs[i]

    def _positions(self, row: int, m: int, given) -> torch.Tensor:
        """Row's [m] new positions: `given` (checked: ascending from its next position on) or the next m."""
        if given is None:
            return torch.arange(self.positions[row], self.positions[row] + m)
        if given.shape[0] != m or int(given[0]) < self.positions[row]:
            raise InvalidValue(
                f"row {row}: positions must be {m} ascending from {self.positions[row]} on, got {given.tolist()}"
            )
        return given.cpu()

    def root_probs(self, row: int) -> torch.Tensor:
        """The distribution of the token after row's root (level 1)."""
        return self.level_probs[row][0]

    def begin_tree(self, row: int) -> None:
        """(Nothing to forget: a level reads the block drafted at the commit, never the drafted nodes.)"""

    def expand(self, requests) -> list[torch.Tensor]:
        """Each request's child distributions [F, V']: its level's distribution, for every frontier node."""
        out = SoftmaxRows()
        for r, nodes, _tokens, _parents, level in requests:
            probs = self.level_probs[r]
            if probs is None:
                raise RuntimeError("call extend() with the prompt's target features before drafting")
            if level > probs.shape[0]:
                raise HeadError(
                    f"a block head of block_size {self.head.block_size} drafts {probs.shape[0]} levels; cannot draft "
                    f"level {level} (use depth <= {probs.shape[0]})"
                )
            out.append(probs[level - 1].expand(nodes.numel(), -1))
        return out

    def view(self, row: int) -> RowView:
        return RowView(self, row)

    def single(self) -> RowView:
        """The `Drafter` of one sequence: a drafter with one row."""
        return RowView(self, self.add_row())

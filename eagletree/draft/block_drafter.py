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
from .drafter import draft_kernels, lm_probs, sliced_lm_head
from .lean_block import HeadBlock, lean_block


class BlockDrafter:
    """The batch drafter of a `DFlashHead` (the single-sequence `Drafter` is one row of it: `single`)."""

    def __init__(self, head, target_model, lean: bool = True):
        self.head = head
        self.embed = target_model.get_input_embeddings()
        self.dtype = next(head.parameters()).dtype
        self.lm_weight, self.lm_bias = sliced_lm_head(head, target_model, self.dtype)
        self.lm_packed, self.kernel_choice = draft_kernels(head, target_model, self.lm_weight, self.lm_bias)
        # the call as fused tensor operations where it reproduces the head's own (`lean_block`)
        packs = self.lm_packed is not None
        self.block = (lean and lean_block(head, self.embed, packs, self.kernel_choice)) or HeadBlock(head)
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
                    dtype=self.block.cache_dtype,
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
        head, device, block = self.head, self.head.d2t.device, self.block
        where = [
            self._positions(r, f.shape[0], None if positions is None else positions[i])
            for i, (r, f) in enumerate(zip(rows, features))
        ]
        counts = [f.shape[0] for f in features]
        context = block.context(torch.cat(features).to(device, self.dtype))  # [M, H]
        store = self._writer(rows, counts)
        for r, m, pos in zip(rows, counts, where):
            self.lengths[r] += m
            self.positions[r] = int(pos[-1]) + 1
        self._grow(len(self.lengths), max(self.lengths[r] for r in rows))
        context_positions = torch.cat(where).to(device)
        kept = max(self.lengths[r] for r in rows)
        read = self._reader(rows, kept)

        def context_kv(i):  # layer i's keys and values of the new entries go into the cache first
            k, v = block.context_kv(i, context, context_positions)  # [M, kv_heads, d]
            store(self.keys[i], k)
            store(self.values[i], v)
            return read(self.keys[i]), read(self.values[i])

        roots = torch.stack([t[-1] for t in next_tokens]).to(device)
        x = head.block_inputs(roots, self.embed).to(self.dtype)  # [R, k, H]
        block_pos = torch.tensor([self.positions[r] for r in rows], device=device)[:, None] + torch.arange(
            head.block_size, device=device
        )
        out = block.run_block(x, block_pos, context_kv, self._allowed(rows, kept))
        probs = self._probs(out[:, 1:])  # [R, k-1, V']
        for i, r in enumerate(rows):
            self.level_probs[r] = probs[i]

    def _writer(self, rows: list[int], counts: list[int]):
        """store(cache, entries [M, kv_heads, d]): the rows' new entries into a layer's cache [rows, kv_heads,
        capacity, d], each row's `counts` after its current ones (one row: a slice, copied in place)."""
        if len(rows) == 1:
            r, start = rows[0], self.lengths[rows[0]]
            return lambda cache, entries: cache[r, :, start : start + counts[0]].copy_(entries.transpose(0, 1))
        device = self.head.d2t.device
        slot_rows = torch.tensor([r for r, m in zip(rows, counts) for _ in range(m)], device=device)
        slots = torch.cat([torch.arange(self.lengths[r], self.lengths[r] + m) for r, m in zip(rows, counts)])

        def store(cache, entries):
            cache[slot_rows, :, slots.to(device)] = entries.to(cache.dtype)

        return store

    def _reader(self, rows: list[int], kept: int):
        """read(cache) -> the rows' first `kept` entries [R, kv_heads, kept, d] (ascending consecutive rows: a view)."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            first, last = rows[0], rows[0] + len(rows)
            return lambda cache: cache[first:last, :, :kept]
        index = torch.tensor(rows, device=self.head.d2t.device)
        return lambda cache: cache[index, :, :kept]

    def _allowed(self, rows: list[int], kept: int) -> torch.Tensor | None:
        """Which keys each block position sees, [R, k, kept + k]: a row's own entries and its whole block; None
        where every row holds `kept` entries (every position sees every key)."""
        if all(self.lengths[r] == kept for r in rows):
            return None
        device, k = self.head.d2t.device, self.head.block_size
        lengths = torch.tensor([self.lengths[r] for r in rows], device=device)
        filled = torch.arange(kept, device=device)[None] < lengths[:, None]
        return torch.cat(
            [filled[:, None].expand(-1, k, -1), torch.ones(len(rows), k, k, dtype=torch.bool, device=device)], 2
        )

    def _probs(self, out: torch.Tensor) -> torch.Tensor:
        """The blocks' outputs [R, k-1, H] -> their distributions over the draft vocabulary [R, k-1, V']."""
        rows = out.reshape(-1, out.shape[-1])
        return lm_probs(rows, self.lm_weight, self.lm_bias, self.lm_packed, self.kernel_choice).view(*out.shape[:2], -1)

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

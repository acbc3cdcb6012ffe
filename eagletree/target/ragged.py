"""Ragged batches: several sequences' new tokens in one forward pass, each attending to its own KV cache row.

A batch of sequences runs through the unmodified HF model as ONE row of R = sum n_b packed tokens, so the
linear layers (most of a pass's work) see only real tokens however unevenly the sequences' trees are sized.
Attention runs per sequence through `RAGGED`, a registered attention implementation: it scatters the packed
queries into an [S, heads, n_max, dim] block (S sequences, n_max = the largest n_b), attends to each
sequence's own cache row under its mask in one SDPA call, and gathers the outputs back. Which packed token
belongs where travels in a `Layout`, set for the duration of one forward (`ragged_forward`); without one the
implementation is the project's SDPA (`attention.sdpa_gqa_attention`), so a switched model runs as before
everywhere else.

`RaggedCache` holds every sequence's keys and values in preallocated rows [rows >= B, kv_heads, capacity, dim],
written by position: row b's committed entries are [0, length_b) and entries past it are never attended
(the masks end there), so dropping a rejected tree costs nothing and committing an accepted path moves only
that path's entries; a new row goes into room kept in the buffers, and dropping rows moves only the rows that
change places.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass

import torch

from ..errors import InvalidValue
from .attention import GQA_SDPA, RAGGED, sdpa_gqa_attention
from .forward import cache_kwarg, forward_takes

_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("eagletree_ragged_layout", default=None)


@dataclass
class Layout:
    """Where each packed token of one ragged forward sits.

    rows: [S] cache rows taking part (ascending); counts: new tokens per row; starts: each row's cache length
    before the pass. mask: [S, 1, n_max, kv] bool, row s's tokens over its cache entries [0, kv) (padding slots
    see entry 0).
    """

    rows: list[int]
    counts: list[int]
    starts: list[int]
    write_row: torch.Tensor  # [R] the cache row each new key is written to
    write_pos: torch.Tensor  # [R] and its position there
    mask: torch.Tensor
    padded: torch.Tensor | None = None  # [R] each packed token's index in the [S * n_max] block; None: no padding
    row_index: slice | torch.Tensor | None = None  # `rows` as an index into the cache rows (a slice when contiguous)
    single: tuple[int, int, int] | None = None  # one row: (row, first, end) of the positions it writes
    unmasked: bool = False  # every query sees every entry up to kv (SDPA without a mask)
    grouped_mask: torch.Tensor | None = None  # the mask as the lean layers' stacked query heads read it (cached)
    row_masks: list | None = None  # each row's own mask, None where it sees all its entries (cached: per-row attention)

    @property
    def kv(self) -> int:
        return self.mask.shape[-1]


def plan(lengths: list[int], rows: list[int], blocks: list[torch.Tensor], device) -> Layout:
    """The layout of a pass adding n_i new tokens to row rows[i] after its `lengths[row]` cached entries.

    blocks[i]: [n_i, m] bool with n_i <= m <= length + n_i: which of the row's last m entries (its n_i new ones
    last) each new token sees, every entry before them visible. [n_i, n_i]: causal-like among the new tokens;
    [n_i, length + n_i]: all entries spelled out."""
    if len(rows) != len(blocks) or not rows:
        raise InvalidValue(f"a ragged pass needs one block per row, got {len(rows)} rows and {len(blocks)} blocks")
    counts = [int(b.shape[0]) for b in blocks]
    if min(counts) < 1:
        raise InvalidValue(f"every row of a ragged pass adds at least one token, got counts {counts}")
    starts = [lengths[r] for r in rows]
    _check_blocks(rows, starts, counts, blocks)
    if len(rows) == 1:
        return _plan_one(rows[0], starts[0], blocks[0], device)
    n_max, kv = max(counts), max(s + n for s, n in zip(starts, counts))
    mask = torch.zeros(len(rows), 1, n_max, kv, dtype=torch.bool)
    mask[:, 0, :, 0] = True  # padding slots attend to something (their outputs are dropped)
    for s, (start, n, block) in enumerate(zip(starts, counts, blocks)):
        m = block.shape[1]
        mask[s, 0, :n, : start + n - m] = True
        mask[s, 0, :n, start + n - m : start + n] = block.cpu()
    q_row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(counts))
    q_slot = torch.cat([torch.arange(n) for n in counts])
    write_row = torch.tensor(rows)[q_row]
    write_pos = torch.tensor(starts)[q_row] + q_slot
    on = dict(device=device)
    layout = Layout(rows, counts, starts, write_row.to(**on), write_pos.to(**on), mask.to(**on))
    if min(counts) != n_max:
        layout.padded = (q_row * n_max + q_slot).to(**on)
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    layout.row_index = slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows, device=device)
    if len(rows) == 1:
        layout.single = (rows[0], starts[0], starts[0] + counts[0])
    layout.unmasked = bool(mask.all())
    return layout


def _check_blocks(rows, starts, counts, blocks) -> None:
    for row, start, n, block in zip(rows, starts, counts, blocks):
        if not n <= block.shape[1] <= start + n:
            raise InvalidValue(
                f"row {row}: a block of {n} new tokens is [{n}, m] with {n} <= m <= {start + n}, got "
                f"{list(block.shape)}"
            )


def _plan_one(row: int, start: int, block: torch.Tensor, device) -> Layout:
    """`plan`'s layout of one row (every drafting call of one sequence, every pass of a batch of one), built with
    fewer small tensor operations: everything before the block is visible, and no query is padded."""
    n, m = block.shape
    mask = torch.ones(1, 1, n, start + n, dtype=torch.bool)
    mask[0, 0, :, start + n - m :] = block.cpu()
    on = dict(device=device)
    layout = Layout(
        [row],
        [n],
        [start],
        torch.full((n,), row, **on),
        torch.arange(start, start + n, **on),
        mask.to(**on),
        row_index=slice(row, row + 1),
        single=(row, start, start + n),
    )
    layout.unmasked = bool(block.all())
    return layout


class RaggedCache:
    """KV cache rows of a ragged batch (one per sequence), preallocated and written by position.

    The HF model calls `update` once per layer during a `ragged_forward`; the buffers of a layer are made at its
    first update, in the key's dtype and device. `lengths[b]` is row b's count of valid entries.
    """

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.lengths: list[int] = []
        # layer -> [rows, kv_heads, capacity, dim]: rows >= batch (room kept for rows to come: a batch's sequences
        # end and new ones take their places all the time, and copying every row's cache for each costs more than a
        # decoding step)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.layout: Layout | None = None

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @torch.inference_mode()
    def add_row(self) -> int:
        """A new empty row (appended); returns its index. The buffers grow (doubling their rows) only when full; a
        reused row's old entries lie past its length 0, where no mask reaches."""
        self.lengths.append(0)
        for store in (self.keys, self.values):
            for layer, t in store.items():
                if t.shape[0] < self.batch:
                    grown = t.new_zeros(max(self.batch, 2 * t.shape[0]), *t.shape[1:])
                    grown[: t.shape[0]] = t
                    store[layer] = grown
        return self.batch - 1

    @torch.inference_mode()
    def keep_rows(self, keep: list[int]) -> None:
        """Keep only rows `keep` (in that order): row keep[i] becomes row i. Only the rows that change places are
        copied, in place."""
        if len(set(keep)) != len(keep) or any(not 0 <= r < self.batch for r in keep):
            raise InvalidValue(f"keep_rows needs distinct rows of the {self.batch}, got {keep}")
        self.lengths = [self.lengths[r] for r in keep]
        moved = [(i, r) for i, r in enumerate(keep) if i != r]
        if not moved:
            return
        for store in (self.keys, self.values):
            for t in store.values():
                dst, src = (torch.tensor(x, dtype=torch.long, device=t.device) for x in zip(*moved))
                t[dst] = t[src]  # (gathered first: safe whatever the order)

    @torch.inference_mode()
    def reserve(self, length: int, exact: bool = False) -> None:
        """Room for `length` entries in every row: the buffers grow when needed, doubling, or with exact=True to
        `length` rounded up to a multiple of 64 (a batch's need known ahead: one allocation, no room unused)."""
        if length <= self.capacity:
            return
        new = -(-length // 64) * 64 if exact else max(length, 2 * self.capacity)
        for store in (self.keys, self.values):
            for layer, t in store.items():
                grown = t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3])
                grown[:, :, : self.capacity] = t
                store[layer] = grown
        self.capacity = new

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write a pass's packed new keys and values [1, kv_heads, R, dim] at their rows' positions; return the
        taking-part rows' entries [S, kv_heads, kv, dim] (what the layout's mask covers)."""
        lay = self.layout
        if lay is None:
            raise RuntimeError("a RaggedCache is written only inside ragged_forward (it needs the batch's layout)")
        out = []
        for store, new in ((self.keys, key), (self.values, value)):
            buf = store.get(layer_idx)
            if buf is None:
                buf = store[layer_idx] = new.new_zeros(self.batch, new.shape[1], self.capacity, new.shape[3])
            if lay.single is not None:
                row, first, end = lay.single
                buf[row, :, first:end] = new[0]
            else:
                buf[lay.write_row, :, lay.write_pos] = new[0].transpose(0, 1)
            out.append(buf[lay.row_index, :, : lay.kv])
        return out[0], out[1]

    @torch.inference_mode()
    def commit(self, rows: list[int], starts: list[int], accepted: list[list[int]]) -> None:
        """After a pass wrote row r's tree at [start, start + n): keep its accepted nodes' entries (node indices,
        ascending, the root first) at [start, start + len(accepted)); the rest is dropped."""
        src_row, src, dst = [], [], []
        for r, start, nodes in zip(rows, starts, accepted):
            self.lengths[r] = start + len(nodes)
            moved = [(start + v, start + i) for i, v in enumerate(nodes) if v != i]
            src_row += [r] * len(moved)
            src += [s for s, _ in moved]
            dst += [d for _, d in moved]
        if not src:
            return
        index = {}  # device -> (rows, sources, destinations), made once for all the layers' buffers
        for store in (self.keys, self.values):
            for buf in store.values():
                if buf.device not in index:
                    index[buf.device] = tuple(
                        torch.tensor(x, dtype=torch.long, device=buf.device) for x in (src_row, src, dst)
                    )
                r, s, d = index[buf.device]
                buf[r, :, d] = buf[r, :, s]  # gathered first (a copy), so overlapping ranges are safe


def ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Attention of a ragged forward (query [1, heads, R, dim] packed; key/value [S, kv_heads, kv, dim] per row),
    or, outside one, the project's SDPA."""
    lay = _LAYOUT.get()
    if lay is None:
        return sdpa_gqa_attention(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    heads, dim = query.shape[1], query.shape[3]
    s, n_max = len(lay.rows), lay.mask.shape[2]
    groups = heads // key.shape[1]
    on_cpu = query.device.type == "cpu"
    if on_cpu and s > 1 and n_max > PER_ROW_BLOCK:
        return _attend_per_row(lay, query, key, value, scaling, groups > 1), None
    if lay.padded is None:  # every row adds n_max tokens: the packed row is the block, reshaped
        q = query.view(heads, s, n_max, dim).transpose(0, 1)
    else:
        flat = query.new_zeros(s * n_max, heads, dim).index_copy_(0, lay.padded, query[0].transpose(0, 1))
        q = flat.view(s, n_max, heads, dim).transpose(1, 2)
    if groups > 1 and not on_cpu:  # (CUDA with a mask and enable_gqa falls back to the math kernel)
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=None if lay.unmasked else lay.mask, scale=scaling, enable_gqa=groups > 1 and on_cpu
    )  # [S, heads, n_max, dim]
    out = out.transpose(1, 2).reshape(s * n_max, heads, dim)  # [S n_max, heads, dim]
    if lay.padded is not None:
        out = out.index_select(0, lay.padded)
    return out[None], None  # [1, R, heads, dim]


# On a CPU, a pass of several rows with a block longer than this (a prompt's) attends row by row: one SDPA call
# per row over its own entries, as a pass of that row alone would, where one call over the padded
# [S, n_max, kv] block computes (and allocates) every row up to the longest prompt's size: 32 MT-bench prompts
# of 44-402 tokens prefilled 8 at a time took 2.84-2.90 s padded, 2.46-2.54 s row by row (2.45-2.57 one at a time).
# Larger trees gain too (8 rows, one tree of 20 nodes and seven of 3: 59-61 ms against 78-79 a pass), and
# even ones cost the same (8 trees of 20 or 40 nodes, 2 of 30 or 60). Shorter blocks, a pass's usual trees, go
# through the lean layers' products (`target.lean`).
PER_ROW_BLOCK = 16


def _attend_per_row(lay: Layout, query, key, value, scaling, gqa: bool) -> torch.Tensor:
    """`ragged_attention`'s output [1, R, heads, dim], each row's queries (query [1, heads, R, dim] packed) over
    its own entries [0, start + n) under its own mask (none where it sees them all), one SDPA call per row."""
    if lay.row_masks is None:  # (made once per pass, for every layer)
        cuts = [lay.mask[b : b + 1, :, :n, : start + n] for b, (start, n) in enumerate(zip(lay.starts, lay.counts))]
        lay.row_masks = [None if bool(m.all()) else m for m in cuts]
    outs, offset = [], 0
    for b, (start, n) in enumerate(zip(lay.starts, lay.counts)):
        kv = start + n
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, offset : offset + n],
                key[b : b + 1, :, :kv],
                value[b : b + 1, :, :kv],
                attn_mask=lay.row_masks[b],
                scale=scaling,
                enable_gqa=gqa,
            )
        )
        offset += n
    return torch.cat(outs, 2).transpose(1, 2)


def register() -> None:
    """Make `RAGGED` a known attention implementation (with SDPA's mask when no layout is set), once per process."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(RAGGED, ragged_attention)
    AttentionMaskInterface.register(RAGGED, sdpa_mask)


_SWITCHABLE = ("sdpa", GQA_SDPA, RAGGED, "eager")


def use_ragged(model) -> None:
    """Switch a model to `RAGGED` (outside a ragged forward it runs the project's SDPA, as before)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == RAGGED:
        return
    if impl not in _SWITCHABLE:
        from .loading import TargetError

        raise TargetError(
            f"attention implementation {impl!r} cannot decode ragged batches; load the model with "
            "attn_implementation='sdpa'"
        )
    register()
    model.set_attn_implementation(RAGGED)


def use_ragged_layer(layer, *configs) -> None:
    """The same for one decoder layer built outside a model (a draft head's) and the configs its masks read."""
    register()
    for config in (layer.self_attn.config, *configs):
        config._attn_implementation = RAGGED


def sliding_window(model) -> int | None:
    """The smallest sliding window of the model's attention layers (as its own KV cache sets them up), or None.
    Read once per config object (every pass asks; a config is unhashable, so it is kept by id with a weak
    reference that tells a live config from a freed one whose id was reused)."""
    config = model.config
    known = _WINDOWS.get(id(config))
    if known is None or known[0]() is not config:
        from transformers import DynamicCache

        windows = [getattr(layer, "sliding_window", None) for layer in DynamicCache(config=config).layers]
        known = _WINDOWS[id(config)] = (weakref.ref(config), min((w for w in windows if w), default=None))
    return known[1]


_WINDOWS: dict[int, tuple[weakref.ref, int | None]] = {}


class ragged_pass:
    """Context manager: `layout` is the current ragged forward's (for `ragged_attention` and the cache)."""

    def __init__(self, cache: RaggedCache, layout: Layout):
        self.cache, self.layout = cache, layout

    def __enter__(self):
        self.cache.layout = self.layout
        self.token = _LAYOUT.set(self.layout)
        return self.layout

    def __exit__(self, exc_type, *exc):
        _LAYOUT.reset(self.token)
        self.cache.layout = None
        if exc_type is None:  # the new entries are now in the rows (the caller commits or drops them)
            for r, n in zip(self.layout.rows, self.layout.counts):
                self.cache.lengths[r] += n
        return False


@dataclass
class RaggedOutput:
    logits: torch.Tensor | None  # [R, vocab] float32 (None when not asked for)
    hidden: torch.Tensor  # [R, H] last-layer (post-norm) hidden states: the draft head's features
    layer_hidden: dict[int, torch.Tensor] | None  # layer index -> [R, H]
    layout: Layout

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """A packed [R, ...] tensor -> one [n_b, ...] piece per row of the pass."""
        return list(tensor.split(self.layout.counts))


@torch.inference_mode()
def ragged_forward(model, cache: RaggedCache, rows, tokens, blocks, positions, layers=None, logits=True, lean=None):
    """One forward of the model over each row's new tokens (tokens[i] [n_i] ids, blocks[i] [n_i, n_i] bool,
    positions[i] [n_i] rotary positions) on top of cache rows `rows`; each row's cache grows by n_i entries.
    `layers` also returns those decoder layers' outputs (EAGLE-3); logits=False skips the lm_head.

    lean: the model's `LeanModel` to run the pass through (`target.lean.lean_model`); None: the transformers path."""
    device = next(model.parameters()).device
    layout = plan(cache.lengths, list(rows), list(blocks), device)
    window = sliding_window(model)
    if window is not None and layout.kv > window:
        from .loading import TargetError

        raise TargetError(
            f"context of {layout.kv} tokens reached the sliding window ({window}): "
            "tree verification over a rolling cache is not supported"
        )
    cache.reserve(max(layout.kv, 1))
    input_ids = torch.cat([t.reshape(-1) for t in tokens]).to(device)
    position_ids = torch.cat([p.reshape(-1) for p in positions]).to(device)
    if lean is not None:
        with ragged_pass(cache, layout):
            out_logits, hidden, layer_hidden = lean(cache, layout, input_ids, position_ids, layers, logits)
        return RaggedOutput(out_logits, hidden, layer_hidden, layout)
    extra = {} if logits or not forward_takes(model, "logits_to_keep") else {"logits_to_keep": 1}  # (features only)
    with ragged_pass(cache, layout):
        out = model(
            input_ids=input_ids[None],
            attention_mask=layout.mask,
            position_ids=position_ids[None],
            use_cache=True,
            output_hidden_states=True,
            **{cache_kwarg(model): cache},
            **extra,
        )
    states = out.hidden_states
    layer_hidden = {i: states[i + 1][0] for i in layers} if layers else None
    return RaggedOutput(out.logits[0].float() if logits else None, states[-1][0], layer_hidden, layout)


def causal_block(n: int) -> torch.Tensor:
    """[n, n] bool: plain left-to-right attention among n new tokens."""
    return torch.ones(n, n, dtype=torch.bool).tril()

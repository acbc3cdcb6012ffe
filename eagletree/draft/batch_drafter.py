"""Drafting for a batch of sequences: one head call per level for every sequence's frontier.

A `BatchDrafter` keeps one row per sequence (the head's KV cache of its committed prefix, and during a step
its drafted tree). `extend` commits target features for several rows in one call; `expand` drafts one search
level for several rows in one call. EAGLE-1/2 and EAGLE-3 heads run as a ragged batch (`target.ragged`:
the rows' new tokens packed in one row, each attending to its own cache row under its tree mask), so a level
costs one call of the head's layer and one lm_head product however many sequences draft; heads whose
drafter makes no per-level head call (Medusa) keep one reference drafter per row (`PerRowDrafter`).
`view(row)` is one row as a `Drafter` (for `inspect_step`).
"""

from __future__ import annotations

import torch

from ..errors import InvalidValue
from ..packing import weight_key
from ..target.ragged import RaggedCache, causal_block, plan, ragged_pass, use_ragged_layer
from .drafter import TreeDrafter
from .lean import lean_forward, lean_layer

Request = tuple  # (row, nodes [F], tokens [F], parents [F], level): one row's frontier, as `Drafter.__call__` takes


class SoftmaxRows(list):
    """A level's distributions, each row a softmax of the head's logits: the searches' top-k read-back checks them
    for NaN only (`search.readback.top_k_lists`)."""

    softmax_rows = True


class _Row:
    """One sequence's drafting state: its committed length, the root's feature and child distribution, and the
    tree drafted this step (node id -> slot, each slot's output feature and its ancestor row over the slots)."""

    def __init__(self):
        self.committed = 0  # cache entries of the committed prefix
        self.position = 0  # the next committed position (past `committed` where positions were skipped)
        self.root_feature = self.root_probs = None
        self.begin_tree()

    def begin_tree(self) -> None:
        self.node_slot: dict[int, int] = {}
        self.slot_feats: list[torch.Tensor] = []  # one [f, H] tensor per drafted level
        self.slot_rows = torch.zeros(0, 0, dtype=torch.bool)


class RaggedTreeDrafter:
    """The batch form of `TreeDrafter` (same head, same lm_head slice and kernels): ragged head calls."""

    def __init__(self, head, target_model, lean: bool = True):
        self.one = TreeDrafter(head, target_model)  # its draft_probs: the lm_head slice, packed where measured faster
        self.head, self.embed, self.dtype = head, self.one.embed, self.one.dtype
        self.token_map = self.one.token_map
        use_ragged_layer(head.layer, head.layer_config)
        # the layer as fused tensor operations where it reproduces the head's own forward (`lean`)
        self.lean = lean_layer(head, self.embed, self.one.kernel_choice) if lean else None
        self.cache = RaggedCache()
        self.rows: list[_Row] = []

    def add_row(self) -> int:
        self.rows.append(_Row())
        return self.cache.add_row()

    def reset(self) -> None:
        """Drop every row (a new decoding run): the head's layer, lm_head slice and kernels stay."""
        self.cache = RaggedCache()
        self.rows = []

    def keep_rows(self, keep: list[int]) -> None:
        self.rows = [self.rows[r] for r in keep]
        self.cache.keep_rows(keep)

    def reserve(self, length: int) -> None:
        """Room for `length` entries in every row's head cache, made now (`RaggedCache.reserve`, exact)."""
        self.cache.reserve(length, exact=True)

    def _call(self, rows: list[int], feats, tokens, positions, blocks) -> torch.Tensor:
        """One head call over the rows' packed inputs; returns the packed output features [R, H]."""
        device = feats[0].device
        layout = plan(self.cache.lengths, rows, blocks, device)
        self.cache.reserve(layout.kv)
        if self.lean is not None:
            feats, tokens, positions = torch.cat(feats), torch.cat(tokens).to(device), torch.cat(positions).to(device)
            return lean_forward(self.head, self.lean, self.embed, self.cache, layout, feats, tokens, positions)
        with ragged_pass(self.cache, layout):
            out = self.head(
                torch.cat(feats)[None],
                torch.cat(tokens).to(device)[None],
                torch.cat(positions).to(device),
                self.embed,
                allowed=layout.mask[:, 0],
                cache=self.cache,
            )
        return out[0]

    @torch.inference_mode()
    def extend(self, rows: list[int], features: list[torch.Tensor], next_tokens: list[torch.Tensor], positions=None):
        """Commit target features ([m, F] each) and the token after each, for several rows in one call; drops
        their drafted trees. Each row's root distribution is then the head's prediction after its last position.
        positions: each row's [m] ascending positions, past its committed ones (a gap: positions the head is not
        shown); None: the next m positions."""
        feats, where = [], []
        for i, (r, f) in enumerate(zip(rows, features)):
            row = self.rows[r]
            self.cache.lengths[r] = row.committed  # drop the last step's tree
            feats.append(self.head.fuse(f.to(self.dtype)))
            if positions is None:
                pos = torch.arange(row.position, row.position + f.shape[0])
            else:
                pos = positions[i]
                if pos.shape[0] != f.shape[0] or int(pos[0]) < row.position:
                    raise InvalidValue(
                        f"row {r}: positions must be {f.shape[0]} ascending from {row.position} on, got {pos.tolist()}"
                    )
            where.append(pos)
        out = self._call(rows, feats, next_tokens, where, [causal_block(f.shape[0]) for f in feats])
        last = torch.stack([piece[-1] for piece in out.split([f.shape[0] for f in feats])])
        probs = self.one.draft_probs(last)
        for i, (r, f) in enumerate(zip(rows, feats)):
            row = self.rows[r]
            row.committed += f.shape[0]
            row.position = int(where[i][-1]) + 1
            row.root_feature, row.root_probs = last[i], probs[i]
            row.begin_tree()

    def root_probs(self, row: int) -> torch.Tensor:
        """The distribution of the token after row's root (level 1)."""
        return self.rows[row].root_probs

    def begin_tree(self, row: int) -> None:
        """Forget row's drafted tree (not its committed prefix)."""
        self.cache.lengths[row] = self.rows[row].committed
        self.rows[row].begin_tree()

    @torch.inference_mode()
    def expand(self, requests: list[Request]) -> list[torch.Tensor]:
        """One search level for several rows in one head call: each request's child distributions [F, V']."""
        out = SoftmaxRows([None] * len(requests))
        called = []  # (request index, row, inputs) of the rows past level 1
        for i, (r, nodes, tokens, parents, level) in enumerate(requests):
            row = self.rows[r]
            if row.root_probs is None:
                raise RuntimeError("call extend() with the prompt's target features before drafting")
            if level == 1:
                self.begin_tree(r)  # a new search: forget any earlier tree
                out[i] = row.root_probs[None]
            else:
                called.append((i, r, self._level_inputs(row, nodes, tokens, parents, level)))
        if called:
            feats = self._call([r for _, r, _ in called], *(list(x) for x in zip(*(x[:4] for _, _, x in called))))
            counts = [inputs[0].shape[0] for _, _, inputs in called]
            probs = self.one.draft_probs(feats).split(counts)
            for (i, r, inputs), piece, p in zip(called, feats.split(counts), probs):
                self._record(self.rows[r], inputs[4], inputs[3], piece)
                out[i] = p
        return out

    def _level_inputs(self, row: _Row, nodes, tokens, parents, level):
        """(parent features [f, H], tokens, positions, block [f, slots + f] over the tree's entries (the committed
        ones all visible), node ids) of one row."""
        nodes, parents = nodes.tolist(), parents.tolist()
        f, s = len(nodes), row.slot_rows.shape[0]
        picks = torch.tensor([row.node_slot[u] + 1 if u > 0 else 0 for u in parents])
        table = torch.cat([row.root_feature[None], *row.slot_feats])  # row 0: the root; 1 + slot: a tree node
        feats = table[picks]
        block = torch.zeros(f, s + f, dtype=torch.bool)
        block[:, :s] = torch.cat([torch.zeros(1, s, dtype=torch.bool), row.slot_rows])[picks]  # the ancestors
        block[torch.arange(f), s + torch.arange(f)] = True
        # The root sits at the last committed position, so a node at depth d (level d + 1) sits d past it.
        positions = torch.full((f,), row.position + level - 2)
        return feats, tokens, positions, block, nodes

    @staticmethod
    def _record(row: _Row, nodes: list[int], tree_rows: torch.Tensor, out: torch.Tensor) -> None:
        """The new slots of a drafted level: their ids, ancestor rows over the slots ([f, s + f]) and features."""
        s, f = row.slot_rows.shape[0], len(nodes)
        grown = torch.zeros(s + f, s + f, dtype=torch.bool)
        grown[:s, :s] = row.slot_rows
        grown[s:] = tree_rows
        for j, v in enumerate(nodes):
            row.node_slot[v] = s + j
        row.slot_rows = grown
        row.slot_feats.append(out)

    def view(self, row: int) -> RowView:
        return RowView(self, row)


class PerRowDrafter:
    """A batch drafter of one reference drafter per row: for heads whose levels make no head call (Medusa)."""

    def __init__(self, head, target_model):
        self.head, self.target = head, target_model
        self.drafters: list = []
        self.token_map = None

    def add_row(self) -> int:
        self.drafters.append(self.head.make_drafter(self.target))
        self.token_map = self.drafters[-1].token_map
        return len(self.drafters) - 1

    def keep_rows(self, keep: list[int]) -> None:
        self.drafters = [self.drafters[r] for r in keep]

    def reset(self) -> None:
        self.drafters = []

    def reserve(self, length: int) -> None:
        """(Each reference drafter keeps its own state.)"""

    def extend(self, rows, features, next_tokens, positions=None) -> None:
        """(positions: unused, these heads draft from the last feature alone.)"""
        for r, f, t in zip(rows, features, next_tokens):
            self.drafters[r].extend(f, t)

    def begin_tree(self, row: int) -> None:
        self.drafters[row].begin_tree()

    def expand(self, requests: list[Request]) -> list[torch.Tensor]:
        return [self.drafters[r](nodes, tokens, parents, level) for r, nodes, tokens, parents, level in requests]

    def view(self, row: int):
        return self.drafters[row]


class RowView:
    """One row of a batch drafter as a `Drafter`."""

    def __init__(self, batch: RaggedTreeDrafter, row: int):
        self.batch, self.row = batch, row
        self.token_map = batch.token_map

    def extend(self, features, next_tokens):
        self.batch.extend([self.row], [features], [next_tokens])
        return self.batch.root_probs(self.row)

    def begin_tree(self) -> None:
        self.batch.begin_tree(self.row)

    def __call__(self, nodes, tokens, parents, level):
        return self.batch.expand([(self.row, nodes, tokens, parents, level)])[0]


def make_batch_drafter(head, target_model):
    """The batch drafter of a head (its `make_batch_drafter`): ragged head calls where the head batches its levels,
    one reference drafter per row otherwise."""
    return head.make_batch_drafter(target_model)


def drafter_key(head, target_model) -> tuple:
    """Changes when what a batch drafter was built from changes: the head's modules or any of its weights or
    buffers (in place or replaced), the target's embedding or lm_head (the drafter reads both). (A change made
    through `.data` escapes it: such a change is not counted as one by PyTorch either.)"""
    own = [head, target_model.get_input_embeddings(), target_model.get_output_embeddings()]
    own = [part for part in own if part is not None]
    modules = tuple(id(m) for part in own for m in part.modules())
    tensors = [t for part in own for t in (*part.parameters(), *part.buffers())]
    return modules + tuple(weight_key(t) for t in tensors)

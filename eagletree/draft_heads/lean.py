"""A draft head's decoder layer as a handful of tensor operations: the drafter's fast path.

A drafting level runs the head's one decoder layer over a few dozen rows at most, so on a CPU the framework's
per-call work (module dispatch, mask and rotary construction, cache bookkeeping) costs more than the
arithmetic. `LeanLayer` computes the same layer from the same weights with the projections fused (q, k and v
in one product; gate and up in another), rotary embeddings read from a table, keys and values written by
position into the drafter's `RaggedCache`, and attention over short query blocks as two batched products and
a softmax (the CPU's SDPA kernel is several times slower than that for a handful of bf16 queries over a long
context; long blocks, a prompt's, still go through SDPA).

It covers the LLaMA family's layer (attention with q/k/v/o projections, optional per-head q/k norms, a
gated MLP, a post-attention norm, residual adds). `lean_layer(head)` builds one and checks it against the
head's own forward on a probe; a layer it does not reproduce there (another architecture) keeps the
transformers path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..packing import is_packed, pack_weight, packed_linear, packing_problem
from ..target.ragged import Layout, RaggedCache, causal_block, plan, ragged_attention, ragged_pass

# Query blocks up to this many rows per sequence attend by plain products (a drafting level, a catch-up);
# longer ones (a prompt) through SDPA, which is faster there.
SHORT_BLOCK = 16
# How far the lean layer's output may be from the head's own forward on the probe, relative to its scale.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


class LeanUnsupported(Exception):
    """The head's layer is not one `LeanLayer` computes (the caller keeps the transformers path)."""


class LeanLinear:
    """y = x W^T + b from one or more nn.Linear fused along their outputs, through a oneDNN-packed copy of W
    at the row counts where `choice` (the drafter's measured KernelChoice; None: always) packs."""

    def __init__(self, linears: list[nn.Module], pack: bool, choice=None):
        self.weight = torch.cat([m.weight.detach() for m in linears]).contiguous()
        biases = [m.bias for m in linears]
        if any(b is not None for b in biases):
            self.bias = torch.cat(
                [b.detach() if b is not None else m.weight.new_zeros(m.out_features) for m, b in zip(linears, biases)]
            )
        else:
            self.bias = None
        self.packed = pack_weight(self.weight) if pack else None
        self.choice = choice

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (self.choice is None or self.choice.use_packed(x.shape[0])):
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class LeanLayer:
    """The head's decoder layer over packed rows: (attention input [R, D], residual [R, H], positions [R]) on top of
    the cache rows of a `Layout` -> output features [R, H]."""

    def __init__(self, head, choice=None):
        layer = head.layer
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        needed = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        needed += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        missing = [n for owner, n in needed if not isinstance(getattr(owner, n, None), nn.Linear)]
        if missing or not hasattr(mlp, "act_fn") or not hasattr(layer, "post_attention_layernorm"):
            raise LeanUnsupported(f"{type(layer).__name__} lacks {missing or 'act_fn / post_attention_layernorm'}")
        rope_type = str(getattr(head.rotary, "rope_type", "default"))
        if "dynamic" in rope_type or "longrope" in rope_type:  # (their tables change with the context length)
            raise LeanUnsupported(f"rope_type {rope_type!r} rescales with the context length")
        if getattr(attn, "sliding_window", None) or getattr(attn, "sinks", None) is not None:
            raise LeanUnsupported("sliding-window or sink attention")
        pack = is_packed(head) and packing_problem(head) is None
        self.qkv = LeanLinear([attn.q_proj, attn.k_proj, attn.v_proj], pack, choice)
        self.o = LeanLinear([attn.o_proj], pack, choice)
        self.gate_up = LeanLinear([mlp.gate_proj, mlp.up_proj], pack, choice)
        self.down = LeanLinear([mlp.down_proj], pack, choice)
        self.dim = int(attn.head_dim)
        self.heads = attn.q_proj.out_features // self.dim
        self.kv_heads = attn.k_proj.out_features // self.dim
        self.scaling = float(attn.scaling)
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (self.q_norm is None) != (self.k_norm is None):
            raise LeanUnsupported("a per-head norm on only one of q and k")
        self.act, self.norm = mlp.act_fn, layer.post_attention_layernorm
        self.inter = mlp.gate_proj.out_features
        self.rotary = head.rotary
        self.dtype = self.qkv.weight.dtype
        self.cos = self.sin = torch.zeros(0, self.dim)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [R, dim] of the rows' positions, from a table grown (doubling) as positions grow."""
        top = int(positions.max()) + 1
        if top > self.cos.shape[0]:
            size = max(top, 2 * self.cos.shape[0], 256)
            ref = torch.zeros(1, 1, dtype=torch.float32, device=positions.device)
            cos, sin = self.rotary(ref, torch.arange(size, device=positions.device)[None])
            self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)
        return self.cos[positions], self.sin[positions]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    @torch.inference_mode()
    def __call__(self, attn_in, residual, positions, cache: RaggedCache, layout: Layout) -> torch.Tensor:
        r = attn_in.shape[0]
        qk, v = self.qkv(attn_in).split([(self.heads + self.kv_heads) * self.dim, self.kv_heads * self.dim], -1)
        qk, v = qk.view(r, self.heads + self.kv_heads, self.dim), v.view(r, self.kv_heads, self.dim)
        if self.q_norm is not None:  # (per-head norms: Qwen3)
            q, k = qk.split([self.heads, self.kv_heads], 1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], 1)
        q, k = self._rope(qk, *self._rotary(positions)).split([self.heads, self.kv_heads], 1)
        # Attention runs in fp32 whatever the layer's precision: a bf16 product of a new shape (the context grows
        # every step) builds a oneDNN kernel first, which costs about a millisecond on a CPU.
        q, k, v = q.float(), k.float(), v.float()
        keys, values = cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0)  # [S, kv_heads, kv, dim]
        if layout.mask.shape[2] <= SHORT_BLOCK:
            out = self._attend(q, keys, values, layout)
        else:
            out = ragged_attention(None, q.transpose(0, 1)[None], keys, values, None, scaling=self.scaling)[0][0]
        h = residual + self.o(out.reshape(r, self.heads * self.dim).to(self.dtype))
        gate, up = self.gate_up(self.norm(h)).split(self.inter, -1)
        return h + self.down(self.act(gate) * up)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: Layout) -> torch.Tensor:
        """Attention of short query blocks: q [R, heads, dim] packed -> [R, heads, dim]; each row's queries over its
        own entries under the layout's mask, the query heads sharing a key/value head stacked as one block."""
        s, n_max, kv = len(layout.rows), layout.mask.shape[2], layout.kv
        groups = self.heads // self.kv_heads
        if layout.padded is not None:
            q = q.new_zeros(s * n_max, self.heads, self.dim).index_copy_(0, layout.padded, q)
        # [S, n, kv_heads, groups, dim] -> [S, kv_heads, groups * n, dim]
        block = q.view(s, n_max, self.kv_heads, groups, self.dim).permute(0, 2, 3, 1, 4)
        block = block.reshape(s, self.kv_heads, groups * n_max, self.dim)
        scores = torch.matmul(block, keys.transpose(-1, -2)).view(s, self.kv_heads, groups, n_max, kv) * self.scaling
        if not layout.unmasked:
            scores = scores.masked_fill(~layout.mask[:, :, None], float("-inf"))
        probs = scores.softmax(-1).view(s, self.kv_heads, groups * n_max, kv)
        out = torch.matmul(probs, values).view(s, self.kv_heads, groups, n_max, self.dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(s * n_max, self.heads, self.dim)
        return out if layout.padded is None else out.index_select(0, layout.padded)


def lean_forward(head, lean: LeanLayer, embed, cache: RaggedCache, layout: Layout, feats, tokens, positions):
    """The head's next features [R, H] for packed rows (feats [R, H] as `head.forward` reads them, tokens [R],
    positions [R]) through `lean`, writing the rows' keys and values into `cache` at the layout's positions."""
    attn_in, residual = head.layer_inputs(feats, tokens, embed)
    with ragged_pass(cache, layout):
        return lean(attn_in, residual, positions, cache, layout)


@torch.inference_mode()
def lean_layer(head, embed, choice=None) -> LeanLayer | None:
    """The lean form of `head`'s layer, or None when its architecture is not covered or the lean output differs
    from the head's own forward on a probe (5 positions with a cache, 3 more with a tree mask) by more than the
    precision's tolerance."""
    try:
        lean = LeanLayer(head, choice)
    except LeanUnsupported:
        return None
    param = next(head.parameters())
    generator = torch.Generator().manual_seed(0)
    feats = torch.randn(8, head.config.hidden_size, generator=generator).to(param)
    tokens = torch.randint(0, embed.num_embeddings, (8,), generator=generator).to(param.device)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 0, its children 1 and 2
    allowed = torch.cat([torch.ones(3, 5, dtype=torch.bool), tree], dim=1).to(param.device)
    hf_cache = head.new_cache()
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6], device=param.device)
    expected = torch.cat(
        [
            head(feats[None, :5], tokens[None, :5], positions[:5], embed, cache=hf_cache)[0],
            head(feats[None, 5:], tokens[None, 5:], positions[5:], embed, allowed=allowed, cache=hf_cache)[0],
        ]
    )
    cache = RaggedCache(capacity=16)
    cache.add_row()
    got = []
    for part, block in ((slice(0, 5), causal_block(5)), (slice(5, 8), tree)):
        layout = plan(cache.lengths, [0], [block], param.device)
        got.append(lean_forward(head, lean, embed, cache, layout, feats[part], tokens[part], positions[part]))
    error = (torch.cat(got).float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-6)
    return lean if float(error) <= TOLERANCE.get(param.dtype, 3e-2) else None

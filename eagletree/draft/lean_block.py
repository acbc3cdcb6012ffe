"""A block head's drafting call as a handful of tensor operations: the block drafter's fast path.

One call of a block head (draft/dflash.py) runs its few layers over the step's new context entries and the block (8
rows for one sequence): on a CPU its time goes to the products' kernels and to the framework's per-operation work,
not to arithmetic. `LeanBlock` computes the same call from the same weights with the products fused (the context's k
and v in one; the block's q, k and v in one; gate and up in one), through oneDNN-packed copies where the drafter
packs (a bf16 head on a CPU with native bf16: its measured kernel choice), RMS norms as one fused call, RoPE read
from a table (`RopeTable`), and attention in fp32 through SDPA over the row's cached context and the block (a bf16
product of a shape not seen before builds a oneDNN kernel first, and the context grows every step).

`HeadBlock` is the same three calls through the head's own modules: the reference `lean_block` checks a
`LeanBlock` against on a probe, and the path a head keeps where the check fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..target.lean import TOLERANCE, LeanLinear, RopeTable, lean_norm, rope


class HeadBlock:
    """The block call through the head's own modules: `context`, `context_kv` and `run_block` (see `LeanBlock`)."""

    def __init__(self, head):
        self.head = head
        self.cache_dtype = next(head.parameters()).dtype

    def context(self, features: torch.Tensor) -> torch.Tensor:
        return self.head.context(features)

    def context_kv(self, i: int, context: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.head.rotary(context[None], positions[None])
        keys, values = self.head.layers[i].context_kv(context[None], cos, sin)  # [1, kv_heads, M, d]
        return keys[0].transpose(0, 1), values[0].transpose(0, 1)

    def run_block(self, x, positions, context_kv, allowed) -> torch.Tensor:
        return self.head.run_block(x, positions, context_kv, allowed)


def block_norm(norm):
    """An RMS norm as one fused call: `lean_norm`'s (bit for bit the module's) where it has one, else F.rms_norm with
    the module's weight and epsilon in the module's precision (a bf16 norm that rounds between its steps: close,
    not exact, which the probe of `lean_block` bounds), else the module's forward."""
    fused = lean_norm(norm)
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if fused != norm.forward or not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
        return fused
    return lambda x: F.rms_norm(x, (weight.shape[-1],), weight, eps)


def head_norms(q_norm, k_norm, heads: int, kv_heads: int):
    """The per-head RMS norms of q and k over rows [n, heads + kv_heads, d] (q's heads, then k's) as one fused norm
    and one product with their weights stacked per head, where both are RMS norms of one epsilon; else each
    norm on its part."""
    weights = [getattr(m, "weight", None) for m in (q_norm, k_norm)]
    eps = {getattr(m, "variance_epsilon", getattr(m, "eps", None)) for m in (q_norm, k_norm)}
    if all(isinstance(w, torch.Tensor) and w.dim() == 1 for w in weights) and len(eps) == 1:
        (epsilon,) = eps
        if isinstance(epsilon, float):
            stacked = torch.cat([weights[0].detach().expand(heads, -1), weights[1].detach().expand(kv_heads, -1)])
            return lambda qk: F.rms_norm(qk, (stacked.shape[-1],), None, epsilon) * stacked
    q_fused, k_fused = block_norm(q_norm), block_norm(k_norm)
    return lambda qk: torch.cat([q_fused(qk[:, :heads]), k_fused(qk[:, heads:])], 1)


class _LeanLayer:
    """One draft layer of a block head (`dflash.BlockLayer`) as fused products."""

    def __init__(self, layer, linear):
        self.heads, self.kv_heads, self.dim = layer.heads, layer.kv_heads, layer.head_dim
        self.context_kv = linear([layer.k_proj, layer.v_proj])
        self.qkv = linear([layer.q_proj, layer.k_proj, layer.v_proj])
        self.o = linear([layer.o_proj])
        self.gate_up = linear([layer.gate_proj, layer.up_proj])
        self.down = linear([layer.down_proj])
        self.inter = layer.gate_proj.out_features
        self.k_norm = block_norm(layer.k_norm)
        self.qk_norm = head_norms(layer.q_norm, layer.k_norm, self.heads, self.kv_heads)
        self.input_norm, self.post_norm = block_norm(layer.input_layernorm), block_norm(layer.post_attention_layernorm)

    def keys_values(self, context: torch.Tensor, cos, sin):
        """Keys and values [M, kv_heads, d] of context rows [M, H] (keys normed and rotated)."""
        k, v = self.context_kv(context).view(context.shape[0], 2 * self.kv_heads, self.dim).split(self.kv_heads, 1)
        return rope(self.k_norm(k), cos, sin), v

    def __call__(self, x, cos, sin, keys, values, mask) -> torch.Tensor:
        """The blocks x [R, Q, H] after the layer; keys/values [R, kv_heads, C, d] fp32, mask [R, 1, Q, C + Q]
        (None: every block position sees every key)."""
        r, q_len, hidden = x.shape
        n = r * q_len
        h = self.input_norm(x.reshape(n, hidden))
        qk, v = (
            self.qkv(h)
            .view(n, self.heads + 2 * self.kv_heads, self.dim)
            .split([self.heads + self.kv_heads, self.kv_heads], 1)
        )
        q, k = rope(self.qk_norm(qk), cos, sin).split([self.heads, self.kv_heads], 1)

        def per_row(t):  # [n, count, d] -> [R, count, Q, d] in fp32
            return t.float().view(r, q_len, t.shape[1], self.dim).transpose(1, 2)

        keys, values = torch.cat([keys, per_row(k)], 2), torch.cat([values, per_row(v)], 2)
        out = F.scaled_dot_product_attention(per_row(q), keys, values, mask, enable_gqa=self.kv_heads != self.heads)
        x = x.reshape(n, hidden) + self.o(out.transpose(1, 2).reshape(n, self.heads * self.dim).to(x.dtype))
        gate, up = self.gate_up(self.post_norm(x)).split(self.inter, -1)
        return (x + self.down(F.silu(gate) * up)).view(r, q_len, hidden)


class LeanBlock:
    """The block call of a `DFlashHead` as fused products (packed where `pack`, at the row counts `choice` packs):

    - `context(features [M, F]) -> [M, H]`: the projected, normed target features;
    - `context_kv(i, context [M, H], positions [M]) -> (keys, values) [M, kv_heads, d]` for layer i's cache;
    - `run_block(x [R, Q, H], positions [R, Q], context_kv, allowed [R, Q, C + Q]) -> [R, Q, H]`: the blocks
      after every layer and the final norm (allowed None: every position sees every key), `context_kv(i)` giving
      layer i's cached (keys, values)
      [R, kv_heads, C, d] in `cache_dtype` (fp32)."""

    cache_dtype = torch.float32

    def __init__(self, head, pack: bool, choice=None):
        def linear(linears):
            return LeanLinear(linears, pack, choice)

        self.fc, self.hidden_norm, self.norm = linear([head.fc]), block_norm(head.hidden_norm), block_norm(head.norm)
        self.layers = [_LeanLayer(layer, linear) for layer in head.layers]
        self.rope = RopeTable(head.rotary, head.layers[0].head_dim, next(head.parameters()).dtype)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))

    def context_kv(self, i: int, context: torch.Tensor, positions: torch.Tensor):
        return self.layers[i].keys_values(context, *self.rope(positions))

    def run_block(self, x, positions, context_kv, allowed) -> torch.Tensor:
        cos, sin = self.rope(positions.reshape(-1))
        mask = None if allowed is None else allowed[:, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, *context_kv(i), mask)
        return self.norm(x)


@torch.inference_mode()
def lean_block(head, embed, pack: bool, choice=None) -> LeanBlock | None:
    """The head's `LeanBlock`, or None where its outputs differ from the head's own (`HeadBlock`) on a probe (two
    blocks over 5 and 3 context entries) by more than the precision's tolerance."""
    lean = LeanBlock(head, pack, choice)
    param = next(head.parameters())
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(8, head.feature_spec.width, generator=generator).to(param)
    roots = torch.randint(0, embed.num_embeddings, (2,), generator=generator).to(param.device)
    k = head.block_size
    positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2], device=param.device)
    block_positions = torch.tensor([[5], [3]], device=param.device) + torch.arange(k, device=param.device)
    filled = torch.tensor([[True] * 5, [True] * 3 + [False] * 2], device=param.device)
    allowed = torch.cat([filled[:, None].expand(-1, k, -1), torch.ones(2, k, k, dtype=torch.bool)], 2)
    outs = []
    for impl in (HeadBlock(head), lean):
        context = impl.context(features)
        kv = [impl.context_kv(i, context, positions) for i in range(len(head.layers))]

        def cached(i, kv=kv, impl=impl):  # row 0: entries 0-4; row 1: entries 5-7 and two empty slots
            rows = [t.to(impl.cache_dtype).transpose(0, 1) for t in kv[i]]  # [kv_heads, 8, d]
            return tuple(torch.stack([t[:, :5], F.pad(t[:, 5:], (0, 0, 0, 2))]) for t in rows)

        x = head.block_inputs(roots, embed).to(param.dtype)
        outs.append(impl.run_block(x, block_positions, cached, allowed).float())
    error = (outs[1] - outs[0]).abs().max() / outs[0].abs().max().clamp(min=1e-6)
    return lean if float(error) <= TOLERANCE.get(param.dtype, 3e-2) else None

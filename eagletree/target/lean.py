"""Decoder layers as a handful of tensor operations: the fast path of ragged passes, the target's and the drafter's.

On a CPU a pass over a few rows pays more for the framework's per-call work (module dispatch, mask and rotary
construction, cache bookkeeping, output capture) than for some of its arithmetic: a 30-layer target's one-token
pass makes about 400 module calls. `LeanLayer` computes a LLaMA-family decoder layer from the same weights as
a few direct products (its Linears' own kernels, packed or not; q/k/v fused into one product and gate/up into
another, from a copy of their weights: the drafter's always, the target's where its Linears are packed, as one
more packed copy: about 0.7 of a layer's weights), rotary embeddings read from a table, keys and
values written by position into a `RaggedCache`, and attention over short query blocks with the query heads that
share a key/value head stacked as one block, through SDPA's fused kernel under the blocks' masks; long blocks, a
prompt's, go through the ragged SDPA path.

`LeanModel` runs a whole target that way (embedding, the layers, the final norm and the lm_head at the rows
asked for); `lean_model(model)` builds one and checks it against the model's own ragged forward on a probe, and
a model it does not reproduce there (another architecture: embedding scales, soft caps, sliding windows) keeps
the transformers path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidValue
from ..packing import PackedLinear, is_packed, pack_weight, packed_linear, packing_problem, weight_key
from .ragged import Layout, RaggedCache, causal_block, ragged_attention, ragged_forward, use_ragged

# Query blocks up to this many rows per sequence attend by plain products (a drafting level, a catch-up, a
# one-token pass); longer ones (a prompt, a large tree) through SDPA, which is faster there.
SHORT_BLOCK = 16


class LeanUnsupported(Exception):
    """The layer is not one `LeanLayer` computes (the caller keeps the transformers path)."""


class LeanLinear:
    """y = x W^T + b from one or more nn.Linear fused along their outputs, through a oneDNN-packed copy of W
    at the row counts where `choice` (a measured KernelChoice; None: always) packs."""

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


class ModuleLinears:
    """The same products through the Linears themselves (no copy of the weights): each one's own forward (a
    PackedLinear's kernel choice included), outputs concatenated when there are several."""

    def __init__(self, linears: list[nn.Module]):
        self.calls = [m.forward if isinstance(m, PackedLinear) else _plain(m) for m in linears]
        self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.calls) == 1:
            return self.calls[0](x)
        return torch.cat([call(x) for call in self.calls], -1)


def _plain(linear: nn.Linear):
    weight, bias = linear.weight, linear.bias
    return lambda x: F.linear(x, weight, bias)


class FusedPacked:
    """The products of PackedLinears fused along their outputs as one oneDNN call on a packed copy of their
    concatenated weights (one Linear: its own packed copy), where the Linears themselves would run packed (not
    inside `stock_kernels`, and their kernel choice packs at this row count); elsewhere their own forwards. No
    unpacked copy of the weights is kept; `refresh` makes the packed one again when a weight or bias changed (in
    place, or replaced), as a PackedLinear does at each call (`LeanModel.refresh`, at every prefill). Called
    only on CPU tensors of the weights' dtype, without gradients (the lean path's passes), so the PackedLinear's
    other checks are left out."""

    def __init__(self, linears: list[PackedLinear]):
        self.linears, self.first = linears, linears[0]
        self.own = ModuleLinears(linears)
        self.packed, self.bias, self.key = None, None, None
        self._pack()

    def _key(self) -> tuple:
        return tuple(weight_key(t) for t in self.tensors())

    def _pack(self) -> None:
        linears = self.linears
        if len(linears) == 1:
            linear = linears[0]
            if weight_key(linear.weight) != linear._packed_key:
                linear._pack()
            self.packed, self.bias = linear.packed, linear.bias
        else:
            self.packed = pack_weight(torch.cat([m.weight.detach() for m in linears]))
            self.bias = None
            if any(m.bias is not None for m in linears):
                self.bias = torch.cat(
                    [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears]
                )
        self.key = self._key()

    def tensors(self) -> list[torch.Tensor]:
        return [t for m in self.linears for t in (m.weight, m.bias) if t is not None]

    def refresh(self) -> None:
        if self._key() != self.key:
            self._pack()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        first = self.first
        if not first.enabled or (first.choice is not None and not first.choice.packs(x)):
            return self.own(x)
        return packed_linear(x, self.packed, self.bias)


def _fused_packed(linears: list[nn.Module]):
    """`FusedPacked` over `linears` when every one is a PackedLinear of the same dtype, else their own forwards."""
    if all(isinstance(m, PackedLinear) for m in linears) and len({m.weight.dtype for m in linears}) == 1:
        return FusedPacked(linears)
    return ModuleLinears(linears)


def _linears(fuse: str, pack: bool, choice):
    """How a LeanLayer builds its products (`fuse`): "copy", fused copies of the weights (packed where `pack`,
    under `choice`); "packed", one packed copy of the fused weights where the Linears are packed (their own
    kernel choice), else their own forwards; "off", the Linears' own forwards (no copy)."""
    if fuse not in FUSE_MODES:
        raise InvalidValue(f"fuse must be one of {FUSE_MODES}, got {fuse!r}")
    if fuse == "copy":
        return lambda linears: LeanLinear(linears, pack, choice)
    if fuse == "packed":
        return _fused_packed
    return ModuleLinears


FUSE_MODES = ("copy", "packed", "off")


@torch.inference_mode()
def lean_norm(norm: nn.Module):
    """`norm` as one fused call, F.rms_norm with its weight and epsilon, where that gives the module's own output
    bit for bit on a probe (the LLaMA family's RMSNorm in fp32: its module call and half a dozen elementwise
    operations cost about 4 microseconds more, 61 times a pass of a 30-layer model); else the module's forward
    (another norm: Gemma's 1 + weight, a bf16 one rounding between its steps)."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return norm.forward
    shape = (weight.shape[0],)

    def fused(x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, shape, weight, eps)

    generator = torch.Generator().manual_seed(0)
    for rows in (1, 5):
        x = (3 * torch.randn(rows, shape[0], generator=generator)).to(weight)
        if not torch.equal(fused(x), norm(x)):
            return norm.forward
    return fused


@torch.inference_mode()
def lean_act(act):
    """`act` as F.silu where it gives the module's output bit for bit on a probe (transformers' SiLU module costs a
    module call more, once a layer); else `act` itself."""
    generator = torch.Generator().manual_seed(0)
    probes = [4 * torch.randn(rows, 64, generator=generator) for rows in (1, 5)]
    try:
        same = all(torch.equal(F.silu(x), act(x)) for x in probes)
    except (RuntimeError, TypeError, ValueError):  # (an activation that does not take these inputs)
        same = False
    return F.silu if same else act


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin, bit for bit: rotate_half(x) is [-x2, x1], so its product with
    sin is [x2, x1] (x rolled by half) times sin with its first half negated (a sign flip is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class RopeTable:
    """cos and signed sin [R, 1, dim] (for `rope`) of positions [R], read from a table of a rotary embedding's
    values, grown (doubling) as positions grow."""

    def __init__(self, rotary, dim: int, dtype: torch.dtype):
        self.rotary, self.dim, self.dtype = rotary, dim, dtype
        self.cos = self.sin = torch.zeros(0, 1, dim)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = int(positions.max()) + 1
        if top > self.cos.shape[0]:
            size = max(top, 2 * self.cos.shape[0], 256)
            ref = torch.zeros(1, 1, dtype=torch.float32, device=positions.device)
            cos, sin = self.rotary(ref, torch.arange(size, device=positions.device)[None])
            half = self.dim // 2
            sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
            self.cos, self.sin = cos[0, :, None].to(self.dtype), sin[:, None].to(self.dtype)
        return self.cos[positions], self.sin[positions]


class LeanLayer:
    """A decoder layer over packed rows: (attention input [R, D], residual [R, H], positions [R]) on top of the
    cache rows of a `Layout` -> output features [R, H]; its keys and values go to layer `index` of the cache.

    fuse: how q/k/v and gate/up run, each as one product from fused copies of the weights ("copy": packed when the
    layer is, under `choice`; "packed": only where the layer's Linears are packed, one packed copy, their own
    kernel choice) or through the layer's own Linears ("off": no copy)."""

    def __init__(self, layer, rotary, choice=None, index: int = 0, fuse: str = "copy"):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        needed = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        needed += [(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        missing = [n for owner, n in needed if not isinstance(getattr(owner, n, None), nn.Linear)]
        if missing or not hasattr(mlp, "act_fn") or not hasattr(layer, "post_attention_layernorm"):
            raise LeanUnsupported(f"{type(layer).__name__} lacks {missing or 'act_fn / post_attention_layernorm'}")
        rope_type = str(getattr(rotary, "rope_type", "default"))
        if "dynamic" in rope_type or "longrope" in rope_type:  # (their tables change with the context length)
            raise LeanUnsupported(f"rope_type {rope_type!r} rescales with the context length")
        if getattr(attn, "sliding_window", None) or getattr(attn, "sinks", None) is not None:
            raise LeanUnsupported("sliding-window or sink attention")
        linears = _linears(fuse, is_packed(layer) and packing_problem(layer) is None, choice)
        self.qkv = linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = linears([attn.o_proj])
        self.gate_up = linears([mlp.gate_proj, mlp.up_proj])
        self.down = linears([mlp.down_proj])
        self.dim = int(attn.head_dim)
        self.heads = attn.q_proj.out_features // self.dim
        self.kv_heads = attn.k_proj.out_features // self.dim
        self.scaling = float(attn.scaling)
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (self.q_norm is None) != (self.k_norm is None):
            raise LeanUnsupported("a per-head norm on only one of q and k")
        self.act, self.norm = lean_act(mlp.act_fn), lean_norm(layer.post_attention_layernorm)
        self.input_norm = getattr(layer, "input_layernorm", None)
        self.inter = mlp.gate_proj.out_features
        self.index = index
        self.dtype = attn.q_proj.weight.dtype
        self._rotary = RopeTable(rotary, self.dim, self.dtype)
        self._rope = rope

    @torch.inference_mode()
    def __call__(
        self, attn_in, residual, positions, cache: RaggedCache, layout: Layout, rope_values=None
    ) -> torch.Tensor:
        """rope_values: the rows' (cos, sin) when the caller read them once for every layer (one rotary, one dtype)."""
        r = attn_in.shape[0]
        qk, v = self.qkv(attn_in).split([(self.heads + self.kv_heads) * self.dim, self.kv_heads * self.dim], -1)
        qk, v = qk.view(r, self.heads + self.kv_heads, self.dim), v.view(r, self.kv_heads, self.dim)
        if self.q_norm is not None:  # (per-head norms: Qwen3)
            q, k = qk.split([self.heads, self.kv_heads], 1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], 1)
        q, k = self._rope(qk, *(rope_values or self._rotary(positions))).split([self.heads, self.kv_heads], 1)
        # Attention runs in fp32 whatever the layer's precision: a bf16 product of a new shape (the context grows
        # every step) builds a oneDNN kernel first, which costs about a millisecond on a CPU.
        if self.dtype != torch.float32:
            q, k, v = q.float(), k.float(), v.float()
        keys, values = cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], self.index)
        if layout.mask.shape[2] <= SHORT_BLOCK:
            out = self._attend(q, keys, values, layout)
        else:
            out = ragged_attention(None, q.transpose(0, 1)[None], keys, values, None, scaling=self.scaling)[0][0]
        h = residual + self.o(out.reshape(r, self.heads * self.dim).to(self.dtype))
        gate, up = self.gate_up(self.norm(h)).split(self.inter, -1)
        return h + self.down(self.act(gate).mul_(up))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: Layout) -> torch.Tensor:
        """Attention of short query blocks: q [R, heads, dim] packed -> [R, heads, dim]; each row's queries over its
        own entries under the layout's mask, the query heads sharing a key/value head stacked as one block."""
        s, n_max = len(layout.rows), layout.mask.shape[2]
        groups = self.heads // self.kv_heads
        if layout.padded is not None:
            q = q.new_zeros(s * n_max, self.heads, self.dim).index_copy_(0, layout.padded, q)
        # [S, n, kv_heads, groups, dim] -> [S, kv_heads, groups * n, dim]
        block = q.view(s, n_max, self.kv_heads, groups, self.dim).permute(0, 2, 3, 1, 4)
        block = block.reshape(s, self.kv_heads, groups * n_max, self.dim)
        # SDPA's fused kernel, several sequences' masked blocks included: on 2 CPU cores (torch 2.13) it was as fast
        # as two batched products and a softmax or faster (up to 30% at 2 sequences) at 2-16 sequences of 1-8
        # queries each, and its rows are closer to a pass of each row alone (docs/results.md)
        mask = None if layout.unmasked else _grouped_mask(layout, groups)
        out = F.scaled_dot_product_attention(block, keys, values, mask, scale=self.scaling)
        out = out.view(s, self.kv_heads, groups, n_max, self.dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(s * n_max, self.heads, self.dim)
        return out if layout.padded is None else out.index_select(0, layout.padded)


def _grouped_mask(layout: Layout, groups: int) -> torch.Tensor:
    """The layout's mask [S, 1, groups * n, kv] for query blocks that stack `groups` query heads (made once per
    pass, kept on the layout for the other layers)."""
    mask = layout.grouped_mask
    s, _, n, kv = layout.mask.shape
    if mask is None or mask.shape[2] != groups * n:
        mask = layout.mask[:, :, None].expand(s, 1, groups, n, kv).reshape(s, 1, groups * n, kv)
        layout.grouped_mask = mask
    return mask


# How far the lean path's logits and features may be from the model's own on the probe, relative to their scale.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


class LeanModel:
    """A LLaMA-family causal LM's ragged forward through `LeanLayer`s over the model's own modules (no copy of
    its weights): embedding, each layer (input norm, then the lean layer writing layer i of the cache), the final
    norm and the lm_head at every row."""

    def __init__(self, model):
        inner = getattr(model, "model", None)
        parts = {n: getattr(inner, n, None) for n in ("embed_tokens", "layers", "norm", "rotary_emb")}
        lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if any(p is None for p in parts.values()) or not isinstance(lm_head, nn.Linear):
            raise LeanUnsupported(f"{type(model).__name__} is not laid out as model.{{{', '.join(parts)}}} + lm_head")
        count = model.config.num_hidden_layers
        self.layers = [
            LeanLayer(layer, parts["rotary_emb"], None, i, fuse="packed")
            for i, layer in enumerate(parts["layers"][:count])
        ]
        if any(lean.input_norm is None for lean in self.layers):
            raise LeanUnsupported("a decoder layer without input_layernorm")
        self.embed = parts["embed_tokens"].weight
        self.norm = lean_norm(parts["norm"])
        self.lm_head = ModuleLinears([lm_head])
        self.norms = [lean_norm(lean.input_norm) for lean in self.layers]
        products = [(lean.qkv, lean.o, lean.gate_up, lean.down) for lean in self.layers]
        self.fused = [p for four in products for p in four if isinstance(p, FusedPacked)]
        self.weights_key = self._weights_key()

    def _weights_key(self) -> tuple:
        return tuple(weight_key(t) for p in self.fused for t in p.tensors())

    def refresh(self) -> None:
        """Pack the fused products again where their Linears' weights changed since they were packed: asked at each
        prefill, as every sequence starts with one (checking at every pass would cost about 0.25 ms of a 15 ms
        one-token pass of SmolLM2-135M)."""
        key = self._weights_key()
        if key != self.weights_key:
            for product in self.fused:
                product.refresh()
            self.weights_key = key

    @torch.inference_mode()
    def __call__(self, cache: RaggedCache, layout: Layout, input_ids, positions, layers=None, logits=True):
        """(logits [R, vocab] float32 or None, hidden [R, H] post-norm, {layer: [R, H] its output} or None) of the
        packed rows input_ids [R] at positions [R]; the caller holds the layout on the cache (`ragged_pass`)."""
        h = F.embedding(input_ids, self.embed)
        rope_values = self.layers[0]._rotary(positions)
        layer_hidden = {} if layers else None
        for i, (norm, lean) in enumerate(zip(self.norms, self.layers)):
            h = lean(norm(h), h, positions, cache, layout, rope_values)
            if layers and i in layers:
                layer_hidden[i] = h
        hidden = self.norm(h)
        if layers and len(self.layers) - 1 in layers:  # (as transformers' hidden states: the last one normed)
            layer_hidden[len(self.layers) - 1] = hidden
        return (self.lm_head(hidden).float() if logits else None), hidden, layer_hidden


def lean_model(model) -> LeanModel | None:
    """The model's `LeanModel`, built and checked once per model and set of kernels (kept on the model), or None
    where the transformers path stays: not a CPU fp32 model, an architecture `LeanModel` does not cover, or a
    probe on which its logits, features or layer outputs differ from the model's own ragged forward."""
    param = next(model.parameters())
    key = (param.device, param.dtype, _kernels_key(model))
    cached = model.__dict__.get("_eagletree_lean")
    if cached is not None and cached[0] == key:
        return cached[1]
    lean = None
    if param.device.type == "cpu" and param.dtype == torch.float32:
        try:
            lean = LeanModel(model)
        except LeanUnsupported:
            lean = None
        if lean is not None:
            use_ragged(model)  # (the probe compares with the model's own ragged forward, which needs it)
            if not _matches(model, lean):
                lean = None
    object.__setattr__(model, "_eagletree_lean", (key, lean))
    return lean


def _kernels_key(model) -> tuple:
    """Changes when the model's Linears are replaced (packed or unpacked): the lean path holds their forwards."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers:
        return ()
    attn = getattr(layers[0], "self_attn", None)
    return (id(getattr(attn, "q_proj", None)), id(model.get_output_embeddings()))


@torch.inference_mode()
def _matches(model, lean: LeanModel) -> bool:
    """The probe: two rows (a 5-token prompt then a 3-node tree; a 3-token prompt then one token) through the
    model's own ragged forward and through `lean`; every output within the dtype's tolerance."""
    param = next(model.parameters())
    generator = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().out_features
    ids = torch.randint(0, vocab, (12,), generator=generator)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    passes = [
        ([ids[:5], ids[5:8]], [causal_block(5), causal_block(3)], [torch.arange(5), torch.arange(3)]),
        ([ids[8:11], ids[11:]], [tree, causal_block(1)], [torch.tensor([5, 6, 6]), torch.tensor([3])]),
    ]
    layers = list(range(len(lean.layers)))
    caches = [RaggedCache(capacity=16), RaggedCache(capacity=16)]
    for cache in caches:
        cache.add_row(), cache.add_row()
    for tokens, blocks, positions in passes:
        want = ragged_forward(model, caches[0], [0, 1], tokens, blocks, positions, layers)
        got = ragged_forward(model, caches[1], [0, 1], tokens, blocks, positions, layers, lean=lean)
        pairs = [(want.logits, got.logits), (want.hidden, got.hidden)]
        pairs += [(want.layer_hidden[i], got.layer_hidden[i]) for i in layers]
        for a, b in pairs:
            error = (a.float() - b.float()).abs().max() / a.float().abs().max().clamp(min=1e-6)
            if not float(error) <= TOLERANCE.get(param.dtype, 3e-2):
                return False
    return True

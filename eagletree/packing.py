"""Faster CPU matrix products: Linear weights pre-packed into oneDNN's blocked layout.

On CPU, PyTorch's stock Linear (MKL) streams the weights slowly at one row and slows down sharply
for the 4-32 rows of a tree pass; oneDNN with a weight packed once ahead of time is faster at every
row count that decoding uses (measured on 2 cores with SmolLM2-135M's shapes, fp32: 51 -> 27 ms at
1 row, 61 -> 31 ms at 8, 76 -> 36 ms at 16). The arithmetic stays fp32: results differ from MKL's only
in summation order (~1e-6 relative), as they already do between a 1-row and an N-row pass.

Packing keeps the module's Parameters (ties, state_dict and `.weight` readers are unaffected) and adds
the packed copy, so it costs one more copy of the weights in memory.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE = (torch.float32, torch.bfloat16)


class PackingError(ValueError):
    """The model cannot be packed here (device, dtype or a PyTorch without oneDNN)."""


def weight_key(weight: torch.Tensor) -> tuple:
    """Identifies a weight's current values: storage, dtype, shape and in-place version (inference
    tensors have no version counter; they cannot be modified in place outside inference mode anyway)."""
    version = None if weight.is_inference() else weight._version
    return weight.data_ptr(), weight.dtype, tuple(weight.shape), version


def pack_weight(weight: torch.Tensor, rows_hint: int = 8) -> torch.Tensor:
    """[out, in] weight -> oneDNN's blocked layout for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) through a weight packed by `pack_weight` (same dtype as x, on CPU)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """nn.Linear whose inference forward uses a oneDNN-packed copy of its weight (same Parameters).

    Falls back to the stock kernel while gradients are needed, under autocast, for other dtypes or
    devices, and inside `stock_kernels`; repacks when the weight changed (in place, or by .to()).
    """

    def __init__(self, linear: nn.Linear, rows_hint: int = 8):
        nn.Module.__init__(self)
        self.training = linear.training
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.rows_hint, self.enabled = rows_hint, True
        self._pack()

    def _pack(self) -> None:
        self.packed, self._packed_key = pack_weight(self.weight, self.rows_hint), weight_key(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (not self.enabled or x.device.type != "cpu" or x.dtype != w.dtype or w.dtype not in PACKABLE
                or w.device.type != "cpu" or torch.is_autocast_enabled("cpu")
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, self.bias)
        if weight_key(w) != self._packed_key:
            self._pack()
        return packed_linear(x, self.packed, self.bias)


def packed_weight(owner: nn.Module, weight: torch.Tensor, rows_hint: int = 8) -> torch.Tensor:
    """A packed copy of a frozen `weight` used outside an nn.Linear (e.g. the drafter's lm_head slice),
    cached on `owner` while `weight` is the same tensor, unchanged."""
    cached = getattr(owner, "_packed_weight", None)
    if cached is None or cached[0] != weight_key(weight):
        cached = (weight_key(weight), pack_weight(weight, rows_hint))
        object.__setattr__(owner, "_packed_weight", cached)  # a plain attribute, not a registered buffer
    return cached[1]


def packing_problem(model) -> str | None:
    """Why `model` cannot be packed here, or None when it can."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"packing speeds up CPU matrix products; the model is on {param.device}"
    if param.dtype not in PACKABLE:
        return f"packing supports {[str(d) for d in PACKABLE]}, the model is {param.dtype}"
    if param.dtype == torch.bfloat16:
        from .target import cpu_has_bf16

        if not cpu_has_bf16():
            return "bf16 packing needs a CPU with native bf16 (avx512_bf16 or amx_bf16)"
    return None


def pack_linears(model: nn.Module, rows_hint: int = 8) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear in place; returns how many were packed.
    Linears with hooks are left alone (a replacement would drop them)."""
    problem = packing_problem(model)
    if problem:
        raise PackingError(f"cannot pack {type(model).__name__}: {problem}")
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            hooked = child._forward_hooks or child._forward_pre_hooks or child._backward_hooks
            if type(child) is nn.Linear and not hooked:
                setattr(parent, name, PackedLinear(child, rows_hint))
                count += 1
    return count


def unpack_linears(model: nn.Module) -> int:
    """Undo `pack_linears`: plain nn.Linear modules with the same Parameters, packed copies freed."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device="meta")
                linear.weight, linear.bias, linear.training = child.weight, child.bias, child.training
                setattr(parent, name, linear)
                count += 1
    return count


def is_packed(model: nn.Module) -> bool:
    """Whether `model` runs packed kernels now (False inside `stock_kernels`)."""
    return any(isinstance(m, PackedLinear) and m.enabled for m in model.modules())


def pack_target(model, mode: str) -> int:
    """The CLI's --pack: 'auto' packs a CPU model's Linears when this machine can, 'on' insists (an error
    says why it cannot), 'off' keeps PyTorch's stock kernels. Returns how many were packed."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"pack must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off" or (mode == "auto" and packing_problem(model)):
        return 0
    return pack_linears(model)


@contextmanager
def stock_kernels(model: nn.Module):
    """Within the block the model's packed Linears use PyTorch's stock kernel (e.g. for a plain baseline)."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    states = [m.enabled for m in packed]
    for m in packed:
        m.enabled = False
    try:
        yield model
    finally:
        for m, state in zip(packed, states):
            m.enabled = state

"""Faster CPU matrix products: Linear weights pre-packed into oneDNN's blocked layout.

On CPU, PyTorch's stock Linear (MKL) streams the weights slowly at one row and slows down sharply
for the 4-32 rows of a tree pass; oneDNN with a weight packed once ahead of time is faster at every
row count that decoding uses on the CPUs measured (docs/results.md, "Packed CPU kernels"). The
arithmetic stays fp32: results differ from MKL's only
in summation order (~1e-6 relative), as they already do between a 1-row and an N-row pass.

Packing keeps the module's Parameters (ties, state_dict and `.weight` readers are unaffected) and adds
the packed copy, so it costs one more copy of the weights in memory.

Which kernels win depends on the CPU (on some the packed one-token pass is slower: docs/results.md), so
`pack_target(model, "auto")` measures both on this machine, per row count, and keeps
packing only at the row counts where it is faster (`KernelChoice`, cached per CPU model (name, family and
model number), threads, dtype and torch version).
"""

from __future__ import annotations

import json
import math
import platform
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import EagletreeError
from .files import write_json_atomic
from .target import cache_dir, cpu_has_bf16, target_identity

PACKABLE = (torch.float32, torch.bfloat16)


class PackingError(EagletreeError, ValueError):
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


@dataclass
class KernelChoice:
    """Stock vs packed kernels measured on this machine per row count (the tree size of a pass); packing is
    kept only at the row counts where it was faster."""

    sizes: list[int]  # row counts measured, ascending
    stock_s: list[float]  # seconds of all the target's Linears at that many rows, PyTorch's stock kernel
    packed_s: list[float]  # the same with the oneDNN-packed weights
    machine: str = ""  # the cache key (machine_key): CPU model, threads, dtype, torch version
    seconds: float = 0.0  # what measuring took

    def __post_init__(self):
        if not self.sizes or not (len(self.sizes) == len(self.stock_s) == len(self.packed_s)):
            raise PackingError(
                f"kernel choice needs one stock and one packed time per size, got sizes {self.sizes}, "
                f"stock {self.stock_s}, packed {self.packed_s}"
            )
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in self.sizes):
            raise PackingError(f"kernel choice sizes must be integers, got {self.sizes}")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise PackingError(f"kernel choice sizes must be distinct, ascending and >= 1, got {self.sizes}")
        if not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
            for t in list(self.stock_s) + list(self.packed_s)
        ):
            raise PackingError(
                f"kernel choice times must be finite seconds >= 0, got stock {self.stock_s}, packed {self.packed_s}"
            )

    @property
    def packed(self) -> list[bool]:
        """Per measured size: whether the packed kernel was faster."""
        return [p < s for p, s in zip(self.packed_s, self.stock_s)]

    def packs(self, x: torch.Tensor) -> bool:
        """The decision for a product with input `x` ([..., in]): by its rows, as `use_packed`."""
        return self.use_packed(x.numel() // max(x.shape[-1], 1))

    def use_packed(self, rows: int) -> bool:
        """The decision for a product of `rows` rows: that of the smallest measured size >= rows (the largest's
        beyond it, e.g. a prefill). Remembered per row count: a pass asks once per Linear."""
        decisions = self.__dict__.setdefault("_decisions", {})
        decision = decisions.get(rows)
        if decision is None:
            packed = self.packed
            decision = next((p for size, p in zip(self.sizes, packed) if rows <= size), packed[-1])
            decisions[rows] = decision
        return decision

    def summary(self) -> str:
        """One line: each size's decision with both timings."""
        return ", ".join(
            f"N={n}: {'packed' if p else 'stock'} ({ps * 1e3:.1f} vs stock {ss * 1e3:.1f} ms)"
            for n, p, ps, ss in zip(self.sizes, self.packed, self.packed_s, self.stock_s)
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "packed": self.packed}


class PackedLinear(nn.Linear):
    """nn.Linear whose inference forward uses a oneDNN-packed copy of its weight (same Parameters).

    Falls back to the stock kernel while gradients are needed, under autocast, for other dtypes or
    devices, inside `stock_kernels`, and at row counts where its `choice` (a measured KernelChoice,
    None = always packed) found the stock kernel faster; repacks when the weight changed (in place, or by .to()).
    """

    def __init__(self, linear: nn.Linear, rows_hint: int = 8):
        nn.Module.__init__(self)
        self.training = linear.training
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.rows_hint, self.enabled, self.choice = rows_hint, True, None
        self._pack()

    def _pack(self) -> None:
        self.packed, self._packed_key = pack_weight(self.weight, self.rows_hint), weight_key(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            not self.enabled
            or x.device.type != "cpu"
            or x.dtype != w.dtype
            or w.dtype not in PACKABLE
            or w.device.type != "cpu"
            or torch.is_autocast_enabled("cpu")
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
        ):
            return F.linear(x, w, self.bias)
        if self.choice is not None and not self.choice.packs(x):
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
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                linear.weight, linear.bias, linear.training = child.weight, child.bias, child.training
                setattr(parent, name, linear)
                count += 1
    return count


def is_packed(model: nn.Module) -> bool:
    """Whether `model` runs packed kernels now (False inside `stock_kernels`)."""
    return any(isinstance(m, PackedLinear) and m.enabled for m in model.modules())


KERNEL_SIZES = (1, 4, 8, 16, 32, 64)  # row counts `pack_target(..., "auto")` measures: a one-token pass and trees


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:  # (closed at once, not when the generator is collected)
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


def _first_cpu(keys: tuple[str, ...]) -> dict[str, str] | None:
    """These keys of /proc/cpuinfo's first processor block (those it lists), or None where it cannot be read."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:  # (closed at once, not when the generator is collected)
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in keys and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        return None
    return fields


def cpu_generation() -> str:
    """This CPU's family and model numbers as 'f25m17' (/proc/cpuinfo), or '' where not listed: virtual machines
    often name a CPU only 'AMD EPYC', which its family and model tell apart (Zen 2, 3, 4 ...)."""
    fields = _first_cpu(("cpu family", "model")) or {}
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    return f"f{family}m{model}" if family.isdigit() and model.isdigit() else ""


def cpu_features() -> str:
    """What this CPU's matrix products can use, as a reader of a measurement needs it: its family and model numbers,
    its widest vector instructions and whether it multiplies bf16 natively, e.g. 'family 25 model 1; AVX2; no native
    bf16' (/proc/cpuinfo's first processor; '' where it lists none of these)."""
    fields = _first_cpu(("cpu family", "model", "flags", "Features")) or {}  # (Arm lists Features)
    parts = []
    if fields.get("cpu family", "").isdigit() and fields.get("model", "").isdigit():
        parts.append(f"family {fields['cpu family']} model {fields['model']}")
    if "flags" in fields or "Features" in fields:
        flags = set(fields.get("flags", fields.get("Features", "")).split())
        widest = next(
            (
                name
                for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("asimd", "NEON"))
                if flag in flags
            ),
            "no AVX",
        )
        bf16 = [name for flag, name in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if flag in flags]
        parts += [widest, f"native bf16 ({', '.join(bf16)})" if bf16 else "no native bf16"]
    return "; ".join(parts)


def machine_key(model) -> str:
    """What kernel timings depend on besides the model: CPU model (name, family and model number), thread count,
    dtype, torch version (its kernels), as a file-name-safe string."""
    cpu = re.sub(r"[^A-Za-z0-9]+", "-", f"{cpu_model()} {cpu_generation()}").strip("-")
    torch_version = re.sub(r"[^A-Za-z0-9.]+", "-", torch.__version__)
    return (
        f"{cpu}-{torch.get_num_threads()}t-{str(next(model.parameters()).dtype).removeprefix('torch.')}"
        f"-torch{torch_version}"
    )


def measure_kernels(model, sizes=KERNEL_SIZES, reps: int = 3, sample: int = 4, extra=()) -> KernelChoice:
    """Seconds of the packed model's Linears per pass, stock vs packed kernel, at each row count.

    Times every `sample`-th Linear (and the largest one, the output layer), scaled to the whole model by
    parameter count: all decoder layers have the same shapes, and the sampled weights still stream from
    memory as in a real pass. `extra`: (weight, bias) products timed in full besides the Linears (a drafter's
    lm_head slice, not a module of its own). One warm-up round, then `reps` rounds; each round measures every
    size with both kernels (their order alternating), so machine noise hits them alike; the fastest round is
    kept (the kernel's own speed; a busy machine only adds time). Attention and the rest of a pass do not
    depend on the kernel, so only the products are timed.
    """
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not linears:
        raise PackingError(
            f"measure_kernels needs a packed model (pack_linears); {type(model).__name__} has no PackedLinear"
        )
    largest = max(linears, key=lambda m: m.weight.numel())
    timed = linears[::sample] + ([largest] if all(m is not largest for m in linears[::sample]) else [])
    scale = sum(m.weight.numel() for m in linears) / sum(m.weight.numel() for m in timed)
    sizes = sorted(set(int(n) for n in sizes))
    dtype = linears[0].weight.dtype
    with torch.inference_mode():
        for m in timed:
            if weight_key(m.weight) != m._packed_key:
                m._pack()
        # (weight, packed weight, bias, factor): the sampled Linears stand for all of them, the extras for themselves
        products = [(m.weight, m.packed, m.bias, scale) for m in timed]
        products += [(w.to(dtype), pack_weight(w.to(dtype)), None if b is None else b.to(dtype), 1.0) for w, b in extra]
    g = torch.Generator().manual_seed(0)
    inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], generator=g).to(dtype) for n in sizes for w, *_ in products}
    times = {(n, kernel): [] for n in sizes for kernel in ("stock", "packed")}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for rep in range(reps + 1):
            for n in sizes:
                for kernel in ("stock", "packed") if rep % 2 else ("packed", "stock"):
                    total = 0.0
                    for weight, packed, bias, factor in products:
                        x = inputs[(n, weight.shape[1])]
                        start = time.perf_counter()
                        if kernel == "stock":
                            F.linear(x, weight, bias)
                        else:
                            packed_linear(x, packed, bias)
                        total += (time.perf_counter() - start) * factor
                    if rep:  # round 0 warms up
                        times[(n, kernel)].append(total)
    return KernelChoice(
        sizes,
        [min(times[(n, "stock")]) for n in sizes],
        [min(times[(n, "packed")]) for n in sizes],
        machine_key(model),
        time.perf_counter() - t0,
    )


def kernel_choice_path(model) -> Path:
    """Where this model's kernel choice on this machine is cached (next to the latency profiles)."""
    fingerprint = target_identity(model.config)["fingerprint"]
    return cache_dir() / "profiles" / f"kernels-{fingerprint}-{machine_key(model)}.json"


def load_or_measure_kernels(model, path=None, **measure) -> KernelChoice:
    """The cached KernelChoice for this model and machine, or measured now (`measure_kernels(model, **measure)`)
    and cached (written atomically)."""
    path = Path(path) if path is not None else kernel_choice_path(model)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data.get("machine") == machine_key(model):  # else another machine's
                data.pop("packed", None)
                return KernelChoice(**data)
        except (OSError, json.JSONDecodeError, TypeError, ValueError):
            pass  # a damaged cache entry is measured again and replaced
    choice = measure_kernels(model, **measure)
    write_json_atomic(path, choice.as_dict())
    return choice


def draft_kernel_choice(head, target_model, lm_weight=None, lm_bias=None) -> KernelChoice | None:
    """The kernels a packed head drafts with: the target's measured choice (None: packed everywhere, --pack on)
    when it runs in the target's precision; in another one (bf16 drafting for an fp32 target) a choice of its
    own, measured on its Linears and its lm_head slice (`lm_weight`) in that precision: which kernel wins
    depends on the dtype as much as on the CPU. Cached next to the target's, keyed by the head's shape too."""
    choice = getattr(target_model, "kernel_choice", None)
    dtype = next(head.parameters()).dtype
    if choice is None or dtype == next(target_model.parameters()).dtype:
        return choice
    vocab = "own" if lm_weight is None else lm_weight.shape[0]
    path = (
        cache_dir() / "profiles" / f"kernels-{target_identity(target_model.config)['fingerprint']}-draft-"
        f"{head.config.head_type}-{vocab}-{machine_key(head)}.json"
    )
    extra = () if lm_weight is None else ((lm_weight, lm_bias),)
    return load_or_measure_kernels(head, path, sample=1, extra=extra)


def apply_choice(model: nn.Module, choice: KernelChoice | None) -> None:
    """Every PackedLinear of `model` follows `choice` (None: packed at every row count)."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.choice = choice
    object.__setattr__(model, "kernel_choice", choice)  # what the CLI and the bench report


def kernels_used(model) -> dict:
    """What kernels `model` runs and why: {"kernels": "stock"|"packed"|"mixed", "choice": KernelChoice dict|None}."""
    choice = getattr(model, "kernel_choice", None)
    if not is_packed(model):
        kind = "stock"
    elif choice is None or all(choice.packed):
        kind = "packed"
    else:
        kind = "mixed"
    return {"kernels": kind, "choice": None if choice is None else choice.as_dict()}


def kernels_tag(model) -> str:
    """A file-name tag for the kernels `model` runs now ('' for stock ones), e.g. for a latency profile's cache."""
    if not is_packed(model):
        return ""
    choice = getattr(model, "kernel_choice", None)
    if choice is None or all(choice.packed):
        return "-packed"
    return "-packed-" + ".".join(str(n) for n, p in zip(choice.sizes, choice.packed) if p)


def pack_target(model, mode: str, choice_path=None) -> int:
    """The CLI's --pack: 'auto' packs a CPU model's Linears where this machine can and keeps the packed kernel
    only at the row counts where it measured faster here (`load_or_measure_kernels`; nothing packed when it is
    faster nowhere), 'on' packs every row count (an error says why it cannot), 'off' keeps PyTorch's stock
    kernels. Returns how many Linears were packed."""
    if mode not in ("auto", "on", "off"):
        raise PackingError(f"pack must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off" or (mode == "auto" and packing_problem(model)):
        return 0
    count = pack_linears(model)
    if mode == "auto":
        choice = load_or_measure_kernels(model, choice_path)
        if not any(choice.packed):
            unpack_linears(model)
            object.__setattr__(model, "kernel_choice", choice)
            return 0
        apply_choice(model, choice)
    return count


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

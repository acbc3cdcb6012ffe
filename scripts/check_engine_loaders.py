"""Run SGLang's own draft-model classes, weight loading and config reading on eagletree's exports, on CPU.

    python scripts/check_engine_loaders.py --wheels DIR [--sglang-wheel Y.whl]
        [--head DIR ...] [--target smollm2-135m] [--self-test]

SGLang only: vLLM is checked for real by scripts/check_vllm.py, which serves the `vllm` export with vLLM's CPU
build. SGLang does not run on a CPU from PyPI packages: the sglang 0.5.23 wheel requires torch==2.14.1 (PyPI's
CUDA build), cuda-python, flashinfer_python[cu13] and nvidia-cutlass-dsl[cu13], and its kernel package
sglang-kernel 0.4.10 holds CUDA kernels only (SGLang's CPU backend needs its kernel built from source). So this
script re-hosts the part of SGLang that reads an export: DIR holds the sglang wheel (`pip download --no-deps
sglang`); SGLang is not installed: the Python source of the modules below is read out of the wheel and executed,
and the GPU, distributed and kernel modules they import are replaced by the stand-ins listed in the output. For
each head (default: the shipped EAGLE-1/2 head and two random EAGLE-3 heads of the same target, over a draft
vocabulary and over the whole one) the script writes eagletree's export in the format SGLang loads (EAGLE-1/2:
'sglang', EAGLE-3: 'eagle3'), then:
- reads config.json with transformers' AutoConfig (as SGLang does) and picks the model class by the
  `EntryClass` of models/llama_eagle.py and llama_eagle3.py;
- builds that class (llama_eagle.py / llama_eagle3.py over llama.py) and runs its own `load_weights` over
  model.safetensors;
- runs SGLang's sharing of the target's embedding and lm_head after loading (the model's own
  `set_embed_and_head` / `set_embed`, with the token map read by spec_utils.py `load_token_map`);
- for EAGLE-3, reads the fused target layers with llama.py `set_eagle3_layers_to_capture` and compares them with
  the head's, and the draft-to-target token ids SGLang ends up with (hot_token_id or token map) with the head's.
Problems reported: parameters never (or only partly) loaded, checkpoint tensors SGLang skipped, shape mismatches
(SGLang would stop there; the check goes on to list all), SGLang raising, a RoPE base other than the target's,
fused layers or draft token ids other than the head's. Exit code 1 on any problem. The few SGLang rules that are
restated rather than run are printed with the stand-ins (RESTATED). `--self-test` also breaks exports on purpose
(SGLang's known failure modes) and checks that every one is reported (and that one SGLang must load is not).
Not part of the test run: it needs the wheel. scripts/check_exports.py does the same for SafeAILab/EAGLE's own
model code.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import logging
import math
import re
import shutil
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

# ----------------------------------------------------------------------------- SGLang's own source


class Wheel:
    """Python source files read from an engine's wheel (nothing is installed or extracted to disk)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.zip = zipfile.ZipFile(self.path)
        self.names = set(self.zip.namelist())
        self.version = self.path.name.split("-")[1]

    def source(self, relpath: str) -> str:
        if relpath not in self.names:
            raise SystemExit(
                f"error: {self.path.name} has no {relpath}; this script reads that engine file "
                "(a different engine version may have moved it)"
            )
        return self.zip.read(relpath).decode("utf-8")


def find_wheel(folder: Path, name: str, explicit: Path | None) -> Path:
    if explicit is not None:
        if not explicit.is_file():
            raise SystemExit(f"error: --{name}-wheel {str(explicit)!r} is not a file")
        return explicit
    found = sorted(folder.glob(f"{name}-*.whl"))
    if not found:
        raise SystemExit(
            f"error: no {name}-*.whl in {str(folder)!r}; run `pip download --no-deps {name}` there "
            f"or pass --{name}-wheel"
        )
    return found[-1]


def definition(text: str, qualname: str, origin: str, namespace: dict):
    """Execute one top-level function/class or one method (`Class.method`) of an engine file in `namespace`.

    Compiled from the file's own syntax tree, so tracebacks point at the engine file's real line numbers."""
    cls_name, _, name = qualname.rpartition(".")
    body = ast.parse(text).body
    if cls_name:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls_name]
        if not classes:
            raise SystemExit(f"error: {origin} has no class {cls_name}")
        body = classes[0].body
    nodes = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
    if not nodes:
        raise SystemExit(f"error: {origin} defines no {qualname}; this script runs that engine function")
    exec(compile(ast.Module(body=[nodes[0]], type_ignores=[]), origin, "exec"), namespace)  # noqa: S102 the point
    return namespace[name]


class Sandbox:
    """The modules one engine's code imports: its own files executed as modules, stand-ins for the rest.

    They are visible in sys.modules only inside `active()`, so nothing else sees them."""

    def __init__(self, label: str):
        self.label = label
        self.modules: dict[str, types.ModuleType] = {}
        self.stand_ins: list[tuple[str, str, str]] = []  # (module, names, why)
        self.executed: list[str] = []

    def _module(self, name: str) -> types.ModuleType:
        if name not in self.modules:
            module = types.ModuleType(name)
            module.__path__ = []  # every module may be a package: `from a.b import c` needs a.b's parents
            module.__package__ = name
            self.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(self._module(parent), child, module)
        return self.modules[name]

    def stub(self, name: str, why: str, **attrs):
        module = self._module(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        self.stand_ins.append((name, ", ".join(sorted(attrs)), why))

    def own(self, module: str, attr: str, value, origin: str):
        """A stand-in module's attribute that is the engine's own definition (see `definition`)."""
        setattr(self._module(module), attr, value)
        self.executed.append(f"{origin}: {attr}")

    def run(self, name: str, text: str, origin: str) -> types.ModuleType:
        module = self._module(name)
        module.__file__ = origin
        module.__package__ = name.rpartition(".")[0]
        with self.active():
            exec(compile(text, origin, "exec"), module.__dict__)  # noqa: S102 running the engine's file is the point
        self.executed.append(origin)
        return module

    @contextlib.contextmanager
    def active(self):
        saved = {name: sys.modules.get(name) for name in self.modules}
        sys.modules.update(self.modules)
        try:
            yield self
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


# ----------------------------------------------------------------------------- stand-ins


class NoWeights(nn.Module):
    """A layer without parameters (attention kernel, activation, logits processor): built, never run."""

    def __init__(self, *args, **kwargs):
        super().__init__()


class StandInLinear(nn.Module):
    """A parallel linear layer as SGLang registers it at tensor-parallel size 1: weight [sum(outputs), input],
    optional bias; its weight_loader copies a checkpoint tensor into the rows of shard `loaded_shard_id` (q/k/v by
    name, merged parts by index) or, without a shard, into the whole parameter, and fails on a shape mismatch, as
    SGLang's layers do."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, shard_names=None):
        super().__init__()
        self.input_size, self.output_sizes, self.shard_names = input_size, list(output_sizes), shard_names
        self.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(output_sizes)), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        shard, target = loaded_shard_id, param.data
        if shard is not None:
            index = self.shard_names.index(shard) if isinstance(shard, str) else int(shard)
            target = target.narrow(0, sum(self.output_sizes[:index]), self.output_sizes[index])
        if tuple(target.shape) != tuple(loaded_weight.shape):
            where = f"shard {shard!r} of shape" if shard is not None else "parameter of shape"
            raise AssertionError(f"tensor of shape {tuple(loaded_weight.shape)} into {where} {tuple(target.shape)}")
        target.copy_(loaded_weight)


class QKVParallelLinear(StandInLinear):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=True, *args, **kwargs):
        kv = total_num_kv_heads or total_num_heads
        super().__init__(
            hidden_size, [total_num_heads * head_size, kv * head_size, kv * head_size], bias, ["q", "k", "v"]
        )


class MergedColumnParallelLinear(StandInLinear):
    def __init__(self, input_size, output_sizes, bias=True, *args, **kwargs):
        super().__init__(input_size, output_sizes, bias)


class RowParallelLinear(StandInLinear):
    def __init__(self, input_size, output_size, bias=True, *args, **kwargs):
        super().__init__(input_size, [output_size], bias)


class RMSNorm(nn.Module):
    """RMSNorm's one parameter, `weight` [hidden]."""

    def __init__(self, hidden_size, eps=1e-6, *args, **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def fuse_input_quant(self, *args, **kwargs):  # SGLang: fuses activation quantization; none here
        pass


class VocabParallelEmbedding(nn.Module):
    """Embedding / lm_head weight [vocab, hidden] at tensor-parallel size 1, without SGLang's padding of the
    vocabulary to a multiple of 64 (its weight_loader checks the unpadded size, as this one does)."""

    def __init__(self, num_embeddings, embedding_dim, *args, **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight):
        if tuple(param.shape) != tuple(loaded_weight.shape):
            raise AssertionError(
                f"tensor of shape {tuple(loaded_weight.shape)} into parameter of shape {tuple(param.shape)}"
            )
        param.data.copy_(loaded_weight)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RopeRecorder:
    """get_rope: returns a parameter-free module and records the RoPE base each layer asked for."""

    def __init__(self):
        self.bases: list[float] = []

    def __call__(self, *args, **kwargs):
        base = kwargs.get("base")  # llama.py / llama_eagle3.py: get_rope(..., base=rope_theta, ...)
        self.bases.append(float(base) if base is not None else math.nan)
        return NoWeights()


def not_exercised(what: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"{what} is a stand-in that these exports must not reach")

    return fail


# SGLang behaviour this script restates instead of running (printed with the stand-ins).
RESTATED = [
    "spec_aux_hidden_state.py: the layer ids come from eagle_config['eagle_aux_hidden_state_layer_ids']",
    "llama.py LlamaModel.forward: a layer in layers_to_capture records its input (the previous layer's output)",
    (
        "eagle_worker_v2.py init_lm_head: EAGLE-1/2 lm_head = target lm_head rows [token map], then "
        "set_embed_and_head (run); EAGLE-3: set_embed, or set_embed_and_head if load_lm_head_from_target (run)"
    ),
    'llama_eagle3.py load_weights: "t2d" skipped (pattern checked in the source), d2t -> hot_token_id (run)',
    "hf_transformers_utils.get_config: transformers AutoConfig; ModelConfig is not run",
]

PP_GROUP = SimpleNamespace(world_size=1, is_first_rank=True, is_last_rank=True, rank_in_group=0)
LINEARS = {
    "QKVParallelLinear": QKVParallelLinear,
    "MergedColumnParallelLinear": MergedColumnParallelLinear,
    "RowParallelLinear": RowParallelLinear,
}


# ----------------------------------------------------------------------------- auditing one load


@dataclass
class Audit:
    """What one engine did with one export."""

    engine: str
    export: str
    model_class: str = "-"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        status = "ok" if not self.problems else f"{len(self.problems)} problem(s)"
        lines = [f"[{self.engine}] {self.export}: {self.model_class}: {status}"]
        lines += [f"    {n}" for n in self.notes] + [f"    PROBLEM {p}" for p in self.problems]
        return "\n".join(lines)


@dataclass
class Export:
    """An export folder and what the head it came from expects of an engine."""

    folder: Path
    fmt: str  # "sglang" (EAGLE-1/2) or "eagle3"
    layers: list[int] | None  # EAGLE-3: the target layers whose outputs the head fuses
    draft_ids: list[int] | None  # the target id of each draft token; None: the full vocabulary


class LoadRecorder:
    """Wraps every parameter's weight_loader to record which checkpoint tensor reached which parameter.

    Floating parameters are filled with NaN first, so a parameter the loader never (or only partly) wrote
    still holds NaN afterwards. Parameters without a weight_loader get `default_loader`, the engine's own
    default_weight_loader, which is what the engine's `getattr(param, "weight_loader", default_weight_loader)`
    falls back to. A shape mismatch is recorded and the load goes on (the engine would stop at the first)."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor], default_loader):
        self.by_pointer = {t.data_ptr(): name for name, t in state.items()}
        self.reached: set[str] = set()  # checkpoint names that reached some parameter
        self.written: set[int] = set()  # ids of parameters written
        self.mismatches: list[str] = []
        for name, param in model.named_parameters():
            if param.is_floating_point():
                param.data.fill_(math.nan)
            param.weight_loader = self._wrap(name, getattr(param, "weight_loader", default_loader))

    def _wrap(self, param_name, loader):
        def recording_loader(param, loaded_weight, *args, **kwargs):
            source = self.by_pointer.get(loaded_weight.data_ptr(), "<a tensor not in the checkpoint>")
            self.reached.add(source)
            try:
                loader(param, loaded_weight, *args, **kwargs)
            except AssertionError as e:
                self.mismatches.append(f"{source} -> {param_name}: {e}")
                return
            self.written.add(id(param))

        return recording_loader


def audit_load(
    audit: Audit, model: nn.Module, state: dict, load, default_loader, dropped: dict[str, str], after_load=None
):
    """Run the engine's `load` over `state`, then `after_load` (the engine's own sharing of target weights); record
    in `audit` unloaded parameters, skipped tensors and shape mismatches. `dropped`: checkpoint names the engine's
    code consumes without a weight_loader, with where (never reported as skipped)."""
    recorder = LoadRecorder(model, state, default_loader)
    before = {id(p): name for name, p in model.named_parameters()}
    try:
        load(iter(state.items()))
    except Exception as e:  # noqa: BLE001 the engine's loader raising is itself the finding: reported
        audit.problems.append(f"the engine's load_weights raised {type(e).__name__}: {e}")
        return
    audit.problems += [f"shape mismatch: {m}" for m in recorder.mismatches]
    skipped = [n for n in state if n not in recorder.reached and not any(d in n for d in dropped)]
    if skipped:
        audit.problems.append(f"checkpoint tensors the engine skipped: {skipped}")
    if after_load is not None:
        try:
            after_load()
        except Exception as e:  # noqa: BLE001 reported as the finding
            audit.problems.append(f"the engine's sharing of the target's weights raised {type(e).__name__}: {e}")
            return
    shared, missing = [], []
    after = dict(model.named_parameters(remove_duplicate=False))
    shared += [f"{name} (now a plain tensor)" for name in before.values() if name not in after]
    shared += [name for name, param in after.items() if id(param) not in before]
    for name, param in model.named_parameters():
        if id(param) not in before:
            continue
        if param.is_floating_point() and torch.isnan(param).any():
            left = int(torch.isnan(param).sum())
            missing.append(name if left == param.numel() else f"{name} ({left} of {param.numel()} values)")
        elif not param.is_floating_point() and id(param) not in recorder.written:
            missing.append(name)
    if missing:
        audit.problems.append(f"parameters never loaded: {missing}")
    audit.notes.append(
        f"{len(state)} tensors -> {len(recorder.written)} parameters"
        + (f"; taken from the target after loading: {shared}" if shared else "")
        + (f"; consumed otherwise: {sorted(d for d in dropped if any(d in n for n in state))}" if dropped else "")
    )


def check_rope(audit: Audit, rope: RopeRecorder, theta: float):
    if not rope.bases:
        audit.problems.append("no RoPE was built")
    elif any(abs(b - theta) > 1e-6 * theta for b in rope.bases):
        audit.problems.append(f"RoPE base {rope.bases}, the target's is {theta}")
    else:
        audit.notes.append(f"RoPE base {rope.bases[0]:g} (the target's)")


def check_fused(audit: Audit, captured: list[int], head_layers: list[int], how: str):
    if sorted(captured) != sorted(head_layers):
        audit.problems.append(
            f"fuses the outputs of target layers {captured} ({how}); the head was trained on {sorted(head_layers)}"
        )
    else:
        audit.notes.append(f"fuses the outputs of target layers {captured} ({how})")


def check_vocab(audit: Audit, ids: torch.Tensor | None, expected: list[int] | None, how: str):
    """The target id the engine gives each draft token must be the head's."""
    if expected is None:
        return
    if ids is None:
        audit.problems.append(f"the engine has no draft-to-target map ({how}); the head drafts {len(expected)} tokens")
    elif ids.long().tolist() != expected:
        audit.problems.append(f"the engine maps draft tokens to other target ids than the head ({how})")
    else:
        audit.notes.append(f"draft token i -> target id as the head's, for all {len(expected)} ({how})")


def drop_rule(source: str, name: str, origin: str) -> dict[str, str]:
    """A checkpoint name the engine's code drops on purpose (`if "name" in name: continue`), confirmed in its source."""
    if not re.search(rf'if "{name}" in name:\s*\n\s*continue', source):
        raise SystemExit(f"error: {origin} no longer skips {name!r} the way this script expects; re-read it")
    return {name: origin}


# ----------------------------------------------------------------------------- SGLang


class SGLang:
    """SGLang's EAGLE draft classes, built from the wheel's source with stand-ins."""

    MODELS = "sglang/srt/models/"

    def __init__(self, wheel: Wheel):
        self.wheel, self.box, self.rope = wheel, Sandbox(f"SGLang {wheel.version}"), RopeRecorder()
        self._own_helpers()
        self._stub_runtime()
        self._stub_layers()
        self._run_models()
        self.sources = {n: wheel.source(f"{self.MODELS}{n}.py") for n in ("llama_eagle3",)}

    def _own_helpers(self):
        """The engine's own default_weight_loader, add_prefix and get_layer_id, placed in their stand-in modules."""
        box, w = self.box, self.wheel
        p = "sglang/srt/model_loader/weight_utils.py"
        self.default_loader = definition(w.source(p), "default_weight_loader", p, {"torch": torch})
        box.own("sglang.srt.model_loader.weight_utils", "default_weight_loader", self.default_loader, p)
        box.stub(
            "sglang.srt.model_loader.weight_utils",
            "only for quantized checkpoints",
            kv_cache_scales_loader=not_exercised("kv_cache_scales_loader"),
            maybe_remap_kv_scale_name=not_exercised("maybe_remap_kv_scale_name"),
        )
        p = "sglang/srt/utils/common.py"
        box.own("sglang.srt.utils", "add_prefix", definition(w.source(p), "add_prefix", p, {}), p)
        p = "sglang/srt/layers/utils/common.py"
        box.own("sglang.srt.layers.utils", "get_layer_id", definition(w.source(p), "get_layer_id", p, {"re": re}), p)

    def _stub_runtime(self):
        """Stand-ins for the environment flags, platform, process groups and draft-parallel settings."""
        box = self.box
        env = re.search(
            r"SGLANG_ENABLE_WEIGHT_LOADER_V2 = EnvBool\((True|False)\)", self.wheel.source("sglang/srt/environ.py")
        )
        if env is None or env.group(1) != "False":
            raise SystemExit("error: this SGLang's default weight loader is not the legacy one this script runs")
        flag = SimpleNamespace(get=lambda: False)
        box.stub(
            "sglang.srt.environ",
            "SGLANG_ENABLE_WEIGHT_LOADER_V2 at its default (False, read from environ.py)",
            envs=SimpleNamespace(SGLANG_ENABLE_WEIGHT_LOADER_V2=flag, SGLANG_USE_MODELSCOPE=flag),
        )
        box.stub(
            "sglang.srt.utils",
            "CUDA platform; target-only helpers unused",
            is_npu=lambda: False,
            is_xpu=lambda: False,
            make_pp_layers=not_exercised("make_pp_layers"),
        )
        box.stub("sglang.utils", "unused", get_exception_traceback=lambda: "")
        box.stub("sglang.srt.distributed", "target-only", get_pp_indices=not_exercised("get_pp_indices"))
        box.stub(
            "sglang.srt.runtime_context",
            "tensor/pipeline-parallel size 1, no draft window",
            get_parallel=lambda: SimpleNamespace(tp_size=1, pp_group=PP_GROUP, enable_dp_lm_head=False),
            get_spec=lambda: SimpleNamespace(speculative_draft_window_size=None),
        )
        box.stub(
            "sglang.srt.platforms",
            "no device",
            current_platform=SimpleNamespace(empty_cache=lambda: None, synchronize=lambda: None),
        )
        box.stub(
            "sglang.srt.configs.draft_parallel",
            "constants",
            DraftTPExecution=SimpleNamespace(SINGLE_GROUP="single_group"),
            DraftParallelSpec=lambda **kw: SimpleNamespace(**kw),
        )

    def _stub_layers(self):
        """Stand-ins for the layers: their parameters at tensor-parallel size 1, no kernels."""
        box = self.box
        box.stub("sglang.srt.layers.activation", "no weights", SiluAndMul=NoWeights)
        box.stub("sglang.srt.layers.aux_hidden_states", "forward only", AuxHiddenStateList=list)
        box.stub("sglang.srt.layers.dual_gemm", "no weights of its own", DualGemm=NoWeights)
        box.stub(
            "sglang.srt.layers.layer_boundary",
            "residual/stage bookkeeping of the forward pass",
            layer_stack=contextlib.nullcontext,
            append_stages=lambda *a: (None, None),
            declare_attn=lambda **k: None,
            declare_ffn=lambda **k: None,
        )
        box.stub("sglang.srt.layers.layer_boundary.residual", "forward only", batch=None)
        box.stub("sglang.srt.layers.layer_boundary.residual.add_norm", "constant", NORM_QUANT_READOUT=None)
        box.stub("sglang.srt.layers.layer_boundary.residual.post_norm", "constant", PLAIN_READOUT=None)
        box.stub("sglang.srt.layers.layernorm", "weight [hidden]", RMSNorm=RMSNorm)
        box.stub(
            "sglang.srt.layers.linear",
            "tp=1 shapes and shard offsets, see StandInLinear",
            LinearParallelGroup=str,
            resolve_linear_parallel_group=lambda *a, **k: None,
            **LINEARS,
        )
        box.stub(
            "sglang.srt.layers.logits_processor", "no weights", LogitsProcessor=NoWeights, LogitsProcessorOutput=object
        )
        box.stub("sglang.srt.layers.pooler", "no weights", Pooler=NoWeights, PoolingType=SimpleNamespace(LAST="last"))
        box.stub("sglang.srt.layers.quantization.base_config", "type only", QuantizationConfig=object)
        box.stub("sglang.srt.layers.quantization.fp8_activation", "no weights", DenseSiluAndMulQuant=NoWeights)
        box.stub("sglang.srt.layers.radix_attention", "no weights, never run", RadixAttention=NoWeights)
        box.stub("sglang.srt.layers.rotary_embedding", "records the RoPE base", get_rope=self.rope)
        box.stub("sglang.srt.layers.utils", "target-only", PPMissingLayer=NoWeights)
        box.stub(
            "sglang.srt.layers.vocab_parallel_embedding",
            "[vocab, hidden], no vocabulary padding",
            VocabParallelEmbedding=VocabParallelEmbedding,
            ParallelLMHead=ParallelLMHead,
        )
        box.stub(
            "sglang.srt.model_executor.forward_batch_info", "type only", ForwardBatch=object, PPProxyTensors=object
        )

    def _run_models(self):
        """The model files and spec_utils.py's load_token_map, from the wheel."""
        box, w = self.box, self.wheel
        self.modules = {
            n: box.run(f"sglang.srt.models.{n}", w.source(f"{self.MODELS}{n}.py"), f"{self.MODELS}{n}.py")
            for n in ("llama", "llama_eagle", "llama_eagle3")
        }
        p = "sglang/srt/speculative/spec_utils.py"
        self.load_token_map = definition(
            w.source(p),
            "load_token_map",
            p,
            {
                "os": __import__("os"),
                "torch": torch,
                "List": list,
                "envs": box.modules["sglang.srt.environ"].envs,
                "snapshot_download": not_exercised("snapshot_download"),
            },
        )
        box.executed.append(f"{p}: load_token_map")

    def check(self, export: Export, target) -> Audit:
        from safetensors.torch import load_file
        from transformers import AutoConfig

        folder, head_layers = export.folder, export.layers
        eagle3 = head_layers is not None
        audit = Audit(
            f"SGLang {self.wheel.version}", f"{folder.name} (--speculative-algorithm {'EAGLE3' if eagle3 else 'EAGLE'})"
        )
        config = AutoConfig.from_pretrained(folder)  # hf_transformers_utils.get_config
        arch = (config.architectures or ["<none>"])[0]
        classes = {c.__name__: c for n in ("llama_eagle", "llama_eagle3") for c in self.modules[n].EntryClass}
        if arch not in classes:
            audit.problems.append(
                f"architecture {arch!r} is not an EntryClass of SGLang's llama_eagle(3).py ({sorted(classes)})"
            )
            return audit
        audit.model_class = f"{arch} ({classes[arch].__module__})"
        self.rope.bases.clear()
        state = load_file(str(folder / "model.safetensors"))
        embed = target.get_input_embeddings().weight  # the target's parameters, as SGLang passes them
        head = target.get_output_embeddings().weight
        with self.box.active():
            try:
                model = classes[arch](config, quant_config=None, prefix="")
            except Exception as e:  # noqa: BLE001 reported as the finding
                audit.problems.append(f"building {arch} from config.json raised {type(e).__name__}: {e}")
                return audit
            dropped = {}
            if eagle3:
                dropped = {
                    **drop_rule(self.sources["llama_eagle3"], "t2d", f"{self.MODELS}llama_eagle3.py"),
                    "d2t": "llama_eagle3.py load_weights: hot_token_id = d2t + arange",
                }

            def share():  # eagle_worker_v2.py init_token_map / init_lm_head
                if eagle3:
                    if model.load_lm_head_from_target:
                        model.set_embed_and_head(embed, head)
                    else:
                        model.set_embed(embed)
                    return
                token_map = folder / "token_map.pt"
                shared_head, hot = head, None
                if token_map.is_file():  # passed as --speculative-token-map
                    hot = self.load_token_map(str(token_map))
                    shared_head = head.clone()  # eagle_worker_v2.py init_lm_head, as written there
                    shared_head.data = shared_head.data[hot]
                check_vocab(audit, hot, export.draft_ids, "token_map.pt through load_token_map")
                model.set_embed_and_head(embed, shared_head)

            audit_load(audit, model, state, model.load_weights, self.default_loader, dropped, share)
            check_rope(audit, self.rope, target_theta(target))
            if eagle3:
                self._check_eagle3(audit, model, config, export)
        return audit

    def _check_eagle3(self, audit, model, config, export):
        check_vocab(audit, model.hot_token_id, export.draft_ids, "hot_token_id from d2t")
        # spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state: eagle_config["eagle_aux_hidden_state_layer_ids"]
        ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        fake_target = SimpleNamespace(
            pp_group=PP_GROUP,
            config=SimpleNamespace(num_hidden_layers=0),
            model=SimpleNamespace(),
            capture_aux_hidden_states=False,
        )
        self.modules["llama"].LlamaForCausalLM.set_eagle3_layers_to_capture(fake_target, ids)
        # llama.py LlamaModel.forward: a layer in layers_to_capture records its input, the previous layer's output
        captured = [k - 1 for k in fake_target.model.layers_to_capture]
        check_fused(audit, captured, export.layers, f"eagle_config ids {ids} through set_eagle3_layers_to_capture")
        if len(ids or ()) != model.model.num_aux_hidden_states:
            audit.problems.append(
                f"fc takes {model.model.num_aux_hidden_states} hidden states, the target gives {len(ids or ())}"
            )


# ----------------------------------------------------------------------------- exports and the run


def target_theta(target) -> float:
    params = getattr(target.config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(target.config, "rope_theta", 10000.0)))


def write_exports(heads, target, out: Path) -> list[Export]:
    """Every head exported by eagletree's own export code in the format SGLang loads: EAGLE-1/2 heads as 'sglang',
    EAGLE-3 heads as 'eagle3'."""
    from eagletree.draft_heads.export import export_head

    exports = []
    for i, head in enumerate(heads):
        eagle3 = head.config.head_type == "eagle3"
        fmt = "eagle3" if eagle3 else "sglang"
        folder = export_head(head, out / f"head{i}-{fmt}", fmt, target=target)
        draft_ids = None if head.config.draft_vocab_size is None else head.d2t.long().tolist()
        exports.append(Export(folder, fmt, list(head.fused_layers) if eagle3 else None, draft_ids))
    return exports


def edit_config(folder: Path, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def edit_weights(folder: Path, drop=(), **replace):
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    state = {k: v for k, v in state.items() if k not in drop}
    state.update(replace)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def broken_exports(exports: list[Export], work: Path) -> list[tuple[str, Export, bool]]:
    """Copies of the exports broken the ways SGLang has failed on such files: (what, export, whether SGLang must
    report it). The copies are of the first 'sglang' and the first 'eagle3' export over a draft vocabulary (the token
    map and d2t cases need one)."""
    by_fmt = {}
    for export in exports:
        if export.draft_ids is not None:
            by_fmt.setdefault(export.fmt, export)
    if set(by_fmt) != {"sglang", "eagle3"}:
        raise SystemExit(
            "error: --self-test breaks an EAGLE-1/2 and an EAGLE-3 export, each over a draft vocabulary: pass one "
            "head of each kind with --head, or none"
        )
    cases = []

    def case(what, fmt, reported, change):
        src = by_fmt[fmt]
        dst = work / f"broken{len(cases)}-{fmt}"
        shutil.copytree(src.folder, dst)
        change(dst)
        cases.append((what, Export(dst, fmt, src.layers, src.draft_ids), reported))

    break_sglang(case)
    break_eagle3(case, by_fmt["eagle3"].draft_ids)
    return cases


def aux_layer_ids(folder: Path) -> list[int]:
    """The EAGLE-3 export's layer ids as SGLang reads them (eagle_config)."""
    return json.loads((folder / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def aux_eagle_config(ids) -> dict:
    """config.json's eagle_config entry naming `ids` as the layers to capture."""
    return {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}


def break_sglang(case):
    """The EAGLE-1/2 'sglang' export broken the ways SGLang must report."""
    case(
        "tie_word_embeddings true (SGLang ties lm_head to the draft's embedding)",
        "sglang",
        True,
        lambda d: edit_config(d, tie_word_embeddings=True),
    )
    case("no fc.bias (SGLang's fc always has one)", "sglang", True, lambda d: edit_weights(d, drop=["fc.bias"]))
    case(
        "architectures LlamaForCausalLM (not an SGLang EAGLE class)",
        "sglang",
        True,
        lambda d: edit_config(d, architectures=["LlamaForCausalLM"]),
    )
    case(
        "token_map.pt in another order",
        "sglang",
        True,
        lambda d: torch.save(torch.load(d / "token_map.pt")[::-1], d / "token_map.pt"),
    )


def break_eagle3(case, draft_ids: list[int]):
    """The 'eagle3' export broken the ways SGLang must report (and one it must take); `draft_ids` are the head's
    target ids."""
    case("tie_word_embeddings true", "eagle3", True, lambda d: edit_config(d, tie_word_embeddings=True))
    case("no d2t", "eagle3", True, lambda d: edit_weights(d, drop=["d2t"]))
    case("d2t as target ids instead of offsets", "eagle3", True, lambda d: edit_weights(d, d2t=torch.tensor(draft_ids)))
    case(
        "eagle_config layer ids + 1 (SGLang adds 1 itself)",
        "eagle3",
        True,
        lambda d: edit_config(d, **aux_eagle_config([i + 1 for i in aux_layer_ids(d)])),
    )
    case(
        "two layer ids in eagle_config (fc built for 2 hidden states, the file has 3)",
        "eagle3",
        True,
        lambda d: edit_config(d, **aux_eagle_config(aux_layer_ids(d)[:2])),
    )
    case(
        "no embed_tokens (SGLang takes the target's; only EAGLE's own code needs it, see check_exports.py)",
        "eagle3",
        False,
        lambda d: edit_weights(d, drop=["embed_tokens.weight"]),
    )


def self_test(sglang: SGLang, exports: list[Export], target, work: Path) -> int:
    """Load the broken copies of `exports`; the number of cases SGLang did not treat as it must."""
    print("\n== exports broken on purpose (each must be reported by SGLang, unless marked 'must load')")
    failures = 0
    for what, export, reported in broken_exports(exports, work):
        audit = sglang.check(export, target)
        caught = bool(audit.problems)
        verdict = "as expected" if caught == reported else "MISSED" if reported else "WRONGLY REPORTED"
        failures += caught != reported
        expect = "" if reported else " (must load)"
        print(f"-- {export.fmt}: {what}{expect}: {'reported' if caught else 'not reported'}: {verdict}")
        for p in audit.problems:
            print(f"    [{audit.engine}] {p}")
    return failures


def load_heads(args):
    """The target, and the heads to export: --head folders, or the shipped head and two random EAGLE-3 heads."""
    from eagletree.draft_heads import Eagle3Head, load_head
    from eagletree.loading import SHIPPED_HEADS
    from eagletree.target import load_target

    target, _ = load_target(args.target, dtype=torch.bfloat16, device="cpu")  # as served, and as exported
    if args.head:
        return target, [load_head(h, target_config=target.config) for h in args.head]
    torch.manual_seed(0)
    return target, [
        load_head(SHIPPED_HEADS[args.target], target_config=target.config),
        Eagle3Head.for_target(target, torch.arange(0, target.config.vocab_size, 7)).eval(),
        Eagle3Head.for_target(target).eval(),  # the whole vocabulary: the training default
    ]


def print_provenance(box: Sandbox):
    """What ran as SGLang's own code, what was stood in for, and what was restated."""
    print(f"\n== {box.label}: the engine's own code that ran")
    print("\n".join(f"  {e}" for e in box.executed))
    print(f"== {box.label}: stand-ins (not the engine's code)")
    print("\n".join(f"  {m}: {names} -- {why}" for m, names, why in box.stand_ins))
    print(f"== {box.label}: RESTATED (engine rules applied by this script, not run)")
    print("\n".join(f"  {r}" for r in RESTATED))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, required=True, help="folder with sglang-*.whl")
    parser.add_argument("--sglang-wheel", type=Path, default=None)
    parser.add_argument(
        "--head",
        action="append",
        default=None,
        help="an eagletree head folder (EAGLE-1/2 or EAGLE-3); repeatable. Default: the shipped head "
        "and two random EAGLE-3 heads",
    )
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--self-test", action="store_true", help="also check broken exports are reported")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)

    sglang = SGLang(Wheel(find_wheel(args.wheels, "sglang", args.sglang_wheel)))
    target, heads = load_heads(args)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        exports = write_exports(heads, target, Path(tmp))
        print("== eagletree's exports")
        for export in exports:
            audit = sglang.check(export, target)
            print(audit.line())
            failures += bool(audit.problems)
        if args.self_test:
            failures += self_test(sglang, exports, target, Path(tmp))
    print_provenance(sglang.box)
    print("\nok: SGLang's own loaders take every export" if not failures else f"\n{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

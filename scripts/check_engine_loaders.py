"""Run vLLM's and SGLang's own draft-model classes, weight loading and config reading on eagletree's exports, on CPU.

    python scripts/check_engine_loaders.py --wheels DIR [--vllm-wheel X.whl] [--sglang-wheel Y.whl]
        [--head DIR ...] [--target smollm2-135m] [--self-test]

DIR holds the engines' wheels (`pip download --no-deps vllm sglang`); neither engine is installed: the
Python source of the modules below is read out of the wheels and executed, and the GPU, distributed and
kernel modules they import are replaced by the stand-ins listed in the output. For each head (default:
the shipped EAGLE-1/2 head and two random EAGLE-3 heads of the same target, over a draft vocabulary and
over the whole one) the script writes eagletree's
exports, then for each engine:
- reads config.json with transformers' AutoConfig (both engines do) and, for vLLM, the engine's own
  EAGLEConfig (transformers_utils/configs/eagle.py), which renames the architecture; picks the model class
  the way the engine's registry does (vLLM: registry.py's speculative-decoding table; SGLang: the
  `EntryClass` of models/llama_eagle.py and llama_eagle3.py);
- builds that class (vLLM: llama_eagle.py / llama_eagle3.py over llama.py and models/utils.py; SGLang:
  llama_eagle.py / llama_eagle3.py over llama.py) and runs its own `load_weights` over model.safetensors;
  vLLM's AutoWeightsLoader and WeightsMapper are the engine's own (models/utils.py);
- runs the engine's own sharing of the target's embedding and lm_head after loading (vLLM:
  llm_base_proposer.py `_maybe_share_embeddings` / `_maybe_share_lm_head`; SGLang: the model's own
  `set_embed_and_head` / `set_embed`, with the token map read by spec_utils.py `load_token_map`);
- for EAGLE-3, reads the fused target layers with the engine's own code where it is small enough
  (vLLM: gpu_model_runner.py `_get_eagle3_aux_layers_from_config`; SGLang: llama.py
  `set_eagle3_layers_to_capture`) and compares them with the head's, and the draft-to-target token ids
  the engine ends up with (vLLM's draft_id_to_target_id, SGLang's hot_token_id or token map) with the head's.
Problems reported: parameters never (or only partly) loaded, checkpoint tensors the engine skipped,
shape mismatches (the engine would stop there; the check goes on to list all), the engine raising, a RoPE
base other than the target's, fused layers or draft token ids other than the head's. Exit code 1 on any
problem. The few engine rules that are restated rather than run are printed with the stand-ins (RESTATED).
`--self-test` also breaks exports on purpose (each engine's known failure modes) and checks that every one
is reported. Not part of the test run: it needs the wheels. scripts/check_exports.py does the same for
SafeAILab/EAGLE's own model code.
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

# ----------------------------------------------------------------------------- the engines' own source


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

    They are visible in sys.modules only inside `active()`, so the two engines never see each other's."""

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
    """A parallel linear layer as both engines register it at tensor-parallel size 1: weight [sum(outputs), input],
    optional bias; its weight_loader copies a checkpoint tensor into the rows of shard `shard_id` (q/k/v by name,
    merged parts by index) or, without a shard, into the whole parameter, and fails on a shape mismatch, as the
    engines' layers do. The shard id comes as an argument (SGLang) or as the tensor's `shard_id` attribute (vLLM's
    WeightsMapper sets it)."""

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
        shard = loaded_shard_id if loaded_shard_id is not None else getattr(loaded_weight, "shard_id", None)
        target = param.data
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


class ReplicatedLinear(StandInLinear):
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
    """Embedding / lm_head weight [vocab, hidden] at tensor-parallel size 1, without the engines' padding of the
    vocabulary to a multiple of 64 (their weight_loader checks the unpadded size, as this one does)."""

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

    def tie_weights(self, embed_tokens):  # vLLM ParallelLMHead.tie_weights
        return embed_tokens


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RopeRecorder:
    """get_rope: returns a parameter-free module and records the RoPE base each layer asked for."""

    def __init__(self):
        self.bases: list[float] = []

    def __call__(self, *args, **kwargs):
        params = kwargs.get("rope_parameters") or {}
        base = kwargs.get("base", params.get("rope_theta"))
        self.bases.append(float(base) if base is not None else math.nan)
        return NoWeights()


def passthrough(*args, **kwargs):
    """A decorator used bare or with arguments that returns what it decorates (torch.compile and reload hooks)."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda obj: obj


def not_exercised(what: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"{what} is a stand-in that these exports must not reach")

    return fail


def engine_logger(name):
    log = logging.getLogger(name)
    for level in ("debug", "info", "warning"):
        setattr(log, f"{level}_once", getattr(log, level))
    return log


# Engine behaviour this script restates instead of running (printed with the stand-ins).
RESTATED = {
    "vLLM": [
        "llama.py LlamaModel.forward: aux layer id i is the output of target layer i - 1 (recorded after layer i - 1)",
        "llama_eagle3.py compute_logits: target id of draft token i = i + draft_id_to_target_id[i]",
        'llama_eagle3.py load_weights: names containing "t2d" are skipped (the pattern is checked in the source)',
        (
            "speculative.py: EAGLEConfig(draft config, method=..., model_type='eagle'); the rest of SpeculativeConfig "
            "and ModelConfig is not run"
        ),
    ],
    "SGLang": [
        "spec_aux_hidden_state.py: the layer ids come from eagle_config['eagle_aux_hidden_state_layer_ids']",
        "llama.py LlamaModel.forward: a layer in layers_to_capture records its input (the previous layer's output)",
        (
            "eagle_worker_v2.py init_lm_head: EAGLE-1/2 lm_head = target lm_head rows [token map], then "
            "set_embed_and_head (run); EAGLE-3: set_embed, or set_embed_and_head if load_lm_head_from_target (run)"
        ),
        'llama_eagle3.py load_weights: "t2d" skipped (pattern checked in the source), d2t -> hot_token_id (run)',
        "hf_transformers_utils.get_config: transformers AutoConfig; ModelConfig is not run",
    ],
}

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
    fmt: str  # "vllm", "sglang" or "eagle3"
    layers: list[int] | None  # EAGLE-3: the target layers whose outputs the head fuses
    draft_ids: list[int] | None  # the target id of each draft token; None: the full vocabulary


class LoadRecorder:
    """Wraps every parameter's weight_loader to record which checkpoint tensor reached which parameter.

    Floating parameters are filled with NaN first, so a parameter the loader never (or only partly) wrote
    still holds NaN afterwards. Parameters without a weight_loader get `default_loader`, the engine's own
    default_weight_loader, which is what the engines' `getattr(param, "weight_loader", default_weight_loader)`
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


# ----------------------------------------------------------------------------- vLLM


class VLLM:
    """vLLM's EAGLE draft classes, built from the wheel's source with stand-ins."""

    MODELS = "vllm/model_executor/models/"

    def __init__(self, wheel: Wheel):
        self.wheel, self.box, self.rope = wheel, Sandbox(f"vLLM {wheel.version}"), RopeRecorder()
        self.current = {}
        self._own_helpers()
        self._stub_runtime()
        self._stub_layers()
        self._stub_model_support()
        self._run_models()
        self._run_proposer_methods()
        self.sources = {n: wheel.source(f"{self.MODELS}{n}.py") for n in ("llama_eagle3",)}

    def _own_helpers(self):
        """The engine's own default_weight_loader and without_trust_remote_code, placed in their stand-in modules."""
        box, w = self.box, self.wheel
        box.own(
            "vllm.model_executor.model_loader.weight_utils",
            "default_weight_loader",
            definition(
                w.source(p := "vllm/model_executor/model_loader/weight_utils.py"),
                "default_weight_loader",
                p,
                {"torch": torch},
            ),
            p,
        )
        self.default_loader = box.modules["vllm.model_executor.model_loader.weight_utils"].default_weight_loader
        box.own(
            "vllm.transformers_utils.utils",
            "without_trust_remote_code",
            definition(
                w.source(p := "vllm/transformers_utils/utils.py"), "without_trust_remote_code", p, {"Any": object}
            ),
            p,
        )

    def _stub_runtime(self):
        """Stand-ins for the config, the process group, logging and torch.compile."""
        box = self.box

        class VllmConfig:  # only get_quantization_config is called (models/utils.py get_draft_quant_config)
            @staticmethod
            def get_quantization_config(model_config, load_config):
                if getattr(model_config.hf_config, "quantization_config", None):
                    raise NotImplementedError("quantized drafts are not covered by this check")

        box.stub(
            "vllm.config",
            "the draft config is passed in; no quantization (get_quantization_config -> None)",
            VllmConfig=VllmConfig,
            CacheConfig=object,
            get_current_vllm_config=lambda: self.current["config"],
            get_current_vllm_config_or_none=lambda: self.current.get("config"),
        )
        box.stub(
            "vllm.distributed",
            "one process: tensor- and pipeline-parallel size 1",
            get_pp_group=lambda: PP_GROUP,
            get_tensor_model_parallel_rank=lambda: 0,
            get_tensor_model_parallel_world_size=lambda: 1,
        )
        box.stub("vllm.logger", "Python logging", init_logger=engine_logger)
        box.stub("vllm.compilation.decorators", "no torch.compile", support_torch_compile=passthrough)

    def _stub_layers(self):
        """Stand-ins for the model_executor layers: their parameters at tensor-parallel size 1, no kernels."""
        box = self.box
        box.stub("vllm.model_executor.layers.activation", "no weights", SiluAndMul=NoWeights)
        box.stub(
            "vllm.model_executor.layers.attention",
            "no weights, never run",
            Attention=NoWeights,
            EncoderOnlyAttention=NoWeights,
        )
        box.stub(
            "vllm.model_executor.layers.fusion.fused_act_quant",
            "forward only",
            maybe_fused_act_quant=not_exercised("maybe_fused_act_quant"),
        )
        box.stub("vllm.model_executor.layers.layernorm", "weight [hidden]", RMSNorm=RMSNorm)
        box.stub(
            "vllm.model_executor.layers.linear",
            "tp=1 shapes and shard offsets, see StandInLinear",
            ReplicatedLinear=ReplicatedLinear,
            **LINEARS,
        )
        box.stub("vllm.model_executor.layers.logits_processor", "no weights", LogitsProcessor=NoWeights)
        box.stub("vllm.model_executor.layers.quantization", "type only", QuantizationConfig=object)
        box.stub("vllm.model_executor.layers.quantization.base_config", "type only", QuantizationConfig=object)
        box.stub("vllm.model_executor.layers.rotary_embedding", "records the RoPE base", get_rope=self.rope)
        box.stub(
            "vllm.model_executor.layers.vocab_parallel_embedding",
            "[vocab, hidden], no vocabulary padding",
            VocabParallelEmbedding=VocabParallelEmbedding,
            ParallelLMHead=ParallelLMHead,
        )

    def _stub_model_support(self):
        """Stand-ins for the model interfaces, adapters, types and utilities the model files import."""
        box = self.box

        class SupportsEagleBase:  # interfaces.py defaults, read by process_eagle_weight and the proposer
            has_own_lm_head = False
            has_own_embed_tokens = False

        mixins = {
            n: type(n, (), {})
            for n in (
                "EagleModelMixin",
                "LocalArgmaxMixin",
                "SupportsLoRA",
                "SupportsPP",
                "SupportsQuant",
                "SupportsMultiModal",
            )
        }
        box.stub(
            "vllm.model_executor.model_loader.reload",
            "no quantized reload",
            support_quantized_model_reload_from_hp_weights=passthrough,
        )
        box.stub(
            "vllm.model_executor.models.adapters",
            "pooling adapters unused",
            as_embedding_model=lambda c: c,
            as_seq_cls_model=lambda c: c,
        )
        box.stub(
            "vllm.model_executor.models.interfaces",
            "empty mixins; SupportsEagle(3) carry has_own_lm_head/has_own_embed_tokens = False as interfaces.py",
            SupportsEagle=type("SupportsEagle", (SupportsEagleBase,), {}),
            SupportsEagle3=type("SupportsEagle3", (SupportsEagleBase,), {}),
            supports_any_eagle=lambda m: isinstance(m, SupportsEagleBase),
            **mixins,
        )
        box.stub("vllm.multimodal", "type only", NestedTensors=object)
        box.stub("vllm.multimodal.inputs", "type only", NestedTensors=object)
        box.stub("vllm.sequence", "type only", IntermediateTensors=object)
        box.stub("vllm.utils.math_utils", "ceil division", cdiv=lambda a, b: -(-a // b))
        box.stub("vllm.utils.torch_utils", "no custom ops registered", direct_register_custom_op=lambda **k: None)
        box.stub(
            "vllm.v1.attention.backend",
            "constants",
            AttentionType=SimpleNamespace(DECODER="decoder", ENCODER_ONLY="encoder_only"),
        )

    def _run_models(self):
        """The model files, EAGLEConfig and the speculative-decoding registry, from the wheel."""
        box, w = self.box, self.wheel
        for name in ("utils", "llama", "llama_eagle", "llama_eagle3"):
            path = f"{self.MODELS}{name}.py"
            box.run(f"vllm.model_executor.models.{name}", w.source(path), path)
        p = "vllm/transformers_utils/configs/eagle.py"
        self.EAGLEConfig = box.run("vllm.transformers_utils.configs.eagle", w.source(p), p).EAGLEConfig
        self.registry = self._registry()

    def _run_proposer_methods(self):
        """The proposer's sharing of the target's embedding and lm_head, and the runner's EAGLE-3 aux layer ids."""
        box, w = self.box, self.wheel
        p = "vllm/v1/spec_decode/llm_base_proposer.py"
        share_ns = {"torch": torch, "nn": nn, "get_pp_group": lambda: PP_GROUP, "logger": engine_logger("vllm")}
        self.share_embeddings = definition(
            w.source(p), self._proposer_method(w.source(p), "_maybe_share_embeddings"), p, share_ns
        )
        self.share_lm_head = definition(
            w.source(p), self._proposer_method(w.source(p), "_maybe_share_lm_head"), p, share_ns
        )
        box.executed.append(f"{p}: _maybe_share_embeddings, _maybe_share_lm_head")
        p = "vllm/v1/worker/gpu_model_runner.py"
        self.aux_layers = definition(
            w.source(p), self._proposer_method(w.source(p), "_get_eagle3_aux_layers_from_config"), p, {}
        )
        box.executed.append(f"{p}: _get_eagle3_aux_layers_from_config")

    @staticmethod
    def _proposer_method(text: str, method: str) -> str:
        """`Class.method` for the class of `text` that defines `method`."""
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(n, ast.FunctionDef) and n.name == method for n in node.body
            ):
                return f"{node.name}.{method}"
        raise SystemExit(f"error: no class defines {method}; this script runs that vLLM method")

    def _registry(self) -> dict:
        """registry.py's `_SPECULATIVE_DECODING_MODELS` (architecture -> (module, class)), read as a literal."""
        p = "vllm/model_executor/models/registry.py"
        for node in ast.parse(self.wheel.source(p)).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_SPECULATIVE_DECODING_MODELS":
                self.box.executed.append(f"{p}: _SPECULATIVE_DECODING_MODELS (read as data)")
                return ast.literal_eval(node.value)
        raise SystemExit(f"error: {p} has no _SPECULATIVE_DECODING_MODELS")

    def check(self, export: Export, target) -> Audit:
        from safetensors.torch import load_file
        from transformers import AutoConfig

        folder, head_layers = export.folder, export.layers
        method = "eagle3" if export.fmt == "eagle3" else "eagle"
        audit = Audit(f"vLLM {self.wheel.version}", f"{folder.name} (--speculative-config method {method})")
        hf = AutoConfig.from_pretrained(folder)
        # speculative.py: EAGLEConfig(draft hf_config, method=..., model_type="eagle") replaces the draft's config
        config = self.EAGLEConfig(hf, method=method, model_type="eagle")
        arch = config.architectures[0]
        if arch not in self.registry:
            audit.problems.append(
                f"architecture {arch!r} (from {hf.architectures}) is not in vLLM's speculative-decoding registry"
            )
            return audit
        module_name, class_name = self.registry[arch]
        audit.model_class = f"{arch} -> {module_name}.{class_name}"
        tc = target.config
        vllm_config = SimpleNamespace(
            speculative_config=SimpleNamespace(
                draft_model_config=SimpleNamespace(hf_config=config), parallel_drafting=False
            ),
            model_config=SimpleNamespace(
                dtype=torch.float32,
                hf_config=tc,
                get_num_layers=lambda parallel_config: tc.num_hidden_layers,
                get_total_num_hidden_layers=lambda: tc.num_hidden_layers,
                get_vocab_size=lambda: tc.vocab_size,
            ),
            cache_config=None,
            quant_config=None,
            load_config=None,
            parallel_config=None,
        )
        self.current["config"] = vllm_config
        self.rope.bases.clear()
        state = load_file(str(folder / "model.safetensors"))
        with self.box.active():
            module = self.box.modules[f"vllm.model_executor.models.{module_name}"]
            try:
                model = getattr(module, class_name)(vllm_config=vllm_config, prefix="")
            except Exception as e:  # noqa: BLE001 reported as the finding
                audit.problems.append(f"building {class_name} from config.json raised {type(e).__name__}: {e}")
                return audit
            dropped = (
                drop_rule(self.sources["llama_eagle3"], "t2d", f"{self.MODELS}llama_eagle3.py")
                if module_name == "llama_eagle3"
                else {}
            )
            # the proposer's fields these methods read; local argmax reduction is off unless asked for
            proposer = SimpleNamespace(model=model, vllm_config=vllm_config, use_local_argmax_reduction=False)
            fake_target = target_modules(target)

            def share():  # llm_base_proposer.py load_model: the draft's embed_tokens and lm_head from the target
                self.share_embeddings(proposer, fake_target)
                self.share_lm_head(proposer, fake_target)

            audit_load(audit, model, state, model.load_weights, self.default_loader, dropped, share)
            check_rope(audit, self.rope, target_theta(target))
            if head_layers is not None:
                d2t = model.draft_id_to_target_id
                # llama_eagle3.py compute_logits: target id = arange(draft_vocab_size) + draft_id_to_target_id
                check_vocab(
                    audit,
                    None if d2t is None else torch.arange(d2t.numel()) + d2t,
                    export.draft_ids,
                    "draft_id_to_target_id",
                )
                runner = SimpleNamespace(speculative_config=vllm_config.speculative_config)
                ids = self.aux_layers(runner)
                # llama.py LlamaModel.forward: id i is recorded after decoder layer i - 1 (ids sorted, deduplicated
                # by EagleModelMixin._set_aux_hidden_state_layers)
                captured = [i - 1 for i in sorted(set(ids or ()))]
                check_fused(audit, captured, head_layers, f"layer ids {list(ids or ())} from config.json")
                if len(ids or ()) != model.model.num_aux_hidden_states:
                    audit.problems.append(
                        f"fc takes {model.model.num_aux_hidden_states} hidden states, the target gives {len(ids or ())}"
                    )
        return audit


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


def target_modules(target) -> nn.Module:
    """The target as vLLM's proposer sees it: `.model.embed_tokens` and `.lm_head`, holding the real weights."""
    outer, inner = nn.Module(), nn.Module()
    inner.embed_tokens = target.get_input_embeddings()
    outer.model, outer.lm_head = inner, target.get_output_embeddings()
    return outer


def target_theta(target) -> float:
    params = getattr(target.config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(target.config, "rope_theta", 10000.0)))


def write_exports(heads, target, out: Path) -> list[Export]:
    """Every head exported by eagletree's own export code: EAGLE-1/2 heads as 'vllm' and 'sglang', EAGLE-3 as
    'eagle3'."""
    from eagletree.draft_heads.export import export_head

    exports = []
    for i, head in enumerate(heads):
        eagle3 = head.config.head_type == "eagle3"
        draft_ids = None if head.config.draft_vocab_size is None else head.d2t.long().tolist()
        for fmt in ("eagle3",) if eagle3 else ("vllm", "sglang"):
            folder = export_head(head, out / f"head{i}-{fmt}", fmt, target=target)
            # vLLM drafts EAGLE-1/2 heads over the full vocabulary (`eagletree export` says so): no map to compare
            ids = None if fmt == "vllm" else draft_ids
            exports.append(Export(folder, fmt, list(head.fused_layers) if eagle3 else None, ids))
    return exports


def check_export(engines, export: Export, target) -> list[Audit]:
    """The export loaded by the engines it is for: 'vllm' by vLLM, 'sglang' by SGLang, 'eagle3' by both."""
    vllm, sglang = engines
    audits = []
    if export.fmt in ("vllm", "eagle3"):
        audits.append(vllm.check(export, target))
    if export.fmt in ("sglang", "eagle3"):
        audits.append(sglang.check(export, target))
    return audits


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


def broken_exports(exports: list[Export], work: Path) -> list[tuple[str, Export, set[str]]]:
    """Copies of the exports broken the ways engines have failed on such files: (what, export, the engines that must
    report it)."""
    by_fmt = {e.fmt: e for e in exports}
    cases = []

    def case(what, fmt, expect, change):
        src = by_fmt[fmt]
        dst = work / f"broken{len(cases)}-{fmt}"
        shutil.copytree(src.folder, dst)
        change(dst)
        cases.append((what, Export(dst, fmt, src.layers, src.draft_ids), expect))

    hidden_size = json.loads((by_fmt["sglang"].folder / "config.json").read_text())["hidden_size"]
    break_sglang(case)
    break_vllm(case, hidden_size)
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
        {"SGLang"},
        lambda d: edit_config(d, tie_word_embeddings=True),
    )
    case("no fc.bias (SGLang's fc always has one)", "sglang", {"SGLang"}, lambda d: edit_weights(d, drop=["fc.bias"]))
    case(
        "architectures LlamaForCausalLM (not an SGLang EAGLE class)",
        "sglang",
        {"SGLang"},
        lambda d: edit_config(d, architectures=["LlamaForCausalLM"]),
    )
    case(
        "token_map.pt in another order",
        "sglang",
        {"SGLang"},
        lambda d: torch.save(torch.load(d / "token_map.pt")[::-1], d / "token_map.pt"),
    )


def break_vllm(case, hidden_size: int):
    """The EAGLE-1/2 'vllm' export broken the ways vLLM must report."""
    case(
        "a non-zero fc.bias (vLLM's fc has none)",
        "vllm",
        {"vLLM"},
        lambda d: edit_weights(d, **{"fc.bias": torch.ones(hidden_size, dtype=torch.bfloat16)}),
    )
    case("config bias true (read as the attention's bias)", "vllm", {"vLLM"}, lambda d: edit_config(d, bias=True))
    case(
        "architectures LlamaForCausalLMEagle (SGLang's name)",
        "vllm",
        {"vLLM"},
        lambda d: edit_config(d, architectures=["LlamaForCausalLMEagle"]),
    )


def break_eagle3(case, draft_ids: list[int]):
    """The 'eagle3' export broken the ways vLLM, SGLang or both must report; `draft_ids` are the head's target ids."""
    case("tie_word_embeddings true", "eagle3", {"SGLang"}, lambda d: edit_config(d, tie_word_embeddings=True))
    case("no d2t", "eagle3", {"vLLM", "SGLang"}, lambda d: edit_weights(d, drop=["d2t"]))
    case(
        "d2t as target ids instead of offsets",
        "eagle3",
        {"vLLM", "SGLang"},
        lambda d: edit_weights(d, d2t=torch.tensor(draft_ids)),
    )
    case(
        "top-level layer ids as layer outputs (vLLM wants inputs: + 1)",
        "eagle3",
        {"vLLM"},
        lambda d: edit_config(d, eagle_aux_hidden_state_layer_ids=aux_layer_ids(d)),
    )
    case(
        "eagle_config layer ids + 1 (SGLang adds 1 itself)",
        "eagle3",
        {"SGLang"},
        lambda d: edit_config(d, **aux_eagle_config([i + 1 for i in aux_layer_ids(d)])),
    )
    case(
        "two layer ids everywhere (fc built for 2 hidden states, the file has 3)",
        "eagle3",
        {"vLLM", "SGLang"},
        lambda d: edit_config(
            d,
            eagle_aux_hidden_state_layer_ids=[i + 1 for i in aux_layer_ids(d)[:2]],
            **aux_eagle_config(aux_layer_ids(d)[:2]),
        ),
    )
    case(
        "no embed_tokens (both engines take the target's; only EAGLE's own code needs it, see check_exports.py)",
        "eagle3",
        set(),
        lambda d: edit_weights(d, drop=["embed_tokens.weight"]),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheels", type=Path, required=True, help="folder with vllm-*.whl and sglang-*.whl")
    parser.add_argument("--vllm-wheel", type=Path, default=None)
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

    vllm = VLLM(Wheel(find_wheel(args.wheels, "vllm", args.vllm_wheel)))
    sglang = SGLang(Wheel(find_wheel(args.wheels, "sglang", args.sglang_wheel)))

    from eagletree.draft_heads import Eagle3Head, load_head
    from eagletree.loading import SHIPPED_HEADS
    from eagletree.target import load_target

    target, _ = load_target(args.target, dtype=torch.bfloat16, device="cpu")  # as served, and as exported
    if args.head:
        heads = [load_head(h, target_config=target.config) for h in args.head]
    else:
        torch.manual_seed(0)
        heads = [
            load_head(SHIPPED_HEADS[args.target], target_config=target.config),
            Eagle3Head.for_target(target, torch.arange(0, target.config.vocab_size, 7)).eval(),
            Eagle3Head.for_target(target).eval(),
        ]  # the whole vocabulary: the training default
    if args.self_test and {h.config.head_type == "eagle3" for h in heads} != {True, False}:
        raise SystemExit(
            "error: --self-test breaks an EAGLE-1/2 and an EAGLE-3 export: pass one head of each kind "
            "with --head, or none"
        )
    failures = 0
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        exports = write_exports(heads, target, Path(tmp))
        print("== eagletree's exports")
        for export in exports:
            for audit in check_export((vllm, sglang), export, target):
                print(audit.line())
                failures += bool(audit.problems)
        if args.self_test:
            print("\n== exports broken on purpose (each must be reported by the engines named)")
            for what, export, expect in broken_exports(exports, Path(tmp)):
                audits = check_export((vllm, sglang), export, target)
                caught = {a.engine.split()[0] for a in audits if a.problems}
                verdict = "caught as expected" if caught == expect else f"MISSED: expected {sorted(expect)}"
                failures += caught != expect
                print(f"-- {export.fmt}: {what}: reported by {sorted(caught) or 'none'}: {verdict}")
                for audit in audits:
                    for p in audit.problems:
                        print(f"    [{audit.engine}] {p}")
    for box in (vllm.box, sglang.box):
        print(f"\n== {box.label}: the engine's own code that ran")
        print("\n".join(f"  {e}" for e in box.executed))
        print(f"== {box.label}: stand-ins (not the engine's code)")
        print("\n".join(f"  {m}: {names} -- {why}" for m, names, why in box.stand_ins))
        print(f"== {box.label}: RESTATED (engine rules applied by this script, not run)")
        print("\n".join(f"  {r}" for r in RESTATED[box.label.split()[0]]))
    print("\nok: vLLM's and SGLang's own loaders take every export" if not failures else f"\n{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

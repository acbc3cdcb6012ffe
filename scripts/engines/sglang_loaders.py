"""SGLang's EAGLE and EAGLE-3 draft classes, built from the sglang wheel's own source over stand-ins, loading an
export as SGLang does (config, model class, load_weights, sharing the target's embedding and lm_head)."""

from __future__ import annotations

import contextlib
import re
from types import SimpleNamespace

import torch

from .load_audit import Audit, Export, audit_load, check_fused, check_rope, check_vocab, drop_rule
from .sandbox import Sandbox, Wheel, definition
from .standins import (
    LINEARS,
    PP_GROUP,
    NoWeights,
    ParallelLMHead,
    RMSNorm,
    RopeRecorder,
    VocabParallelEmbedding,
    not_exercised,
)

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


def target_theta(target) -> float:
    params = getattr(target.config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(target.config, "rope_theta", 10000.0)))

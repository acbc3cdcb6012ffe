"""Export EAGLE-1/2 and EAGLE-3 heads to the layouts EAGLE's code, vLLM and SGLang load, and import them back.

Rules checked against those projects' loaders (vLLM 0.33: model_executor/models/llama_eagle.py,
llama_eagle3.py, llama.py, v1/worker/gpu_model_runner.py; SGLang 0.5.23: srt/models/llama_eagle.py,
llama_eagle3.py, llama.py, speculative/eagle_worker_v2.py, spec_utils.py; SafeAILab/EAGLE:
eagle/model/cnets1.py, cnets.py, ea_model.py, modeling_llama_kv.py):
- weights `fc.weight` [H, 2H] and `layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
  post_attention_layernorm}.weight`; layer 0 has no input_layernorm; no lm_head, no final norm
  (the target's embedding and lm_head are used);
- `fc.bias`: EAGLE keeps it when config "bias" is true; vLLM's fc has none (a head with a bias is
  refused); SGLang's fc always has one (zeros are written when the head has none). vLLM and SGLang
  also read config "bias" as the attention's bias, so it is false for both;
- `architectures`: ["LlamaForCausalLM"] for EAGLE and vLLM (vLLM maps it to EagleLlamaForCausalLM
  for method "eagle"), ["LlamaForCausalLMEagle"] for SGLang;
- config: `tie_word_embeddings` false (SGLang ties the draft's lm_head to its embedding otherwise and
  then fails sharing the target's), `rope_theta`/`rope_scaling` at the top level as well as
  `rope_parameters` (EAGLE's transformers-4 code reads only the former and falls back to base 10000),
  `dtype` and `torch_dtype` both the exported precision;
- the draft vocabulary is written as `token_map.pt` (a list of target ids in draft order), SGLang's
  `--speculative-token-map`; vLLM and EAGLE draft EAGLE-1/2 heads over the full vocabulary.

EAGLE-3 heads (format "eagle3", loaded by vLLM's Eagle3LlamaForCausalLM, SGLang's
LlamaForCausalLMEagle3 and EAGLE's EAGLE-3 code): `fc.weight` [H, 3H] without bias, `midlayer.*`
(q/k/v take 2H inputs; `input_layernorm` on the embedding, `hidden_norm`), `norm.weight`,
`lm_head.weight` [V', H], `d2t` (int64 offsets: target id = draft id + d2t[draft id]), `t2d`
(bool over the target vocabulary) and `embed_tokens.weight` (the target's: EAGLE's cnets.py does not
load it when `target_hidden_size` is set); config `architectures: ["LlamaForCausalLMEagle3"]` with
`draft_vocab_size` and `target_hidden_size`. The fused layers: vLLM reads top-level
`eagle_aux_hidden_state_layer_ids` as inputs of decoder layers (our output i is its i + 1); SGLang reads
only `eagle_config.eagle_aux_hidden_state_layer_ids` and adds 1 itself (our output indices as they
are); EAGLE's code always fuses the inputs of layers 2, L/2 and L-3.

EAGLE-3 heads for vLLM (read in vLLM 0.32: transformers_utils/config.py, configs/eagle.py,
configs/speculators/base.py and algos.py, config/speculative.py, model_executor/models/llama_eagle3.py,
v1/spec_decode/llm_base_proposer.py):
- format "vllm" (`speculative_config={"method": "eagle3", "model": OUT}`): the "eagle3" layout without the
  target's embedding (vLLM shares the target's when the draft has none) and without SGLang's `eagle_config`,
  with `norm_before_residual: false` written (eagletree's residual is the un-normed hidden);
- format "speculators" (`LLM(model=OUT)` alone): config.json without a top-level `model_type` (vLLM then parses
  it as "speculators" because `speculators_config` is there), `speculators_model_type: "eagle3"`,
  `speculators_config` (`proposal_methods[0].speculative_tokens`: vLLM's num_speculative_tokens;
  `verifier.name_or_path`: the target vLLM loads instead of OUT, written as the target's absolute folder),
  `transformer_layer_config` (the Llama layer config) and at the top level `draft_vocab_size`,
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (inputs of layers, as for "vllm") and
  `norm_before_residual: false` (vLLM's default for a speculators config is true, speculators' own false);
  weights named as speculators names them (`layers.0.*`, which vLLM maps as it maps `midlayer.*`), d2t and t2d
  as for "eagle3", no embedding. vLLM reads the speculators format for EAGLE-3 (and newer types) only.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..files import building, check_output_dir, publish
from .base import HeadError, target_identity
from .eagle import EagleHead
from .eagle3 import Eagle3Head
from .layers import layer_config_dict
from .vocab import check_draft_vocab, t2d_mask

FORMATS = ("eagle", "vllm", "sglang", "eagle3", "speculators")
EAGLE_FORMATS = ("eagle", "vllm", "sglang")  # what EAGLE-1/2 heads export to
EAGLE3_FORMATS = ("eagle3", "vllm", "speculators")  # what EAGLE-3 heads export to
ARCHITECTURES = {"eagle": "LlamaForCausalLM", "vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
SPECULATIVE_TOKENS = 3  # a speculators export's default chain length (vLLM's num_speculative_tokens)
# Layer prefix of the EAGLE-3 weights per format: the EAGLE-3 code's names, or speculators' (vLLM maps both).
EAGLE3_PREFIX = {"eagle3": "midlayer.", "vllm": "midlayer.", "speculators": "layers.0."}


def _formats(names) -> str:
    return ", ".join(repr(n) for n in names)


def check_format(head, fmt: str) -> None:
    """HeadError (one line, naming the formats the head takes) unless `head` exports to `fmt`; loads nothing."""
    if fmt not in FORMATS:
        raise HeadError(f"export format {fmt!r} is not one of {FORMATS}")
    kind = head.config.head_type
    if kind == "eagle3":
        if fmt not in EAGLE3_FORMATS:
            raise HeadError(
                f"an EAGLE-3 head exports as {_formats(EAGLE3_FORMATS)}, not {fmt!r} (SGLang and EAGLE load 'eagle3')"
            )
        loaders = "the EAGLE-3 loaders take"
    elif isinstance(head, EagleHead):
        if fmt not in EAGLE_FORMATS:
            raise HeadError(
                f"format {fmt!r} takes EAGLE-3 heads (vLLM reads speculators configs for EAGLE-3 only); "
                f"an EAGLE-1/2 head exports as {_formats(EAGLE_FORMATS)}"
            )
        loaders = "the EAGLE, vLLM and SGLang EAGLE loaders take"
    else:
        raise HeadError(f"only EAGLE-1/2 and EAGLE-3 heads export (to {FORMATS}); this head is {kind!r}")
    if head.config.target["model_type"] != "llama":
        raise HeadError(
            f"{loaders} Llama-architecture heads; this head's target is {head.config.target['model_type']!r}"
        )


def eagle3_state(head, embedding: torch.Tensor | None = None, prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """EAGLE-3 layout: the layer and its hidden_norm under `prefix` (`midlayer.` or speculators' `layers.0.`), own
    norm and lm_head, d2t as offsets, t2d as a mask, the target's embedding when given."""
    state = {}
    for key, value in head.state_dict().items():
        if key == "d2t":
            continue
        if key.startswith("layer."):
            key = prefix + key[len("layer.") :]
        elif key.startswith("hidden_norm."):
            key = prefix + key
        state[key] = value.detach().cpu()
    if head.config.draft_vocab_size is not None:  # (vLLM has no d2t parameter for a full-vocabulary head)
        d2t = head.d2t.detach().cpu().long()
        state["d2t"] = d2t - torch.arange(d2t.numel())
        state["t2d"] = t2d_mask(d2t, head.config.target["vocab_size"])
    if embedding is not None:
        expected = (head.config.target["vocab_size"], head.config.hidden_size)
        if tuple(embedding.shape) != expected:
            raise HeadError(
                f"the target's embedding has shape {tuple(embedding.shape)}, expected {expected} for this head"
            )
        state["embed_tokens.weight"] = embedding.detach().cpu()
    return state


def exported_state(head: EagleHead, fmt: str, embedding: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The weight dict of an export: our `layer.*` become `layers.0.*`; fc.bias per the format's rule.

    `embedding` (the target's input embedding) is required for "eagle3": EAGLE's code loads it from there. An
    EAGLE-3 head's "vllm" and "speculators" exports leave it out: vLLM shares the target's.
    """
    check_format(head, fmt)
    if head.config.head_type == "eagle3":
        if fmt != "eagle3":
            return eagle3_state(head, None, EAGLE3_PREFIX[fmt])
        if embedding is None:
            raise HeadError(
                "an eagle3 export carries the target's embedding (EAGLE's code does not load it for "
                "EAGLE-3 heads); pass the target model"
            )
        return eagle3_state(head, embedding)
    state = {}
    for key, value in head.state_dict().items():
        if key == "d2t":
            continue
        state[key.replace("layer.", "layers.0.", 1) if key.startswith("layer.") else key] = value.detach().cpu()
    bias = state.get("fc.bias")
    if fmt == "vllm" and bias is not None:
        if bias.abs().max() > 0:
            raise HeadError(
                "vLLM's EAGLE fc has no bias but this head's fc.bias is non-zero; "
                "train with fc_bias=false (the default) to export for vLLM"
            )
        del state["fc.bias"]
    if fmt == "sglang" and bias is None:
        state["fc.bias"] = torch.zeros(head.fc.out_features, dtype=head.fc.weight.dtype)
    return state


# Keys of a transformers config that say nothing about the head (two are local paths; the dtype is rewritten).
_NOT_EXPORTED = (
    "quantization_config",
    "_name_or_path",
    "_model_name_or_path",
    "transformers_version",
    "id2label",
    "label2id",
    "problem_type",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "torch_dtype",
    "dtype",
)
TOKEN_MAP = "token_map.pt"


def eagle_code_fused_inputs(num_layers: int) -> list[int]:
    """The decoder layers whose inputs EAGLE's own EAGLE-3 code fuses (modeling_llama_kv.py), whatever the config
    says."""
    return [i for i in range(num_layers) if i in (2, num_layers // 2, num_layers - 3)]


def rope_fields(layer_config: dict, fmt: str = "vllm") -> dict:
    """Top-level `rope_theta` and `rope_scaling` from transformers-5 `rope_parameters` (older readers take only
    these). EAGLE's own code (format "eagle") takes `rope_scaling` as exactly {type, factor}, linear or dynamic."""
    params = dict(layer_config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", layer_config.get("rope_theta"))
    if theta is None:
        raise HeadError("the head's layer config has no rope_theta (in rope_parameters or at the top level)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return {"rope_theta": float(theta), "rope_scaling": None}
    if fmt == "eagle":
        if rope_type not in ("linear", "dynamic") or "factor" not in params:
            raise HeadError(
                f"EAGLE's code scales RoPE only linearly or dynamically (rope_scaling {{type, factor}}); "
                f"the target's is {rope_type!r}: export with --format vllm or sglang"
            )
        return {"rope_theta": float(theta), "rope_scaling": {"type": rope_type, "factor": params["factor"]}}
    return {"rope_theta": float(theta), "rope_scaling": {**params, "type": rope_type, "rope_type": rope_type}}


def eagle3_fields(head) -> dict:
    """The EAGLE-3 fields vLLM reads at the top level of an "eagle3", "vllm" or "speculators" config."""
    return {
        "draft_vocab_size": head.lm_head.out_features,
        "target_hidden_size": head.config.hidden_size,
        # vLLM: inputs of decoder layers (hidden_states[i]); ours are outputs, so i + 1.
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in head.fused_layers],
    }


def exported_config(
    head: EagleHead,
    fmt: str,
    dtype: torch.dtype,
    verifier: dict | None = None,
    speculative_tokens: int = SPECULATIVE_TOKENS,
) -> dict:
    """config.json of an export: the head's Llama layer config with the fields each engine reads, in its convention.

    "speculators" (EAGLE-3) needs `verifier` ({name_or_path, architectures}: the target vLLM loads) and writes
    `speculative_tokens` as the proposal's chain length."""
    config = {k: v for k, v in head.config.layer_config.items() if k not in _NOT_EXPORTED}
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(
        {
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "dtype": dtype_name,
            "torch_dtype": dtype_name,
            **rope_fields(config, fmt),
        }
    )
    identity = {"eagletree": {"format": fmt, "target": head.config.target}}
    if head.config.head_type != "eagle3":
        # EAGLE: whether fc has a bias. vLLM and SGLang read it as the attention's bias (SGLang's fc always has one).
        return {
            **config,
            **identity,
            "architectures": [ARCHITECTURES[fmt]],
            "bias": fmt == "eagle" and head.config.fc_bias,
        }
    if fmt == "speculators":
        return speculators_config(head, config, verifier, speculative_tokens) | identity
    config.update(identity)
    config.update({"architectures": ["LlamaForCausalLMEagle3"], "bias": False, **eagle3_fields(head)})
    if fmt == "vllm":
        config["norm_before_residual"] = False  # (vLLM's default for this config too; written to be plain)
    else:  # SGLang reads only this one and adds 1 itself: outputs of decoder layers, ours as they are.
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(head.fused_layers),
            "use_aux_hidden_state": True,
        }
    return config


def speculators_config(head, layer_config: dict, verifier: dict | None, speculative_tokens: int) -> dict:
    """A speculators-format EAGLE-3 config.json (what vLLM's SpeculatorsConfig reads): no top-level model_type."""
    if not verifier or not verifier.get("name_or_path"):
        raise HeadError("a speculators export names its verifier (the target vLLM loads): pass the target model")
    if not (isinstance(speculative_tokens, int) and speculative_tokens >= 1):
        raise HeadError(f"speculative_tokens must be an integer >= 1, got {speculative_tokens!r}")
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": verifier,
        },
        "transformer_layer_config": layer_config,
        **eagle3_fields(head),
        # vLLM reads a missing value as true (norm the hidden, then keep it as the residual); eagletree keeps the
        # un-normed hidden as the residual.
        "norm_before_residual": False,
        "norm_before_fc": False,
        "dtype": layer_config["dtype"],
        "torch_dtype": layer_config["torch_dtype"],
    }


def speculators_verifier(target) -> dict:
    """A speculators config's verifier for `target`: its folder (absolute, so vLLM finds it from any working folder)
    or the name it was loaded by, and its architectures."""
    name = str(getattr(target.config, "name_or_path", "") or "") if target is not None else ""
    if not name:
        raise HeadError(
            "a speculators export names its verifier (the target vLLM loads): pass the target model, loaded from "
            "its folder"
        )
    path = Path(name).expanduser()
    return {
        "name_or_path": str(path.resolve()) if path.is_dir() else name,
        "architectures": list(getattr(target.config, "architectures", None) or ["LlamaForCausalLM"]),
    }


def engine_notes(head, fmt: str, target_config=None) -> list[str]:
    """What an engine will do differently from eagletree with this export (printed by `eagletree export`)."""
    notes = []
    if fmt == "eagle3" and target_config is not None:
        inputs, fixed = [i + 1 for i in head.fused_layers], eagle_code_fused_inputs(target_config.num_hidden_layers)
        if inputs != fixed:
            notes.append(
                f"EAGLE's own code always fuses the inputs of layers {fixed}, this head those of {inputs}: "
                f"run it with vLLM or SGLang (they read the layer ids from config.json), not EAGLE's EaModel"
            )
    elif fmt == "speculators":
        where = str(getattr(target_config, "name_or_path", "") or "the verifier's name_or_path")
        where = str(Path(where).resolve()) if Path(where).is_dir() else where
        notes.append(
            f"LLM(model=OUT) serves it with the target vLLM loads from {where} (speculators_config.verifier."
            f"name_or_path in config.json), {SPECULATIVE_TOKENS} speculative tokens unless speculative_config="
            '{"num_speculative_tokens": N}; where that folder is elsewhere, start LLM(model=TARGET, '
            'speculative_config={"method": "eagle3", "model": OUT, "num_speculative_tokens": N})'
        )
    elif fmt != "eagle3" and head.config.head_type != "eagle3" and head.config.draft_vocab_size is not None:
        notes.append(
            f"the draft vocabulary ({head.config.draft_vocab_size} tokens) is in {TOKEN_MAP}: pass it to "
            "SGLang as --speculative-token-map; vLLM and EAGLE draft EAGLE-1/2 heads over the full "
            "vocabulary"
        )
    return notes


def export_head(
    head,
    out_dir,
    fmt: str,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
    target=None,
    speculative_tokens: int = SPECULATIVE_TOKENS,
) -> Path:
    """Write the export folder (config.json + model.safetensors, and token_map.pt for EAGLE-1/2) atomically.

    `out_dir` must be absent or empty unless `overwrite`, which replaces these files and keeps the
    folder's other files; it is never the head's own folder. `target` (the target model) is needed for
    "eagle3", whose export carries the target's embedding, and for "speculators", whose config names the target's
    folder as the verifier vLLM loads; `speculative_tokens` is the speculators config's chain length.
    """
    check_format(head, fmt)
    out = Path(out_dir)
    source = head.folder
    check_output_dir(out, overwrite, sources=[source] if source else [])
    if target is not None:
        head.check_target(target.config)
    verifier = speculators_verifier(target) if fmt == "speculators" else None
    embedding = None if target is None or fmt != "eagle3" else target.get_input_embeddings().weight
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in exported_state(head, fmt, embedding).items()}
    config = exported_config(head, fmt, dtype, verifier, speculative_tokens)
    eagle3 = head.config.head_type == "eagle3"
    with building(out) as tmp:
        save_file(
            {k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        if not eagle3:  # always written, so an overwrite never keeps another head's map
            torch.save(head.d2t.detach().cpu().long().tolist(), tmp / TOKEN_MAP)  # SGLang: torch.tensor(list)
    published = publish(tmp, out, keep_others=True, replace=overwrite)
    if eagle3:  # an earlier EAGLE-1/2 export's token map there would describe another head
        (published / TOKEN_MAP).unlink(missing_ok=True)
    return published


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    try:
        if (folder / "model.safetensors").is_file():
            return load_file(str(folder / "model.safetensors"))
        if (folder / "pytorch_model.bin").is_file():
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise HeadError(f"weights in {str(folder)!r} are truncated or corrupted ({e})") from e
    raise HeadError(f"{str(folder)!r} holds no model.safetensors or pytorch_model.bin")


def read_export_config(folder) -> dict:
    """config.json of a folder to import; HeadError naming the file when it is unreadable, not a JSON object,
    or an eagletree head's (which needs no import)."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise HeadError(f"{str(folder)!r} is not a folder; expected an EAGLE/vLLM/SGLang head folder")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadError(f"{path} is not a readable JSON config ({e})") from e
    if not isinstance(config, dict):
        raise HeadError(f"{path} holds a JSON {type(config).__name__}; expected an object of config keys")
    if "head_type" in config and "layer_config" in config:
        raise HeadError(
            f"{str(folder)!r} is an eagletree head (head_type {config['head_type']!r}), not an EAGLE "
            "export: pass it to --head as it is, or copy the folder"
        )
    return config


def check_export_target(config: dict, target_config, folder) -> None:
    """HeadError unless the export in `folder` was made for this target: its recorded target (eagletree's exports)
    and the layer fields an engine runs it with (heads, key/value heads, head size, RoPE base, norm epsilon)."""
    recorded = (config.get("eagletree") or {}).get("target") if isinstance(config.get("eagletree"), dict) else None
    ours = target_identity(target_config)
    if isinstance(recorded, dict):
        for key in ("model_type", "hidden_size", "vocab_size", "fingerprint"):
            if key in recorded and recorded[key] != ours[key]:
                raise HeadError(
                    f"{str(folder)!r} was exported for a target with {key} = {recorded[key]!r}, but this "
                    f"target has {key} = {ours[key]!r}"
                )
    theirs = dict(
        config,
        rope_theta=rope_fields(config)["rope_theta"]
        if (config.get("rope_parameters") or config.get("rope_theta") is not None)
        else None,
    )
    mine = {
        "hidden_size": target_config.hidden_size,
        "num_attention_heads": getattr(target_config, "num_attention_heads", None),
        "num_key_value_heads": getattr(target_config, "num_key_value_heads", None),
        "head_dim": getattr(target_config, "head_dim", None),
        "rms_norm_eps": getattr(target_config, "rms_norm_eps", None),
        "rope_theta": rope_fields(layer_config_dict(target_config))["rope_theta"],
    }
    for key, value in mine.items():
        if theirs.get(key) is not None and value is not None and theirs[key] != value:
            raise HeadError(
                f"the head in {str(folder)!r} has {key} = {theirs[key]!r}, but this target has "
                f"{key} = {value!r}: it was made for another target"
            )


def import_eagle(folder, target_config) -> EagleHead:
    """Read an EAGLE-1/2 head (original EAGLE, vLLM or SGLang layout) for `target_config`."""
    folder = Path(folder)
    config = read_export_config(folder)
    check_export_target(config, target_config, folder)
    weights = _read_weights(folder)
    # layer 0's input_layernorm and a copied embedding are not used by EAGLE-1/2 heads
    weights = {k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "layers.0.input_layernorm."))}
    if "fc.bias" in weights and not weights["fc.bias"].abs().max() > 0:
        del weights["fc.bias"]  # SGLang's layout always has one: all zeros is no bias
    head = EagleHead.for_target(
        target_config, draft_tokens=_token_map(folder, target_config.vocab_size), fc_bias="fc.bias" in weights
    )
    state = {("layer." + k[len("layers.0.") :]) if k.startswith("layers.0.") else k: v for k, v in weights.items()}
    return _load_checked(head, state, folder, "an EAGLE-1/2 head")


def _token_map(folder: Path, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary in `token_map.pt` (SGLang's token map: target ids in draft order), if the folder has one."""
    path = folder / TOKEN_MAP
    if not path.is_file():
        return None
    try:
        ids = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True)).long().flatten()
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise HeadError(f"{str(path)!r} is not a token map (a list or tensor of target ids): {e}") from e
    try:
        check_draft_vocab(ids, vocab_size)
    except ValueError as e:
        raise HeadError(f"{str(path)!r}: {e}") from e
    return None if ids.numel() == vocab_size and torch.equal(ids, torch.arange(vocab_size)) else ids


def _load_checked(head, state, folder, kind: str):
    """Load `state` into `head` only if every key and shape matches (the d2t buffer is set by the caller)."""
    expected = {k: v for k, v in head.state_dict().items() if k != "d2t"}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    bad = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
    if missing or unexpected or bad:

        def some(keys) -> str:
            keys = sorted(keys)
            return str(keys[:6])[:-1] + (f", ... {len(keys) - 6} more]" if len(keys) > 6 else "]")

        raise HeadError(
            f"{str(folder)!r} is not {kind} for this target: missing {some(missing)}, "
            f"unexpected {some(unexpected)}, wrong shape {some(bad)}"
        )
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return head.eval()


def eagle3_export_config(config: dict, folder) -> dict:
    """An EAGLE-3 export's config as one flat dict (a speculators config: its transformer_layer_config with the
    top-level EAGLE-3 fields); HeadError for a variant eagletree's head does not compute."""
    if "speculators_config" in config:
        kind = config.get("speculators_model_type")
        if kind != "eagle3":
            raise HeadError(f"{str(folder)!r} holds a speculators config of type {kind!r}; eagletree imports 'eagle3'")
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise HeadError(f"{str(folder)!r}: the speculators config has no transformer_layer_config object")
        if "norm_before_residual" not in config:
            raise HeadError(
                f"{str(folder)!r}: a speculators config without norm_before_residual is ambiguous (speculators "
                "reads false, vLLM true); expected it written"
            )
        top = {k: v for k, v in config.items() if k not in ("transformer_layer_config", "architectures")}
        config = {**layer, **top}
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if config.get(key):
            raise HeadError(
                f"{str(folder)!r} has {key} = {config[key]!r}; eagletree's EAGLE-3 head computes the variant with "
                f"{key} false"
            )
    return config


def _eagle3_key(key: str) -> str:
    """An exported EAGLE-3 weight's name in eagletree's head (`midlayer.*` or speculators' `layers.0.*`)."""
    for prefix in ("midlayer.", "layers.0."):
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            return rest if rest.startswith("hidden_norm.") else "layer." + rest
    return key


def import_eagle3(folder, target_model) -> Eagle3Head:
    """Read an EAGLE-3 head (EAGLE / vLLM / SGLang / speculators layout) for `target_model`."""
    folder = Path(folder)
    config = eagle3_export_config(read_export_config(folder), folder)
    check_export_target(config, target_model.config, folder)
    weights = _read_weights(folder)
    vocab = target_model.config.vocab_size
    d2t = None  # no d2t, or the identity: drafting over the whole vocabulary
    if "d2t" in weights:
        d2t = weights["d2t"].long() + torch.arange(weights["d2t"].numel())
        d2t = None if d2t.numel() == vocab and torch.equal(d2t, torch.arange(vocab)) else d2t
    layers = config.get("eagle_aux_hidden_state_layer_ids")  # inputs of these layers = outputs of i - 1
    if layers is not None:
        if any(i < 1 for i in layers):
            raise HeadError(f"eagle_aux_hidden_state_layer_ids {layers} must be >= 1 (inputs of decoder layers)")
        layers = [i - 1 for i in layers]
    elif isinstance(config.get("eagle_config"), dict) and "eagle_aux_hidden_state_layer_ids" in config["eagle_config"]:
        layers = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])  # SGLang's: outputs already
    head = Eagle3Head.for_target(target_model, d2t, fused_layers=layers)
    state = {
        _eagle3_key(key): value
        for key, value in weights.items()
        if key not in ("d2t", "t2d") and not key.startswith("embed_tokens.")
    }
    return _load_checked(head, state, folder, "an EAGLE-3 head")

"""What every export format shares: the Llama layer config the engines read (RoPE fields included), the weight
names of the two EAGLE layouts both ways, reading an export's files, and the checks of an export against a target.

Rules checked against the engines' loaders (vLLM 0.33: model_executor/models/llama_eagle.py, llama_eagle3.py,
llama.py, v1/worker/gpu_model_runner.py; SGLang 0.5.23: srt/models/llama_eagle.py, llama_eagle3.py, llama.py,
speculative/eagle_worker_v2.py, spec_utils.py; SafeAILab/EAGLE: eagle/model/cnets1.py, cnets.py, ea_model.py,
modeling_llama_kv.py):
- config: `tie_word_embeddings` false (SGLang ties the draft's lm_head to its embedding otherwise and then fails
  sharing the target's), `rope_theta`/`rope_scaling` at the top level as well as `rope_parameters` (EAGLE's
  transformers-4 code reads only the former and falls back to base 10000), `dtype` and `torch_dtype` both the
  exported precision, and `eagletree: {format, target}` (the target an import checks);
- EAGLE-1/2 weights are ours with `layer.` named `layers.0.`; EAGLE-3 weights put the layer and its hidden_norm
  under `midlayer.` (EAGLE's code) or `layers.0.` (speculators), d2t as offsets and t2d as a mask.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..draft import HeadError, check_draft_vocab, t2d_mask, target_identity
from ..draft.layers import layer_config_dict
from . import TOKEN_MAP

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


# ----------------------------------------------------------------------------- config


def rope_fields(layer_config: dict, eagle_code: bool = False) -> dict:
    """Top-level `rope_theta` and `rope_scaling` from transformers-5 `rope_parameters` (older readers take only
    these). EAGLE's own code (`eagle_code`) takes `rope_scaling` as exactly {type, factor}, linear or dynamic."""
    params = dict(layer_config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", layer_config.get("rope_theta"))
    if theta is None:
        raise HeadError("the head's layer config has no rope_theta (in rope_parameters or at the top level)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return {"rope_theta": float(theta), "rope_scaling": None}
    if eagle_code:
        if rope_type not in ("linear", "dynamic") or "factor" not in params:
            raise HeadError(
                f"EAGLE's code scales RoPE only linearly or dynamically (rope_scaling {{type, factor}}); "
                f"the target's is {rope_type!r}: export with --format vllm or sglang"
            )
        return {"rope_theta": float(theta), "rope_scaling": {"type": rope_type, "factor": params["factor"]}}
    return {"rope_theta": float(theta), "rope_scaling": {**params, "type": rope_type, "rope_type": rope_type}}


def layer_fields(head, dtype: torch.dtype, eagle_code: bool = False) -> dict:
    """The head's one-layer Llama config as the engines read it: local keys dropped, one layer, no ties, the exported
    precision, RoPE at the top level (`rope_fields`)."""
    config = {k: v for k, v in head.config.layer_config.items() if k not in _NOT_EXPORTED}
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(
        {
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "dtype": dtype_name,
            "torch_dtype": dtype_name,
            **rope_fields(config, eagle_code),
        }
    )
    return config


def identity(head, fmt: str) -> dict:
    """The `eagletree` entry of an export's config: its format and the target it was made for."""
    return {"eagletree": {"format": fmt, "target": head.config.target}}


def fused_inputs(head) -> list[int]:
    """The head's fused layers as the engines count them: inputs of decoder layers (our outputs + 1)."""
    return [i + 1 for i in head.feature_spec.layers]


def eagle3_fields(head) -> dict:
    """The EAGLE-3 fields vLLM reads at the top level of an "eagle3", "vllm" or "speculators" config."""
    return {
        "draft_vocab_size": head.lm_head.out_features,
        "target_hidden_size": head.config.hidden_size,
        # vLLM: inputs of decoder layers (hidden_states[i]); ours are outputs, so i + 1.
        "eagle_aux_hidden_state_layer_ids": fused_inputs(head),
    }


def is_eagle3_config(config: dict) -> bool:
    """Whether a foreign config.json describes an EAGLE-3 head (its architecture, or a draft vocabulary size)."""
    return "LlamaForCausalLMEagle3" in config.get("architectures", []) or "draft_vocab_size" in config


# ----------------------------------------------------------------------------- weight names


def eagle_state(head) -> dict[str, torch.Tensor]:
    """An EAGLE-1/2 head's weights as the engines name them: `layer.*` become `layers.0.*`; no d2t."""
    return {
        (key.replace("layer.", "layers.0.", 1) if key.startswith("layer.") else key): value.detach().cpu()
        for key, value in head.state_dict().items()
        if key != "d2t"
    }


def eagle_key(key: str) -> str:
    """An exported EAGLE-1/2 weight's name in eagletree's head."""
    return ("layer." + key[len("layers.0.") :]) if key.startswith("layers.0.") else key


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


def eagle3_key(key: str) -> str:
    """An exported EAGLE-3 weight's name in eagletree's head (`midlayer.*` or speculators' `layers.0.*`)."""
    for prefix in ("midlayer.", "layers.0."):
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            return rest if rest.startswith("hidden_norm.") else "layer." + rest
    return key


# ----------------------------------------------------------------------------- reading an export


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """An export's weights (model.safetensors or pytorch_model.bin); HeadError naming the folder when unreadable."""
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


def read_token_map(folder: Path, vocab_size: int) -> torch.Tensor | None:
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


# ----------------------------------------------------------------------------- checks against the target


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


def load_checked(head, state, folder, kind: str):
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

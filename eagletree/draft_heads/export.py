"""Export EAGLE-1/2 heads to the layouts the original EAGLE code, vLLM and SGLang load, and import them back.

Rules checked against those projects' loaders (vllm: model_executor/models/llama_eagle.py and
transformers_utils/configs/eagle.py; sglang: srt/models/llama_eagle.py; SafeAILab/EAGLE:
eagle/model/cnets1.py and ea_model.py):
- weights `fc.weight` [H, 2H] and `layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
  post_attention_layernorm}.weight`; layer 0 has no input_layernorm; no lm_head, no final norm
  (the target's embedding and lm_head are used);
- `fc.bias`: EAGLE keeps it when config "bias" is true; vLLM's fc has none (a head with a bias is
  refused); SGLang's fc always has one (zeros are written when the head has none);
- `architectures`: ["LlamaForCausalLM"] for EAGLE and vLLM (vLLM maps it to EagleLlamaForCausalLM
  for method "eagle"), ["LlamaForCausalLMEagle"] for SGLang.
A draft vocabulary is not part of these formats: exported heads draft over the full vocabulary.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .base import HeadError
from .eagle import EagleHead

FORMATS = ("eagle", "vllm", "sglang")
ARCHITECTURES = {"eagle": "LlamaForCausalLM", "vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}


def exported_state(head: EagleHead, fmt: str) -> dict[str, torch.Tensor]:
    """The weight dict of an export: our `layer.*` become `layers.0.*`; fc.bias per the format's rule."""
    if fmt not in FORMATS:
        raise HeadError(f"export format {fmt!r} is not one of {FORMATS}")
    if not isinstance(head, EagleHead):
        raise HeadError(f"only EAGLE-1/2 heads export to {FORMATS}; this head is {head.config.head_type!r}")
    model_type = head.config.target["model_type"]
    if model_type != "llama":
        raise HeadError(f"the EAGLE, vLLM and SGLang EAGLE loaders take Llama-architecture heads; "
                        f"this head's target is {model_type!r}")
    state = {}
    for key, value in head.state_dict().items():
        if key == "d2t":
            continue
        state[key.replace("layer.", "layers.0.", 1) if key.startswith("layer.") else key] = value.detach().cpu()
    bias = state.get("fc.bias")
    if fmt == "vllm" and bias is not None:
        if bias.abs().max() > 0:
            raise HeadError("vLLM's EAGLE fc has no bias but this head's fc.bias is non-zero; "
                            "train with fc_bias=false (the default) to export for vLLM")
        del state["fc.bias"]
    if fmt == "sglang" and bias is None:
        state["fc.bias"] = torch.zeros(head.fc.out_features, dtype=head.fc.weight.dtype)
    return state


def exported_config(head: EagleHead, fmt: str, dtype: torch.dtype) -> dict:
    config = dict(head.config.layer_config)
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config.update({
        "architectures": [ARCHITECTURES[fmt]],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "bias": fmt == "sglang" or head.config.fc_bias,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagletree": {"format": fmt, "target": head.config.target},
    })
    return config


def export_head(head: EagleHead, out_dir, fmt: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the export folder (config.json + model.safetensors) atomically."""
    from safetensors.torch import save_file

    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in exported_state(head, fmt).items()}
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(exported_config(head, fmt, dtype), indent=2, default=str))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if (folder / "model.safetensors").is_file():
            return load_file(str(folder / "model.safetensors"))
        if (folder / "pytorch_model.bin").is_file():
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise HeadError(f"weights in {str(folder)!r} are truncated or corrupted ({e})") from e
    raise HeadError(f"{str(folder)!r} holds no model.safetensors or pytorch_model.bin")


def import_eagle(folder, target_config) -> EagleHead:
    """Read an EAGLE-1/2 head (original EAGLE, vLLM or SGLang layout) for `target_config`."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise HeadError(f"{str(folder)!r} has no readable config.json ({e})") from e
    if config.get("hidden_size") != target_config.hidden_size:
        raise HeadError(f"EAGLE head has hidden_size = {config.get('hidden_size')}, "
                        f"but this target has hidden_size = {target_config.hidden_size}")
    weights = _read_weights(folder)
    # layer 0's input_layernorm and a copied embedding are not used by EAGLE-1/2 heads
    weights = {k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "layers.0.input_layernorm."))}
    head = EagleHead.for_target(target_config, fc_bias="fc.bias" in weights)
    state = {("layer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v for k, v in weights.items()}
    expected = {k: v for k, v in head.state_dict().items() if k != "d2t"}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    bad = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
    if missing or unexpected or bad:
        raise HeadError(f"{str(folder)!r} is not an EAGLE-1/2 head for this target: missing {sorted(missing)}, "
                        f"unexpected {sorted(unexpected)}, wrong shape {sorted(bad)}")
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return head.eval()

"""The target without its decoder layers: what a head's training reads of it when the features come from a cache.

Training from cached features (`features_dir`) never runs the target; a head reads only its config, its token
embedding (the head embeds the tokens it drafts after), its final norm (a new head's norm starts as the target's)
and its lm_head (the loss's soft labels and the head's logits); `eagletree features --engine vllm` applies its final
norm to the last layer's output, which vLLM gives before the norm. `load_target_shell` reads those tensors alone from
the target's safetensors files (one file, or several named by `model.safetensors.index.json`), finding their names
by building the model's architecture on the meta device (no memory): a 70B target's shell is its embedding and
lm_head, a few GB, where the whole model would not fit. `TargetShell` holds them; running it is an error naming why.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .loading import TargetError, checked_device, resolve_target, target_config

INDEX = "model.safetensors.index.json"


class TargetShell(nn.Module):
    """A target's config, token embedding, final norm and lm_head, without its decoder layers (frozen)."""

    def __init__(self, config, embed: nn.Embedding, norm: nn.Module | None, lm_head: nn.Linear):
        super().__init__()
        self.config = config
        self.embed_tokens, self.lm_head = embed, lm_head
        self.norm = norm if norm is not None else nn.Identity()
        self.requires_grad_(False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def get_decoder(self) -> TargetShell:
        """(the module whose `norm` is the target's final norm, as a model's decoder)"""
        return self

    def forward(self, *args, **kwargs):
        raise TargetError(
            "the target's decoder layers are not loaded (training from cached features reads only its embedding, "
            "final norm and lm_head); load it with load_target to run it"
        )


def _parts(config) -> tuple[dict, nn.Module | None]:
    """(checkpoint names of the embedding and lm_head weights, {"norm": the final norm's prefix or None, "tied"},
    the final norm module on the meta device or None), read from the architecture built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    modules = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    norm = getattr(model.get_decoder(), "norm", None)
    names = {
        "embed": f"{modules[id(embed)]}.weight",
        "lm_head": f"{modules[id(lm_head)]}.weight",
        "lm_bias": f"{modules[id(lm_head)]}.bias" if getattr(lm_head, "bias", None) is not None else None,
        "norm": modules[id(norm)] if isinstance(norm, nn.Module) else None,
        "tied": lm_head.weight is embed.weight or bool(getattr(config, "tie_word_embeddings", False)),
    }
    return names, norm if isinstance(norm, nn.Module) else None


def _read_tensors(folder: Path, wanted: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors from the folder's safetensors files; a TargetError naming what is missing."""
    from safetensors import safe_open

    index = folder / INDEX
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        where = {name: "model.safetensors" for name in wanted}
    if not all((folder / where.get(n, "model.safetensors")).is_file() for n in wanted):
        raise TargetError(
            f"{folder} has no safetensors weights ({INDEX} or model.safetensors) holding {wanted}: the target's shell "
            "reads those files alone"
        )
    out = {}
    for name in wanted:
        with safe_open(str(folder / where[name]), framework="pt") as f:
            if name not in f.keys():
                raise TargetError(f"{folder / where[name]} lacks the tensor {name!r}")
            out[name] = f.get_tensor(name)
    return out


def load_target_shell(spec, dtype=None, device=None):
    """(TargetShell, tokenizer) of the target `spec` names (alias, HF folder or .gguf file, as `load_target`):
    its embedding, final norm and lm_head in `dtype` (default: bf16 on CUDA, fp32 on CPU) on `device`."""
    from transformers import AutoTokenizer

    device = checked_device(device)
    folder = resolve_target(spec)
    config = target_config(folder)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    names, norm = _parts(config)
    norm_names = [f"{names['norm']}.{n}" for n, _ in norm.named_parameters()] if norm is not None else []
    wanted = [names["embed"]] + ([] if names["tied"] else [names["lm_head"]])
    wanted += [names["lm_bias"]] * bool(names["lm_bias"]) + norm_names
    tensors = {k: v.to(device, dtype) for k, v in _read_tensors(folder, wanted).items()}
    embed = nn.Embedding.from_pretrained(tensors[names["embed"]], freeze=True)
    lm_weight = embed.weight if names["tied"] else nn.Parameter(tensors[names["lm_head"]], requires_grad=False)
    lm_head = nn.Linear(lm_weight.shape[1], lm_weight.shape[0], bias=names["lm_bias"] is not None, device="meta")
    lm_head.weight = lm_weight  # (tied: the embedding's own Parameter, as in the model)
    if names["lm_bias"]:
        lm_head.bias = nn.Parameter(tensors[names["lm_bias"]], requires_grad=False)
    if norm is not None:  # the model's own final norm module, with its weights: its forward is the model's
        norm = norm.to_empty(device=device).to(dtype)
        loaded = {n.removeprefix(f"{names['norm']}."): tensors[n] for n in norm_names}
        norm.load_state_dict(loaded, strict=False)  # (its parameters, all read above; it has no buffers to load)
    shell = TargetShell(config, embed, norm, lm_head).eval()
    return shell, AutoTokenizer.from_pretrained(folder)

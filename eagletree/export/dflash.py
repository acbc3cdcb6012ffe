"""Format "dflash": block heads as the published DFlash drafter's checkpoint (`DFlashDraftModel`), which vLLM
starts with method "dflash" (read in vLLM 0.32: model_executor/models/qwen3_dflash.py, config/speculative.py,
v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, which adds 1 to `target_layer_ids`, as its other loaders count
inputs of layers); SGLang's DFLASH and llama.cpp's converter (`convert_hf_to_gguf.py`, `--spec-type
draft-dflash`) read the same published layout.

config.json: a Qwen3 config of the draft layers (`model_type` "qwen3", `num_hidden_layers` the draft's,
`architectures: ["DFlashDraftModel"]`, no biases, the target's RoPE, `vocab_size` the target's), `block_size`,
`num_target_layers` (the target's decoder layers) and `dflash_config` {block_size, target_layer_ids (outputs of
decoder layers, 0-based: the drafter reads hidden_states[i + 1]), mask_token_id}. Weights: `fc.weight`
[H, n*H], `hidden_norm.weight`, `norm.weight`, and per layer `layers.N.self_attn.{q,k,v,o}_proj.weight`,
`layers.N.self_attn.{q,k}_norm.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`,
`layers.N.{input,post_attention}_layernorm.weight`. No embedding or lm_head: the drafter uses the target's, over
its whole vocabulary (a head trained over a draft vocabulary drafts there as `widen_vocab` makes it draft; the
draft vocabulary goes into `token_map.pt`, which `eagletree import` reads back).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..draft import DFlashHead, HeadConfig, HeadError, target_identity
from ..draft.layers import layer_config_dict
from . import TOKEN_MAP
from .layout import Layout
from .shared import (
    check_export_target,
    identity,
    load_checked,
    read_export_config,
    read_token_map,
    read_weights,
    rope_fields,
)

# our name -> the DFlash checkpoint's, within a layer
_LAYER_NAMES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}


def dflash_key(key: str) -> str:
    """Our weight name -> the DFlash checkpoint's (`layers.0.q_proj.weight` -> `layers.0.self_attn.q_proj.weight`)."""
    parts = key.split(".")
    if parts[0] == "layers":
        return ".".join([*parts[:2], _LAYER_NAMES[parts[2]], *parts[3:]])
    return key


def our_key(key: str) -> str:
    """The DFlash checkpoint's weight name -> ours (unknown names kept, for the load's check to name them)."""
    parts = key.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3:
        for ours, theirs in _LAYER_NAMES.items():
            if parts[2].startswith(theirs + "."):
                return f"layers.{parts[1]}.{ours}{parts[2][len(theirs) :]}"
    return key


class DFlashLayout(Layout):
    """Block heads as a `DFlashDraftModel` checkpoint."""

    format = "dflash"
    heads = ("dflash",)
    kind = "block (DFlash)"
    target_types = ("llama", "qwen2", "qwen3", "mistral")
    loaders = "the DFlash loaders take heads of Llama/Qwen-architecture targets"

    def state(self, head, embedding=None) -> dict:
        return {dflash_key(k): v for k, v in head.state_dict().items() if k != "d2t"}

    def config(self, head, dtype, target=None, speculative_tokens=None) -> dict:
        layer = head.layer_config
        dtype_name = str(dtype).removeprefix("torch.")
        draft_layers = len(head.layers)
        rope = rope_fields(head.config.layer_config)
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": head.config.hidden_size,
            "intermediate_size": layer.intermediate_size,
            "num_attention_heads": layer.num_attention_heads,
            "num_key_value_heads": layer.num_key_value_heads,
            "head_dim": head.layers[0].head_dim,
            "num_hidden_layers": draft_layers,
            "num_target_layers": head.config.extra["num_target_layers"],
            "hidden_act": "silu",
            "rms_norm_eps": getattr(layer, "rms_norm_eps", 1e-6),
            "max_position_embeddings": getattr(layer, "max_position_embeddings", 4096),
            "vocab_size": head.config.target["vocab_size"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * draft_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": draft_layers,
            "rope_parameters": dict(head.config.layer_config.get("rope_parameters") or {"rope_type": "default"})
            | {"rope_theta": rope["rope_theta"]},
            **rope,
            "block_size": head.block_size,
            "dflash_config": {
                "block_size": head.block_size,
                "target_layer_ids": list(head.target_layers),
                "mask_token_id": head.mask_token_id,
            },
            "dtype": dtype_name,
            "torch_dtype": dtype_name,
        } | identity(head, self.format)

    def write_companions(self, head, folder: Path) -> None:
        """`token_map.pt` (the draft vocabulary, target ids; `import` reads it back), always written so that an
        overwrite never keeps another head's map."""
        torch.save(head.d2t.detach().cpu().long().tolist(), folder / TOKEN_MAP)

    def notes(self, head, target_config=None) -> list[str]:
        notes = [
            f"the drafter reads the outputs of target layers {list(head.target_layers)} and embeds masked positions "
            f"as token {head.mask_token_id}; engines draft a chain of up to {head.block_size - 1} tokens a step"
        ]
        if head.config.draft_vocab_size:
            notes.append(
                f"engines score its drafts over the target's whole vocabulary (eagletree drafts over its "
                f"{head.config.draft_vocab_size}-token draft vocabulary, in {TOKEN_MAP}, unless --draft-vocab full)"
            )
        return notes

    def recognizes(self, config: dict) -> bool:
        return isinstance(config.get("dflash_config"), dict)

    def load(self, folder: Path, target) -> DFlashHead:
        """The head in a DFlash checkpoint, for `target` (its config): over the target's whole vocabulary, or its
        draft vocabulary where the folder has a `token_map.pt`."""
        target_config = getattr(target, "config", target)
        config = read_export_config(folder)
        head = dflash_head(config, read_weights(Path(folder)), target_config, folder)
        draft_tokens = read_token_map(Path(folder), target_config.vocab_size)
        if draft_tokens is not None:
            head.set_draft_vocab(draft_tokens)
        return head


def dflash_head(config: dict, weights: dict, target_config, folder, source: str = "config.json") -> DFlashHead:
    """A block head from a DFlash checkpoint's config (its Qwen3 fields and `dflash_config`) and its weights under
    the checkpoint's names (or ours), for `target_config`; HeadError naming `folder`/`source` when they do not fit."""
    check_export_target(config, target_config, folder)
    dflash = config["dflash_config"]
    layers = dflash.get("target_layer_ids")
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise HeadError(f"{folder}/{source}: dflash_config.target_layer_ids must be a list of layer indices")
    head_config = HeadConfig(
        head_type=DFlashHead.head_type,
        hidden_size=target_config.hidden_size,
        target=target_identity(target_config),
        layer_config=layer_config_dict(target_config),
        fc_bias=False,
        extra={
            "block_size": int(dflash.get("block_size", config.get("block_size", 0))),
            "num_layers": int(config.get("num_hidden_layers", 0)),
            "target_layers": layers,
            "mask_token_id": dflash.get("mask_token_id"),
            "num_target_layers": target_config.num_hidden_layers,
        },
    )
    try:
        head = DFlashHead(head_config)
    except HeadError as e:
        raise HeadError(f"{folder}/{source}: {e}") from e
    state = {our_key(k): v for k, v in weights.items()}  # (our own names pass unchanged)
    return load_checked(head, state, folder, "a DFlash checkpoint")


LAYOUTS = (DFlashLayout(),)

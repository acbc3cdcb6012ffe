"""Format "eagle3": EAGLE-3 heads as SGLang's LlamaForCausalLMEagle3 and EAGLE's EAGLE-3 code load them, and
`Eagle3Layout`, the EAGLE-3 layout that vLLM's and speculators' formats vary.

`fc.weight` [H, 3H] without bias, `midlayer.*` (q/k/v take 2H inputs; `input_layernorm` on the embedding,
`hidden_norm`), `norm.weight`, `lm_head.weight` [V', H], `d2t` (int64 offsets: target id = draft id + d2t[draft
id]), `t2d` (bool over the target vocabulary) and `embed_tokens.weight` (the target's: EAGLE's cnets.py does not
load it when `target_hidden_size` is set); config `architectures: ["LlamaForCausalLMEagle3"]` with
`draft_vocab_size` and `target_hidden_size`. The fused layers: vLLM reads top-level
`eagle_aux_hidden_state_layer_ids` as inputs of decoder layers (our output i is its i + 1); SGLang reads only
`eagle_config.eagle_aux_hidden_state_layer_ids` and adds 1 itself (our output indices as they are); EAGLE's code
always fuses the inputs of layers 2, L/2 and L-3.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..draft import Eagle3Head, HeadError
from .layout import Layout
from .shared import (
    check_export_target,
    eagle3_fields,
    eagle3_key,
    eagle3_state,
    fused_inputs,
    identity,
    is_eagle3_config,
    layer_fields,
    load_checked,
    read_export_config,
    read_weights,
)


def eagle_code_fused_inputs(num_layers: int) -> list[int]:
    """The decoder layers whose inputs EAGLE's own EAGLE-3 code fuses (modeling_llama_kv.py), whatever the config
    says."""
    return [i for i in range(num_layers) if i in (2, num_layers // 2, num_layers - 3)]


class Eagle3Layout(Layout):
    """EAGLE-3 heads: fc over three fused target layers, one layer, their own norm and lm_head over d2t."""

    format = "eagle3"
    heads = ("eagle3",)
    kind = "EAGLE-3"
    needs_target = True  # the export carries the target's embedding
    imports_with_model = True  # Eagle3Head.for_target reads the target's norm and lm_head
    fallback = True  # a foreign EAGLE-3 config without speculators' fields: EAGLE's, SGLang's or vLLM's
    loaders = "the EAGLE-3 loaders take Llama-architecture heads"
    prefix = "midlayer."  # where the layer's weights go (EAGLE's code's names)

    def state(self, head, embedding=None) -> dict[str, torch.Tensor]:
        """`eagle3_state` with the target's embedding, which EAGLE's code loads from the export."""
        if embedding is None:
            raise HeadError(
                "an eagle3 export carries the target's embedding (EAGLE's code does not load it for "
                "EAGLE-3 heads); pass the target model"
            )
        return eagle3_state(head, embedding, self.prefix)

    def embedding(self, target) -> torch.Tensor:
        """The target's input embedding."""
        return target.get_input_embeddings().weight

    def config(self, head, dtype, target=None, speculative_tokens=None) -> dict:
        """The layer config with the EAGLE-3 fields at the top level (vLLM) and SGLang's `eagle_config`."""
        config = self.base_config(head, dtype)
        # SGLang reads only this one and adds 1 itself: outputs of decoder layers, ours as they are.
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(head.feature_spec.layers),
            "use_aux_hidden_state": True,
        }
        return config

    def base_config(self, head, dtype) -> dict:
        """The config every EAGLE-3 layout that is not speculators' writes: layer, identity, EAGLE-3 fields."""
        config = layer_fields(head, dtype)
        config.update(identity(head, self.format))
        config.update({"architectures": ["LlamaForCausalLMEagle3"], "bias": False, **eagle3_fields(head)})
        return config

    def notes(self, head, target_config=None) -> list[str]:
        """EAGLE's own code fuses fixed layers: said when this head fuses others."""
        if target_config is None:
            return []
        inputs, fixed = fused_inputs(head), eagle_code_fused_inputs(target_config.num_hidden_layers)
        if inputs == fixed:
            return []
        return [
            f"EAGLE's own code always fuses the inputs of layers {fixed}, this head those of {inputs}: "
            f"run it with vLLM or SGLang (they read the layer ids from config.json), not EAGLE's EaModel"
        ]

    def recognizes(self, config: dict) -> bool:
        """An EAGLE-3 config that is not a speculators one."""
        return is_eagle3_config(config) and "speculators_config" not in config

    def load(self, folder, target) -> Eagle3Head:
        """`import_eagle3` for the target model."""
        return import_eagle3(folder, target)


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


def _fused_layers(config: dict) -> list[int] | None:
    """The fused layers as outputs of decoder layers: vLLM's top-level ids (inputs: minus 1), else SGLang's."""
    layers = config.get("eagle_aux_hidden_state_layer_ids")  # inputs of these layers = outputs of i - 1
    if layers is not None:
        if any(i < 1 for i in layers):
            raise HeadError(f"eagle_aux_hidden_state_layer_ids {layers} must be >= 1 (inputs of decoder layers)")
        return [i - 1 for i in layers]
    if isinstance(config.get("eagle_config"), dict) and "eagle_aux_hidden_state_layer_ids" in config["eagle_config"]:
        return list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])  # SGLang's: outputs already
    return None


def import_eagle3(folder, target_model) -> Eagle3Head:
    """Read an EAGLE-3 head (EAGLE / vLLM / SGLang / speculators layout) for `target_model`."""
    folder = Path(folder)
    config = eagle3_export_config(read_export_config(folder), folder)
    check_export_target(config, target_model.config, folder)
    weights = read_weights(folder)
    vocab = target_model.config.vocab_size
    d2t = None  # no d2t, or the identity: drafting over the whole vocabulary
    if "d2t" in weights:
        d2t = weights["d2t"].long() + torch.arange(weights["d2t"].numel())
        d2t = None if d2t.numel() == vocab and torch.equal(d2t, torch.arange(vocab)) else d2t
    head = Eagle3Head.for_target(target_model, d2t, fused_layers=_fused_layers(config))
    state = {
        eagle3_key(key): value
        for key, value in weights.items()
        if key not in ("d2t", "t2d") and not key.startswith("embed_tokens.")
    }
    return load_checked(head, state, folder, "an EAGLE-3 head")


LAYOUTS = (Eagle3Layout(),)

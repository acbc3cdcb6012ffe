"""Format "eagle": EAGLE-1/2 heads as SafeAILab/EAGLE's own code loads them (eagle/model/cnets1.py, ea_model.py),
and `EagleLayout`, the EAGLE-1/2 layout that vLLM's and SGLang's formats vary.

- weights `fc.weight` [H, 2H] and `layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
  post_attention_layernorm}.weight`; layer 0 has no input_layernorm; no lm_head, no final norm (the target's
  embedding and lm_head are used);
- `fc.bias`: EAGLE keeps it when config "bias" is true (the head's own fc_bias);
- `architectures: ["LlamaForCausalLM"]`; `rope_scaling` as EAGLE's {type, factor};
- the draft vocabulary is written as `token_map.pt` (a list of target ids in draft order), SGLang's
  `--speculative-token-map`; vLLM and EAGLE draft EAGLE-1/2 heads over the full vocabulary.
Import reads any of the three EAGLE-1/2 layouts back (an all-zero `fc.bias`, SGLang's, is no bias).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..draft import EagleHead
from . import TOKEN_MAP
from .layout import Layout
from .shared import (
    check_export_target,
    eagle_key,
    eagle_state,
    identity,
    is_eagle3_config,
    layer_fields,
    load_checked,
    read_export_config,
    read_token_map,
    read_weights,
)

# How EAGLE-1/2-only formats refuse other heads (EAGLE-3 heads go to "eagle3").
REFUSAL = "{head} exports as {formats}, not {format!r} (SGLang and EAGLE load 'eagle3')"


class EagleLayout(Layout):
    """EAGLE-1/2 heads: one Llama layer over fc([embedding; feature]), the target's lm_head over `token_map.pt`."""

    format = "eagle"
    heads = ("eagle",)
    kind = "EAGLE-1/2"
    fallback = True  # a foreign EAGLE-1/2 config that no engine's layout claims: EAGLE's original checkpoints
    loaders = "the EAGLE, vLLM and SGLang EAGLE loaders take Llama-architecture heads"
    architecture = "LlamaForCausalLM"
    eagle_code = True  # EAGLE's code reads rope_scaling as {type, factor}

    def state(self, head, embedding=None) -> dict[str, torch.Tensor]:
        """Our `layer.*` as `layers.0.*`, fc.bias as the head has it (the format's bias rule: `fc_bias`)."""
        return self.fc_bias(head, eagle_state(head))

    def fc_bias(self, head, state: dict) -> dict:
        """The format's rule for fc.bias; EAGLE's code keeps the head's."""
        return state

    def config_bias(self, head) -> bool:
        """Config "bias": EAGLE reads it as whether fc has a bias (vLLM and SGLang as the attention's: false)."""
        return head.config.fc_bias

    def config(self, head, dtype, target=None, speculative_tokens=None) -> dict:
        """The layer config with the architecture this format's loader maps and its "bias"."""
        return {
            **layer_fields(head, dtype, self.eagle_code),
            **identity(head, self.format),
            "architectures": [self.architecture],
            "bias": self.config_bias(head),
        }

    def write_companions(self, head, folder: Path) -> None:
        """`token_map.pt`, always written so that an overwrite never keeps another head's map."""
        torch.save(head.d2t.detach().cpu().long().tolist(), folder / TOKEN_MAP)  # SGLang: torch.tensor(list)

    def notes(self, head, target_config=None) -> list[str]:
        """Where the draft vocabulary went: SGLang reads the token map, vLLM and EAGLE draft over the whole one."""
        if head.config.draft_vocab_size is None:
            return []
        return [
            f"the draft vocabulary ({head.config.draft_vocab_size} tokens) is in {TOKEN_MAP}: pass it to "
            "SGLang as --speculative-token-map; vLLM and EAGLE draft EAGLE-1/2 heads over the full "
            "vocabulary"
        ]

    def recognizes(self, config: dict) -> bool:
        """Any config not an EAGLE-3 one (EAGLE's own checkpoints name LlamaForCausalLM, or nothing)."""
        return not is_eagle3_config(config)

    def load(self, folder, target) -> EagleHead:
        """`import_eagle` for the target's config."""
        return import_eagle(folder, target)


def import_eagle(folder, target_config) -> EagleHead:
    """Read an EAGLE-1/2 head (original EAGLE, vLLM or SGLang layout) for `target_config`."""
    folder = Path(folder)
    config = read_export_config(folder)
    check_export_target(config, target_config, folder)
    weights = read_weights(folder)
    # layer 0's input_layernorm and a copied embedding are not used by EAGLE-1/2 heads
    weights = {k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "layers.0.input_layernorm."))}
    if "fc.bias" in weights and not weights["fc.bias"].abs().max() > 0:
        del weights["fc.bias"]  # SGLang's layout always has one: all zeros is no bias
    head = EagleHead.for_target(
        target_config, draft_tokens=read_token_map(folder, target_config.vocab_size), fc_bias="fc.bias" in weights
    )
    state = {eagle_key(k): v for k, v in weights.items()}
    return load_checked(head, state, folder, "an EAGLE-1/2 head")


LAYOUTS = (EagleLayout(),)

"""Format "sglang": EAGLE-1/2 heads as SGLang 0.5.23 loads them (srt/models/llama_eagle.py, spec_utils.py): EAGLE's
layout with `fc.bias` always (SGLang's fc has one: zeros when the head has none), `architectures:
["LlamaForCausalLMEagle"]`, config "bias" false (SGLang reads it as the attention's bias too) and the draft
vocabulary in `token_map.pt` (`--speculative-token-map`). SGLang loads EAGLE-3 heads as format "eagle3".
"""

from __future__ import annotations

import torch

from .eagle import REFUSAL, EagleLayout

__all__ = ["LAYOUTS", "REFUSAL"]


class SglangEagle(EagleLayout):
    """EAGLE-1/2 heads for SGLang's LlamaForCausalLMEagle."""

    format = "sglang"
    fallback = False
    eagle_code = False
    architecture = "LlamaForCausalLMEagle"

    def fc_bias(self, head, state: dict) -> dict:
        """SGLang's fc always has a bias: zeros for a head without one."""
        if state.get("fc.bias") is None:
            state["fc.bias"] = torch.zeros(head.fc.out_features, dtype=head.fc.weight.dtype)
        return state

    def config_bias(self, head) -> bool:
        """False: SGLang reads config "bias" as the attention's bias as well as fc's."""
        return False

    def recognizes(self, config: dict) -> bool:
        """An EAGLE-1/2 config naming SGLang's architecture."""
        return super().recognizes(config) and config.get("architectures") == [self.architecture]


LAYOUTS = (SglangEagle(),)

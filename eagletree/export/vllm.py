"""Format "vllm": a head for vLLM's `speculative_config={"method": "eagle" | "eagle3", "model": OUT}`, in the layout
of the head's kind (vLLM 0.32-0.33: model_executor/models/llama_eagle.py, llama_eagle3.py, transformers_utils/
configs/eagle.py, config/speculative.py, v1/spec_decode/llm_base_proposer.py).

- EAGLE-1/2 heads (method "eagle"): EAGLE's layout without `fc.bias` (vLLM's fc has none: a head with a non-zero
  bias is refused), `architectures: ["LlamaForCausalLM"]` (vLLM maps it to EagleLlamaForCausalLM), config "bias"
  false (vLLM reads it as the attention's bias); vLLM drafts over the full vocabulary (the token map is SGLang's).
- EAGLE-3 heads (method "eagle3"): the "eagle3" layout without the target's embedding (vLLM shares the target's
  when the draft has none) and without SGLang's `eagle_config`, with `norm_before_residual: false` written
  (eagletree's residual is the un-normed hidden).
"""

from __future__ import annotations

from ..draft import HeadError
from .eagle import EagleLayout
from .eagle3 import Eagle3Layout
from .shared import eagle3_state


class VllmEagle(EagleLayout):
    """EAGLE-1/2 heads for vLLM's EagleLlamaForCausalLM: no fc.bias."""

    format = "vllm"
    fallback = False
    eagle_code = False

    def fc_bias(self, head, state: dict) -> dict:
        """vLLM's EAGLE fc has no bias: an all-zero one is dropped, another refused."""
        bias = state.get("fc.bias")
        if bias is not None:
            if bias.abs().max() > 0:
                raise HeadError(
                    "vLLM's EAGLE fc has no bias but this head's fc.bias is non-zero; "
                    "train with fc_bias=false (the default) to export for vLLM"
                )
            del state["fc.bias"]
        return state

    def config_bias(self, head) -> bool:
        """False: vLLM reads config "bias" as the attention's."""
        return False

    def recognizes(self, config: dict) -> bool:
        """An EAGLE-1/2 config naming LlamaForCausalLM without a bias (as EAGLE's own export without fc.bias)."""
        return (
            super().recognizes(config) and config.get("architectures") == [self.architecture] and not config.get("bias")
        )


class VllmEagle3(Eagle3Layout):
    """EAGLE-3 heads for vLLM's Eagle3LlamaForCausalLM: the target's embedding shared, no SGLang fields."""

    format = "vllm"
    needs_target = False  # vLLM shares the target's embedding
    fallback = False

    def state(self, head, embedding=None) -> dict:
        """The EAGLE-3 weights without an embedding."""
        return eagle3_state(head, None, self.prefix)

    def embedding(self, target) -> None:
        """None: vLLM uses the target's own."""
        return None

    def config(self, head, dtype, target=None, speculative_tokens=None) -> dict:
        """The EAGLE-3 config with `norm_before_residual` written."""
        config = self.base_config(head, dtype)
        config["norm_before_residual"] = False  # (vLLM's default for this config too; written to be plain)
        return config

    def notes(self, head, target_config=None) -> list[str]:
        """None: vLLM reads the layer ids from the config."""
        return []

    def recognizes(self, config: dict) -> bool:
        """An EAGLE-3 config without SGLang's `eagle_config`."""
        return super().recognizes(config) and "eagle_config" not in config


LAYOUTS = (VllmEagle(), VllmEagle3())

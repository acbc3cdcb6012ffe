"""Format "speculators": EAGLE-3 heads as a speculators checkpoint, which vLLM serves from the folder alone
(`LLM(model=OUT)`; read in vLLM 0.32: transformers_utils/config.py, configs/speculators/base.py and algos.py).

config.json without a top-level `model_type` (vLLM then parses it as "speculators" because `speculators_config` is
there), `speculators_model_type: "eagle3"`, `speculators_config` (`proposal_methods[0].speculative_tokens`: vLLM's
num_speculative_tokens; `verifier.name_or_path`: the target vLLM loads instead of OUT, written as the target's
absolute folder), `transformer_layer_config` (the Llama layer config) and at the top level `draft_vocab_size`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (inputs of layers, as for "vllm") and
`norm_before_residual: false` (vLLM's default for a speculators config is true, speculators' own false); weights
named as speculators names them (`layers.0.*`, which vLLM maps as it maps `midlayer.*`), d2t and t2d as for
"eagle3", no embedding. vLLM reads the speculators format for EAGLE-3 (and newer types) only.
"""

from __future__ import annotations

from pathlib import Path

from ..draft import HeadError
from .eagle3 import Eagle3Layout
from .shared import eagle3_fields, eagle3_state, identity, layer_fields

SPECULATIVE_TOKENS = 3  # a speculators export's default chain length (vLLM's num_speculative_tokens)
REFUSAL = (
    "format {format!r} takes {takes} heads (vLLM reads speculators configs for EAGLE-3 only); {head} exports as "
    "{formats}"
)


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


class SpeculatorsEagle3(Eagle3Layout):
    """EAGLE-3 heads as a speculators checkpoint naming its verifier."""

    format = "speculators"
    fallback = False
    prefix = "layers.0."  # speculators' names

    def state(self, head, embedding=None) -> dict:
        """The EAGLE-3 weights under speculators' names, without an embedding (vLLM shares the target's)."""
        return eagle3_state(head, None, self.prefix)

    def embedding(self, target) -> None:
        """None: vLLM uses the target's own."""
        return None

    def config(self, head, dtype, target=None, speculative_tokens=None) -> dict:
        """The speculators config: the target (its folder) as the verifier, `speculative_tokens` per step."""
        tokens = SPECULATIVE_TOKENS if speculative_tokens is None else speculative_tokens
        return speculators_config(head, layer_fields(head, dtype), speculators_verifier(target), tokens) | identity(
            head, self.format
        )

    def notes(self, head, target_config=None) -> list[str]:
        """How vLLM starts it: the verifier's folder, or the target and this folder as the draft model."""
        where = str(getattr(target_config, "name_or_path", "") or "the verifier's name_or_path")
        where = str(Path(where).resolve()) if Path(where).is_dir() else where
        return [
            f"LLM(model=OUT) serves it with the target vLLM loads from {where} (speculators_config.verifier."
            f"name_or_path in config.json), {SPECULATIVE_TOKENS} speculative tokens unless speculative_config="
            '{"num_speculative_tokens": N}; where that folder is elsewhere, start LLM(model=TARGET, '
            'speculative_config={"method": "eagle3", "model": OUT, "num_speculative_tokens": N})'
        ]

    def recognizes(self, config: dict) -> bool:
        """A config with a `speculators_config` (of any type: import refuses those other than eagle3)."""
        return "speculators_config" in config


LAYOUTS = (SpeculatorsEagle3(),)

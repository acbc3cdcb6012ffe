"""Format "speculators": EAGLE-3 and block heads as speculators checkpoints (types "eagle3" and "dflash"), which vLLM
serves from the folder alone (`LLM(model=OUT)`; read in vLLM 0.32: transformers_utils/config.py,
configs/speculators/base.py and algos.py, model_executor/models/qwen3_dflash.py).

EAGLE-3 heads:
config.json without a top-level `model_type` (vLLM then parses it as "speculators" because `speculators_config` is
there), `speculators_model_type: "eagle3"`, `speculators_config` (`proposal_methods[0].speculative_tokens`: vLLM's
num_speculative_tokens; `verifier.name_or_path`: the target vLLM loads instead of OUT, written as the target's
absolute folder), `transformer_layer_config` (the Llama layer config) and at the top level `draft_vocab_size`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (inputs of layers, as for "vllm") and
`norm_before_residual: false` (vLLM's default for a speculators config is true, speculators' own false); weights
named as speculators names them (`layers.0.*`, which vLLM maps as it maps `midlayer.*`), d2t and t2d as for
"eagle3", no embedding. Block heads: `SpeculatorsDFlash` below.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..draft import DFlashHead, HeadError
from .dflash import DFlashLayout, dflash_head
from .eagle3 import Eagle3Layout
from .shared import eagle3_fields, eagle3_state, identity, layer_fields, read_export_config, read_weights, t2d_mask

SPECULATIVE_TOKENS = 3  # a speculators export's default chain length (vLLM's num_speculative_tokens)
REFUSAL = (
    "format {format!r} takes {takes} heads (vLLM reads speculators configs of those types); {head} exports as {formats}"
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


def speculators_config(
    head, layer_config: dict, verifier: dict | None, speculative_tokens: int, algorithm: str = "eagle3"
) -> dict:
    """A speculators-format config.json (what vLLM's SpeculatorsConfig reads; no top-level model_type): EAGLE-3's
    fields, or (another `algorithm`) only what every type shares."""
    if not verifier or not verifier.get("name_or_path"):
        raise HeadError("a speculators export names its verifier (the target vLLM loads): pass the target model")
    if not (isinstance(speculative_tokens, int) and speculative_tokens >= 1):
        raise HeadError(f"speculative_tokens must be an integer >= 1, got {speculative_tokens!r}")
    shared = {
        "speculators_model_type": algorithm,
        "speculators_config": {
            "algorithm": algorithm,
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
        "dtype": layer_config["dtype"],
        "torch_dtype": layer_config["torch_dtype"],
    }
    if algorithm != "eagle3":
        return shared
    return {
        "architectures": ["Eagle3Speculator"],
        **shared,
        **eagle3_fields(head),
        # vLLM reads a missing value as true (norm the hidden, then keep it as the residual); eagletree keeps the
        # un-normed hidden as the residual.
        "norm_before_residual": False,
        "norm_before_fc": False,
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
        """A config with a `speculators_config` of any type but dflash (import refuses those other than eagle3)."""
        return "speculators_config" in config and config.get("speculators_model_type") != "dflash"


class SpeculatorsDFlash(DFlashLayout):
    """Block heads as a speculators checkpoint of vLLM's `dflash` type: `transformer_layer_config` the draft layers'
    Qwen3 config, `mask_token_id`, `aux_hidden_state_layer_ids` (inputs of decoder layers: ours + 1; vLLM subtracts
    1 for the drafter), and for a head with a draft vocabulary `draft_vocab_size`, `lm_head.weight` (the target's
    rows of it) and `d2t`/`t2d` as for EAGLE-3, which vLLM's DFlash drafter reads, so vLLM drafts over the draft
    vocabulary as eagletree does. `block_size` at the top level is eagletree's (for import); vLLM drafts the
    proposal's speculative_tokens (default: the block's k - 1)."""

    format = "speculators"
    needs_target = True  # the verifier's folder; the lm_head rows of a draft vocabulary

    def embedding(self, target) -> torch.Tensor:
        return target.get_output_embeddings().weight.detach()

    def state(self, head, embedding=None) -> dict:
        state = super().state(head)
        if head.config.draft_vocab_size:
            if embedding is None:
                raise HeadError("a speculators block export of a draft vocabulary needs the target's lm_head")
            d2t = head.d2t.detach().cpu().long()
            state["lm_head.weight"] = embedding.detach().cpu()[d2t]
            state["d2t"] = d2t - torch.arange(d2t.numel())
            state["t2d"] = t2d_mask(d2t, head.config.target["vocab_size"])
        return state

    def config(self, head, dtype, target=None, speculative_tokens=None) -> dict:
        layers = {k: v for k, v in super().config(head, dtype).items() if k not in ("dflash_config", "eagletree")}
        tokens = head.block_size - 1 if speculative_tokens is None else speculative_tokens
        config = speculators_config(head, layers, speculators_verifier(target), tokens, "dflash")
        return (
            config
            | {
                "architectures": ["DFlashSpeculator"],
                "draft_vocab_size": head.config.draft_vocab_size or head.config.target["vocab_size"],
                "target_hidden_size": head.config.hidden_size,
                "mask_token_id": head.mask_token_id,
                "aux_hidden_state_layer_ids": [i + 1 for i in head.target_layers],
                "block_size": head.block_size,
            }
            | identity(head, self.format)
        )

    def write_companions(self, head, folder: Path) -> None:
        """None: the draft vocabulary is in the weights (d2t)."""

    def notes(self, head, target_config=None) -> list[str]:
        return [
            "LLM(model=OUT) serves it with the target its speculators_config.verifier names, drafting a chain of "
            f"up to {head.block_size - 1} tokens from the outputs of target layers {list(head.target_layers)}"
        ]

    def recognizes(self, config: dict) -> bool:
        return "speculators_config" in config and config.get("speculators_model_type") == "dflash"

    def load(self, folder: Path, target) -> DFlashHead:
        """The head in a speculators `dflash` checkpoint, for `target` (its config)."""
        target_config = getattr(target, "config", target)
        config = read_export_config(folder)
        aux = config.get("aux_hidden_state_layer_ids")
        layers = config.get("transformer_layer_config")
        if not isinstance(aux, list) or not all(isinstance(i, int) for i in aux) or not isinstance(layers, dict):
            raise HeadError(
                f"{folder}/config.json: a speculators dflash config needs aux_hidden_state_layer_ids (a list of "
                "layer indices) and transformer_layer_config"
            )
        speculative = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        dflash = {
            "block_size": config.get("block_size", speculative + 1),
            "target_layer_ids": [i - 1 for i in aux],
            "mask_token_id": config.get("mask_token_id"),
        }
        weights = read_weights(Path(folder))
        d2t = weights.pop("d2t", None)
        weights.pop("t2d", None)
        weights.pop("lm_head.weight", None)  # the target's own rows: the head reads them from the target
        merged = layers | {"dflash_config": dflash, "eagletree": config.get("eagletree")}
        head = dflash_head(merged, weights, target_config, folder)
        if d2t is not None:
            head.set_draft_vocab(d2t.long() + torch.arange(d2t.numel()))
        return head


LAYOUTS = (SpeculatorsEagle3(), SpeculatorsDFlash())

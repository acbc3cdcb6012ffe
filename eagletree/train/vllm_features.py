"""`eagletree features --engine vllm`: the target's hidden states from vLLM's offline `LLM`, not from transformers.

vLLM (since 0.18) extracts hidden states with its `extract_hidden_states` speculative method: each request's
states of the layers asked for, written by a KV-transfer connector as a safetensors file (`hidden_states`
[T, layers, H], the layers ascending; `token_ids` [T]). Layer id L there is the residual stream entering decoder
layer L: transformers' `hidden_states[L]` for L below the layer count N, and for L = N the last layer's output
before the final norm (transformers' last entry is after it). So a head's training features (`FeatureSpec`: the
post-norm last state, then the outputs of the layers it fuses, layer i's output being id i + 1) are ids N and i + 1,
with the target's own final norm (from its shell: `target/shell.py`) applied to id N here.

Every request is one conversation's rendered token ids (prompt and answer), run for one token; vLLM batches a
shard's conversations itself, of any lengths. The ids vLLM wrote back must equal the ids sent, conversation by
conversation (an earlier generator silently paired states with other ids at batch sizes above one). On a CPU build
the connector is `vllm_connector.CpuHiddenStatesConnector`. The engine starts eager (compiling took 66-100 s a start
on 2 cores and extracted no faster).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from .features import FeatureError
from .vllm_connector import CONNECTOR
from .vllm_engine import VLLM_INSTALL, kv_cache_bytes


def import_extraction():
    """vLLM's (LLM, SamplingParams, load_hidden_states, cleanup_hidden_states); a one-line FeatureError naming what
    is missing where vLLM is absent or lacks the `extract_hidden_states` method."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        import vllm
    except ImportError as e:
        raise FeatureError(
            f"--engine vllm needs vLLM, which {sys.executable} cannot import ({e}); {VLLM_INSTALL}"
        ) from None
    try:
        from vllm import LLM, SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )
        from vllm.v1.spec_decode import extract_hidden_states  # noqa: F401 (the method itself)
    except ImportError as e:
        raise FeatureError(
            f"--engine vllm: vLLM {getattr(vllm, '__version__', '?')} lacks hidden-state extraction (the "
            f"extract_hidden_states method, vLLM >= 0.18): {e}"
        ) from None
    return LLM, SamplingParams, load_hidden_states, cleanup_hidden_states


class VllmStates:
    """vLLM's offline `LLM` over a target folder (split over `tensor_parallel` GPUs) extracting the hidden states of
    vLLM layer ids `layer_ids` (any order): `states(prompts)` -> [T, len(layer_ids), H] per prompt, in that order."""

    def __init__(self, folder, config, dtype: torch.dtype, layer_ids: list[int], tensor_parallel: int = 1):
        self.LLM, self.SamplingParams, self.load, self.cleanup = import_extraction()
        self.folder, self.config, self.dtype = str(folder), config, dtype
        self.ids = sorted(set(layer_ids))  # vLLM sorts them itself and sizes its buffer by their count
        self.pick = [self.ids.index(i) for i in layer_ids]
        self.llm, self.out_dir, self.tensor_parallel = None, None, tensor_parallel

    def start(self, max_model_len: int, max_seqs: int) -> None:
        """Start vLLM for conversations of up to `max_model_len` - 1 tokens, `max_seqs` at a time."""
        if self.llm is not None:
            return
        from vllm.platforms import current_platform

        options = {}
        if current_platform.is_cpu():
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the target's cache and the states' cache
                states = len(self.ids) * self.config.hidden_size * torch.finfo(self.dtype).bits // 8
                tokens = (max_model_len + 16) * max_seqs
                options["kv_cache_memory_bytes"] = 2 * (
                    kv_cache_bytes(self.config, self.dtype, tokens) + states * tokens
                )
            iomp = Path(sys.prefix) / "lib" / "libiomp5.so"  # as vLLM's CPU docs advise (vllm_engine.py)
            preload = os.environ.get("LD_PRELOAD", "")
            if iomp.is_file() and "libiomp" not in preload:
                os.environ["LD_PRELOAD"] = " ".join(p for p in (str(iomp), preload) if p)
            connector = {"kv_connector": CONNECTOR, "kv_connector_module_path": "eagletree.train.vllm_connector"}
        else:
            connector = {"kv_connector": "ExampleHiddenStatesConnector"}
        self.out_dir = tempfile.mkdtemp(prefix="eagletree-vllm-states-")
        self.llm = self.LLM(
            model=self.folder,
            dtype=str(self.dtype).removeprefix("torch."),
            seed=0,
            max_model_len=max_model_len,
            max_num_seqs=max_seqs,
            enforce_eager=True,
            tensor_parallel_size=self.tensor_parallel,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self.ids}},
            },
            kv_transfer_config=connector
            | {"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": self.out_dir}},
            **options,
        )

    def states(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """[T, len(layer_ids), H] per prompt (ids [T]), one vLLM call for all; FeatureError where vLLM wrote back
        other token ids or another number of rows than it was sent."""
        params = self.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
        found = []
        for n, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            path = out.kv_transfer_params["hidden_states_path"]
            data = self.load(path)  # (waits for the write's lock)
            self.cleanup(path)
            hidden, ids = data["hidden_states"], data["token_ids"]
            same = torch.equal(ids.long().cpu(), prompt.long().cpu())
            if not same or tuple(hidden.shape[:2]) != (len(prompt), len(self.ids)):
                raise FeatureError(
                    f"vLLM wrote back {ids.numel()} token ids and states {tuple(hidden.shape)} for request {n} of "
                    f"{len(prompt)} tokens and {len(self.ids)} layers (the same ids: {same})"
                )
            found.append(hidden[:, self.pick])
        return found

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self.out_dir is not None:
            shutil.rmtree(self.out_dir, ignore_errors=True)


def vllm_training_features(spec, shell, engine: VllmStates):
    """features(ids list, bar) -> [T, spec.training_width] per conversation from vLLM's states (see the module)."""
    norm = shell.get_decoder().norm

    def features(ids: list[torch.Tensor], bar) -> list[torch.Tensor]:
        out = []
        for hidden in engine.states(ids):
            last = norm(hidden[:, 0].to(norm.weight.dtype if hasattr(norm, "weight") else hidden.dtype))
            out.append(torch.cat([last.to(hidden.dtype), hidden[:, 1:].flatten(1)], dim=-1) if spec.layers else last)
        bar.update(sum(int(x.numel()) for x in ids))
        return out

    return features


def layer_ids(spec, num_layers: int) -> list[int]:
    """vLLM's layer ids for a head's training features: the last layer's output, then each fused layer's."""
    return [num_layers] + [i + 1 for i in (spec.layers or ())]

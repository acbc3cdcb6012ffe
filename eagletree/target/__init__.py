"""The target model: loading it (alias, HF folder or GGUF file) and running it over a draft tree."""

from .attention import GQA_SDPA, use_gqa_sdpa
from .forward import (
    TreeForwardOutput,
    cache_kwarg,
    cache_length,
    keep_cache_positions,
    mask_for_config,
    mask_for_model,
    new_cache,
    tree_forward,
    truncate_cache,
)
from .identity import target_identity
from .loading import (
    ALIASES,
    TargetError,
    alias_path,
    cache_dir,
    check_causal_lm,
    check_target_spec,
    checked_device,
    cpu_has_bf16,
    default_device,
    gguf_to_folder,
    load_target,
    resolve_target,
    target_config,
)

__all__ = [
    "ALIASES",
    "GQA_SDPA",
    "TargetError",
    "TreeForwardOutput",
    "alias_path",
    "cache_dir",
    "cache_kwarg",
    "cache_length",
    "check_causal_lm",
    "check_target_spec",
    "checked_device",
    "cpu_has_bf16",
    "default_device",
    "gguf_to_folder",
    "keep_cache_positions",
    "load_target",
    "mask_for_config",
    "mask_for_model",
    "new_cache",
    "resolve_target",
    "target_config",
    "target_identity",
    "tree_forward",
    "truncate_cache",
    "use_gqa_sdpa",
]

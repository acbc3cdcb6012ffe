"""EAGLE-1/2 draft head: fc(concat(embedding of token t+1, target feature t)) -> one decoder layer -> feature t+1.

The decoder layer is the target architecture's own transformers class, built from the target's
config with one layer. The target's embedding and lm_head are shared and frozen: they are
passed in at call time and never stored in the head's weights.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..target import mask_for_config

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
_IDENTITY_KEYS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "rope_theta", "max_position_embeddings")


class HeadError(ValueError):
    """A head that does not fit its target, or files that cannot be loaded."""


def target_identity(config) -> dict:
    """What a head must match: model type, sizes, and a fingerprint of the architecture config."""
    values = {k: getattr(config, k, None) for k in _IDENTITY_KEYS}
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"model_type": config.model_type, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "fingerprint": digest}


@dataclass
class HeadConfig:
    head_type: str  # "eagle" (EAGLE-1/2)
    hidden_size: int
    target: dict  # target_identity() of the target it was built for
    layer_config: dict  # the target's config with one layer (to rebuild the decoder layer)
    draft_vocab_size: int | None = None  # None: the full target vocabulary
    fc_bias: bool = True
    extra: dict = field(default_factory=dict)


def _layer_config(target_config):
    cfg = copy.deepcopy(target_config)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"]  # the head's one layer sees the whole context
    cfg.num_hidden_layers = 1
    cfg.use_cache = True
    cfg._attn_implementation = "sdpa"
    for attr in ("quantization_config",):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    return cfg


def _build_layer(layer_config):
    """The target architecture's decoder layer and rotary embedding, from transformers itself."""
    from transformers import AutoModel

    cfg = copy.deepcopy(layer_config)
    cfg.vocab_size, cfg.pad_token_id = 1, None  # the throwaway base model's embedding stays tiny
    base = AutoModel.from_config(cfg, attn_implementation="sdpa")
    layer = base.layers[0]
    # EAGLE's first (only) layer has no input norm: its input is the fc output (EAGLE, vLLM and
    # SGLang all drop it), so the exported weights carry none.
    layer.input_layernorm = nn.Identity()
    return layer, base.rotary_emb


def _cache_kwarg(module) -> str:
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class EagleHead(nn.Module):
    """EAGLE-1/2 feature-level draft head."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        from transformers import AutoConfig

        if config.head_type != "eagle":
            raise HeadError(f"head_type {config.head_type!r} is not supported by EagleHead; expected 'eagle'")
        self.config = config
        layer_cfg = dict(config.layer_config)
        self.layer_config = AutoConfig.for_model(layer_cfg.pop("model_type"), **layer_cfg)
        self.layer_config._attn_implementation = "sdpa"
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layer, self.rotary = _build_layer(self.layer_config)
        self._cache_kw = _cache_kwarg(self.layer)
        vocab = config.draft_vocab_size or config.target["vocab_size"]
        # Draft vocabulary maps (identity for a full-vocabulary head): draft id -> target id.
        self.register_buffer("d2t", torch.arange(vocab), persistent=True)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def for_target(cls, target_config, draft_tokens: torch.Tensor | None = None) -> "EagleHead":
        """A freshly initialized head for a target (config of the HF model); optional draft vocabulary."""
        cfg = _layer_config(target_config)
        layer_dict = cfg.to_dict()
        layer_dict.pop("quantization_config", None)
        head_cfg = HeadConfig(
            head_type="eagle", hidden_size=target_config.hidden_size, target=target_identity(target_config),
            layer_config=layer_dict, draft_vocab_size=None if draft_tokens is None else int(draft_tokens.numel()),
        )
        head = cls(head_cfg)
        if draft_tokens is not None:
            head.set_draft_vocab(draft_tokens)
        std = getattr(target_config, "initializer_range", 0.02)
        for module in head.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        return head

    def set_draft_vocab(self, draft_tokens: torch.Tensor) -> None:
        from .vocab import check_draft_vocab

        check_draft_vocab(draft_tokens, self.config.target["vocab_size"])
        self.d2t = draft_tokens.to(self.d2t.device, torch.long).clone()
        self.config.draft_vocab_size = int(draft_tokens.numel())

    def check_target(self, target_config) -> None:
        """Raise HeadError naming both values when the target is not the one this head was built for."""
        mine, theirs = self.config.target, target_identity(target_config)
        for key in ("model_type", "hidden_size", "vocab_size", "fingerprint"):
            if mine[key] != theirs[key]:
                raise HeadError(f"head was trained for a target with {key} = {mine[key]!r}, "
                                f"but this target has {key} = {theirs[key]!r}")

    # -- forward ------------------------------------------------------------------------------

    def forward(self, features, tokens, position_ids, embed, allowed=None, cache=None):
        """Predicted next features [B, T, H].

        features [B, T, H]: target (or predicted) features at positions t; tokens [B, T]: the
        tokens at t+1; embed: the target's (frozen) input embedding; allowed: [T, kv] or
        [B, T, kv] bool mask over cache + new positions (None = causal over the new positions).
        """
        x = self.fc(torch.cat([embed(tokens).to(features.dtype), features], dim=-1))
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(x.shape[0], -1)
        if allowed is None:
            past = 0 if cache is None else cache.get_seq_length()
            t = x.shape[1]
            allowed = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(diagonal=past)
        mask = mask_for_config(self.layer_config, allowed.to(x.device), x.dtype)
        pos = self.rotary(x, position_ids)
        out = self.layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=pos,
                         use_cache=cache is not None, **{self._cache_kw: cache})
        return out[0] if isinstance(out, tuple) else out

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)

    # -- persistence --------------------------------------------------------------------------

    def save_pretrained(self, directory, dtype=None) -> None:
        """Write config.json + model.safetensors atomically (a temporary folder, then rename)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in self.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt", "eagletree": "head"})
        (tmp / CONFIG).write_text(json.dumps(asdict(self.config), indent=2, default=str))
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
            os.replace(directory, old)
            os.replace(tmp, directory)
            import shutil

            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)

    @classmethod
    def from_pretrained(cls, directory, target_config=None, dtype=None, device=None) -> "EagleHead":
        """Load a saved head; with `target_config`, refuse a head built for another target."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
            raise HeadError(f"{str(directory)!r} is not a head folder: expected {CONFIG} and {WEIGHTS}")
        try:
            config = HeadConfig(**json.loads((directory / CONFIG).read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise HeadError(f"{directory / CONFIG} is not a valid head config: {e}") from e
        try:
            state = load_file(str(directory / WEIGHTS))
        except (SafetensorError, OSError, ValueError) as e:
            raise HeadError(f"{directory / WEIGHTS} is truncated or corrupted ({e}); nothing was loaded") from e
        head = cls(config)
        if target_config is not None:
            head.check_target(target_config)
        expected = head.state_dict()
        missing, unexpected = set(expected) - set(state), set(state) - set(expected)
        bad_shape = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
        if missing or unexpected or bad_shape:
            raise HeadError(f"{directory / WEIGHTS} does not match its config: missing {sorted(missing)}, "
                            f"unexpected {sorted(unexpected)}, wrong shape {sorted(bad_shape)}")
        if "d2t" in state:
            head.d2t = state["d2t"].clone()
        head.load_state_dict(state)
        head = head.to(device=device) if device is not None else head
        if dtype is not None:
            head = head.to(dtype)
        return head.eval()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

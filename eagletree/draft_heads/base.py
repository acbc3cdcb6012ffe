"""What every draft head shares: its config (with the target's identity), save/load, target checks."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import EagletreeError

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
_IDENTITY_KEYS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "rope_theta", "max_position_embeddings")
_REGISTRY: dict[str, type] = {}


class HeadError(EagletreeError, ValueError):
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


def head_class(head_type: str):
    """The DraftHead subclass for a saved head_type."""
    from . import eagle, eagle3, medusa  # noqa: F401 (registers the classes)

    if head_type not in _REGISTRY:
        raise HeadError(f"unknown head_type {head_type!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[head_type]


class DraftHead(nn.Module):
    """Base of the draft heads: `config` is a HeadConfig; subclasses set `head_type`."""

    head_type = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.head_type:
            _REGISTRY[cls.head_type] = cls

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

    # -- persistence --------------------------------------------------------------------------

    def save_pretrained(self, directory, dtype=None, keep_others: bool = False) -> None:
        """Write config.json + model.safetensors atomically (a temporary folder, then rename); an existing
        folder is replaced as a whole, or with `keep_others` only these two files are."""
        from safetensors.torch import save_file

        from ..files import building, publish

        directory = Path(directory)
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in self.state_dict().items()}
        with building(directory) as tmp:
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt", "eagletree": "head"})
            (tmp / CONFIG).write_text(json.dumps(asdict(self.config), indent=2, default=str))
        publish(tmp, directory, keep_others=keep_others)

    @classmethod
    def from_pretrained(cls, directory, target_config=None, dtype=None, device=None) -> "DraftHead":
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
        head = head_class(config.head_type)(config)
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
        head.source_dir = str(directory)  # where companion files (e.g. calibration.json) live
        head = head.to(device=device) if device is not None else head
        if dtype is not None:
            head = head.to(dtype)
        return head.eval()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

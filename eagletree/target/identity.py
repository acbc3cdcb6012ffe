"""A target's identity: what a draft head built for it must match, and the key of caches made for it."""

from __future__ import annotations

import hashlib
import json

_IDENTITY_KEYS = (
    "model_type",
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rope_theta",
    "max_position_embeddings",
)


def target_identity(config) -> dict:
    """What a head must match: model type, sizes, and a fingerprint of the architecture config."""
    values = {k: getattr(config, k, None) for k in _IDENTITY_KEYS}
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "fingerprint": digest,
    }

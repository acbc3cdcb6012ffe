"""Offline features: cache the target's hidden states once, train many times without the target.

Layout of `features_dir`: `manifest.json` plus `shard-00000.safetensors`, ... Each shard holds,
per conversation i, `{i}.ids` [T], `{i}.mask` [T] and `{i}.hidden` [T, F]: the features the config's head kind
trains on (its `FeatureSpec.training_features`: the post-norm last hidden state, H wide, then the outputs of the
target layers it fuses, when it fuses some; the manifest's identity names those layers). A shard is written
under a temporary name and renamed, and only then recorded in the manifest (also replaced
atomically) with the sha256 of its bytes, so an interrupted run resumes at the first missing shard and never trusts
half a file. The manifest names the tokenizer that made the ids (`tokenizer_fingerprint`). Reading checks a shard's
checksum when it first opens it, the tokenizer against the target's, and each record's ids, mask and feature rows
against one another; a run of `eagletree features` writes damaged or missing shards again.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..draft import FeatureSpec, head_class, target_identity
from ..errors import EagletreeError
from ..files import is_partial, write_json_atomic, writing
from .config import on_cpu, resolve_precision
from .pretokenized import tokenizer_fingerprint
from .render import MASK_VERSION, RenderError, render

MANIFEST = "manifest.json"
OPEN_SHARDS = 16  # shard files a reader keeps open (memory-mapped) at once
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class FeatureError(EagletreeError, ValueError):
    """A feature cache that does not belong to this target or config, or is damaged."""


def feature_spec(cfg, target_config) -> FeatureSpec:
    """The features a new head of the config's kind reads for this target: what the cache holds."""
    return head_class(cfg.head_type).feature_spec_for(target_config, cfg)


def _identity(cfg, target_config) -> dict:
    layers = feature_spec(cfg, target_config).layers
    return {
        "target": target_identity(target_config),
        "dataset": cfg.dataset,
        "heldout_fraction": cfg.heldout_fraction,
        "max_len": cfg.max_len,
        "long": cfg.long,
        "max_conversations": cfg.max_conversations,
        "dtype": cfg.feature_dtype,
        "masks": MASK_VERSION,
    } | ({"layers": list(layers)} if layers else {})  # (a cache of the last layer alone names none, as before)


def shard_digest(path: Path) -> str:
    """sha256 of a shard file's bytes (read in 16 MiB pieces)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(16 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def damaged_shards(folder: Path, shards: list[dict]) -> list[dict]:
    """The manifest's shards whose file is missing or no longer has the bytes it was written with (shards from
    before checksums were recorded are taken as they are)."""
    return [
        s
        for s in shards
        if not (folder / s["file"]).is_file() or ("sha256" in s and shard_digest(folder / s["file"]) != s["sha256"])
    ]


def load_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise FeatureError(f"{path} is damaged ({e}); delete the folder to start over") from e


def features_dtype(cfg, device: str | None) -> torch.dtype:
    """The precision the target computes the cached features in: the config's training precision on `device`, as
    training resolves it."""
    return torch.bfloat16 if resolve_precision(cfg.precision, on_cpu(device)) == "bf16" else torch.float32


def check_features_dir(folder) -> None:
    """Raise FeatureError unless `folder` is absent, empty or a feature cache (a mistyped features_dir would mix
    the cache into another folder's files)."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / MANIFEST).is_file():
        return
    others = sorted(p.name for p in folder.iterdir() if not (p.name.startswith("shard-") or is_partial(p)))
    if others:
        raise FeatureError(
            f"features_dir {str(folder)!r} holds other files ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}) and no {MANIFEST}; expected a new or empty "
            f"folder, or an earlier feature cache"
        )


def check_shards_match(folder, written: list[dict], planned: list[list[str]]) -> None:
    """FeatureError unless every shard already written holds the conversations the data puts there now: a dataset
    that grew, shrank or changed since would otherwise leave conversations out, or train on stale ones."""
    for shard in written:
        k, held = shard["index"], shard["conversations"]
        now = planned[k] if k < len(planned) else []
        if held != now:
            gone = [c for c in held if c not in now]
            if gone:
                named = ", ".join(map(str, gone[:3])) + (", ..." if len(gone) > 3 else "")
                how = f"{len(gone)} of its conversations ({named}) are no longer there in the data"
            elif len(held) != len(now):
                how = f"it holds {len(held)} conversations, the data now puts {len(now)} there"
            else:
                how = "the data now puts its conversations in another order"
            raise FeatureError(
                f"{folder}: shard {k}: {how}; the dataset changed since it was cached: use another features_dir"
            )


def _resumable_manifest(folder: Path, identity: dict, shard_size: int, tokenizer, log) -> dict:
    """The folder's manifest, or a new one, without the shards that are damaged or missing (written again like
    shards never written); raises FeatureError if it is for another identity, shard size or tokenizer."""
    manifest = load_manifest(folder) or {
        "identity": identity,
        "shards": [],
        "complete": False,
        "shard_size": shard_size,
    }
    if manifest["identity"] != identity:
        raise FeatureError(
            f"{folder} holds features for {manifest['identity']}, not for {identity}; use another features_dir"
        )
    # shards are numbered by position: another size would cut the conversations differently, and the shards
    # written before would hold some of them twice (a cache from before the key recorded none: its first shard's
    # size, when a later one shows that the first is full)
    cached = manifest.get("shard_size") or (
        len(manifest["shards"][0]["conversations"]) if len(manifest["shards"]) > 1 else None
    )
    if cached is not None and cached != shard_size:
        raise FeatureError(
            f"{folder} was cached with --shard-size {cached}; continue it with --shard-size {cached} "
            f"(got {shard_size}), or use another features_dir"
        )
    manifest["shard_size"] = shard_size
    _check_tokenizer(folder, manifest, tokenizer_fingerprint(tokenizer))
    manifest["tokenizer"] = tokenizer_fingerprint(tokenizer)
    damaged = damaged_shards(folder, manifest["shards"])
    if damaged:
        print(f"features: shards {[s['index'] for s in damaged]} are damaged or missing; writing them again", file=log)
        manifest["shards"] = [s for s in manifest["shards"] if s not in damaged]
    return manifest


def _render_all(cfg, tokenizer, conversations) -> tuple[list, int]:
    """([(conversation id, rendered)], how many were skipped: unrenderable, or too long under `long: drop`)."""
    rendered, skipped = [], 0
    for conv in conversations:
        try:
            r = render(tokenizer, conv.messages, cfg.max_len if cfg.long == "truncate" else None)
        except RenderError:
            skipped += 1
            continue
        if cfg.long == "drop" and r.input_ids.numel() > cfg.max_len:
            skipped += 1
            continue
        rendered.append((conv.id, r))
    return rendered, skipped


def hf_training_features(model, spec: FeatureSpec):
    """features(ids list, bar) -> [T, spec.training_width] per conversation: the target run on each in turn."""

    def features(ids: list[torch.Tensor], bar) -> list[torch.Tensor]:
        device, out = next(model.parameters()).device, []
        for x in ids:
            with torch.inference_mode():
                out.append(spec.training_features(model, x.to(device)))
            bar.update(x.numel())
        return out

    return features


def _shard_tensors(features, shard: list, dtype, bar) -> tuple[dict, list]:
    """One shard's conversations through `features`: (the tensors to save, the conversation ids)."""
    hidden = features([r.input_ids for _, r in shard], bar)
    tensors, ids = {}, []
    for i, ((conv_id, r), h) in enumerate(zip(shard, hidden, strict=True)):
        tensors[f"{i}.ids"] = r.input_ids.to(torch.int32)
        tensors[f"{i}.mask"] = r.loss_mask.to(torch.uint8)
        tensors[f"{i}.hidden"] = h.to("cpu", dtype).contiguous()
        ids.append(conv_id)
    return tensors, ids


def _write_shard(folder: Path, k: int, tensors: dict, ids: list, engine: str) -> dict:
    """Shard k's file, written under a temporary name and renamed; returns its manifest entry."""
    name = f"shard-{k:05d}.safetensors"
    with writing(folder / name) as tmp:
        save_file(tensors, tmp)
        digest = shard_digest(tmp)
    tokens = sum(int(t.numel()) for key, t in tensors.items() if key.endswith(".ids"))
    return {"index": k, "file": name, "sha256": digest, "engine": engine, "conversations": ids, "tokens": tokens}


def cache_features(
    cfg, model, tokenizer, conversations, shard_size: int = 64, progress: bool = True, log=None, engine=None
) -> dict:
    """Render, run the target, and write the shards that are not yet in the manifest. Returns the manifest.

    `engine`: (name, features(ids list, bar) -> [T, training_width] per conversation, start(longest, count)) where
    another engine than transformers computes the features (`model` may then be the target's shell); None: `model`
    run by transformers. `log` (default: the current sys.stderr, looked up per call) receives the size statement.
    """
    log = log if log is not None else sys.stderr
    folder = Path(cfg.features_dir)
    folder.mkdir(parents=True, exist_ok=True)
    identity = _identity(cfg, model.config)
    check_features_dir(folder)
    manifest = _resumable_manifest(folder, identity, shard_size, tokenizer, log)
    rendered, skipped = _render_all(cfg, tokenizer, conversations)
    dtype = _DTYPES[cfg.feature_dtype]
    spec = feature_spec(cfg, model.config)
    bytes_per_token = spec.training_width * torch.finfo(dtype).bits // 8 + 5  # features, int32 id, uint8 mask
    total_tokens = sum(r.input_ids.numel() for _, r in rendered)
    done = {s["index"] for s in manifest["shards"]}
    shards = [rendered[i : i + shard_size] for i in range(0, len(rendered), shard_size)]
    check_shards_match(folder, manifest["shards"], [[conv_id for conv_id, _ in shard] for shard in shards])
    todo = [k for k in range(len(shards)) if k not in done]
    print(
        f"features: {len(rendered):,} conversations ({skipped} skipped), {total_tokens:,} tokens, "
        f"about {total_tokens * bytes_per_token / 1e9:.2f} GB in {folder} ({len(shards)} shards, "
        f"{len(shards) - len(todo)} already done)",
        file=log,
    )
    engine_name, features, start = engine or ("hf", hf_training_features(model, spec), None)
    if start is not None and todo:  # (before the bar: an engine's start is not feature time)
        start(max(r.input_ids.numel() for k in todo for _, r in shards[k]), min(shard_size, len(rendered)))
    todo_tokens = sum(r.input_ids.numel() for k in todo for _, r in shards[k])
    bar = tqdm(total=todo_tokens, unit="tok", desc="features", disable=not progress)
    t0 = time.perf_counter()
    for k in todo:
        manifest["shards"].append(
            _write_shard(folder, k, *_shard_tensors(features, shards[k], dtype, bar), engine_name)
        )
        manifest["shards"].sort(key=lambda s: s["index"])
        write_json_atomic(folder / MANIFEST, manifest, indent=1)
    bar.close()
    # this run's feature time (an engine's start left out), for `eagletree features` to print
    manifest["last_run"] = {"engine": engine_name, "tokens": todo_tokens, "seconds": time.perf_counter() - t0}
    manifest["complete"] = len(manifest["shards"]) == len(shards)
    write_json_atomic(folder / MANIFEST, manifest, indent=1)
    return manifest


def _check_tokenizer(folder: Path, manifest: dict, fingerprint: str | None) -> None:
    """FeatureError when the cache's token ids were made by another tokenizer than `fingerprint`'s (None, or a
    cache from before fingerprints were recorded: not checked)."""
    cached = manifest.get("tokenizer")
    if fingerprint is not None and cached is not None and cached != fingerprint:
        raise FeatureError(
            f"{folder}: its token ids were made by tokenizer {cached}, not by this target's ({fingerprint}); "
            "cache the features with this target again, in another features_dir"
        )


class FeatureStore:
    """Read cached features by example index (shards opened lazily, one at a time)."""

    def __init__(self, folder, cfg, target_config, tokenizer=None):
        self.folder = Path(folder)
        manifest = load_manifest(self.folder)
        if manifest is None:
            raise FeatureError(f"{self.folder} has no {MANIFEST}; run `eagletree features --config ...` first")
        if manifest["identity"] != _identity(cfg, target_config):
            raise FeatureError(
                f"{self.folder} holds features for {manifest['identity']}, not for {_identity(cfg, target_config)}"
            )
        if not manifest.get("complete"):
            warnings.warn(
                f"{self.folder}: feature cache is incomplete; training on the {len(manifest['shards'])} "
                "finished shards",
                stacklevel=2,
            )
        _check_tokenizer(self.folder, manifest, None if tokenizer is None else tokenizer_fingerprint(tokenizer))
        self.vocab_size = target_config.vocab_size
        self.digests = {s["file"]: s.get("sha256") for s in manifest["shards"]}
        self.verified: set[str] = set()
        self.layers = tuple(manifest["identity"].get("layers", ())) or None  # the fused layers it holds
        self.index = [(s["file"], i) for s in manifest["shards"] for i in range(len(s["conversations"]))]
        self.ids = [conv_id for s in manifest["shards"] for conv_id in s["conversations"]]  # per example
        self._open: dict = {}  # shard file -> its open handle, the most recently read last

    def __len__(self) -> int:
        return len(self.index)

    def shard_groups(self, groups: int) -> list[list[int]]:
        """The examples dealt into `groups` groups by whole shards, each shard in turn to the group holding the fewest
        examples so far (ties: the lowest group); FeatureError when a group would get no shard, a warning when the
        groups' sizes differ by more than a tenth (a smaller group's conversations are trained on more often)."""
        sizes = Counter(name for name, _ in self.index)
        files = list(self.digests)
        if len(files) < groups:
            raise FeatureError(
                f"{self.folder} holds {len(files)} shards; {groups} feature groups (feature_groups, or one per "
                "process) need one each at least: cache the features in smaller shards (--shard-size) or use fewer"
            )
        held, group_of = [0] * groups, {}
        for name in files:
            group_of[name] = min(range(groups), key=lambda g: (held[g], g))
            held[group_of[name]] += sizes[name]
        if max(held) - min(held) > max(held) / 10:
            warnings.warn(
                f"{self.folder}: its shards make {groups} groups of {held} conversations; the smaller groups' are "
                "trained on more often (cache the features with a --shard-size that deals them out evenly)",
                stacklevel=2,
            )
        dealt: list[list[int]] = [[] for _ in range(groups)]
        for n, (name, _) in enumerate(self.index):
            dealt[group_of[name]].append(n)
        return dealt

    def __getitem__(self, n: int):
        """(ids [T] long, mask [T] bool, features [T, F] float32) of example n."""
        name, i = self.index[n]
        f = self._open.pop(name, None) or self._checked_open(name)
        self._open[name] = f  # training reads conversations shuffled, shard to shard: keep a few handles open
        if len(self._open) > OPEN_SHARDS:
            del self._open[next(iter(self._open))]
        ids, mask, hidden = (
            f.get_tensor(f"{i}.ids").long(),
            f.get_tensor(f"{i}.mask").bool(),
            f.get_tensor(f"{i}.hidden"),
        )
        if not ids.numel() == mask.numel() == hidden.shape[0] or (ids.numel() and int(ids.max()) >= self.vocab_size):
            raise FeatureError(
                f"{self.folder / name}: conversation {self.ids[n]!r} holds {ids.numel()} token ids (largest "
                f"{int(ids.max()) if ids.numel() else None}), {mask.numel()} mask entries and {hidden.shape[0]} "
                f"feature rows: expected as many of each, ids below the vocabulary's {self.vocab_size}"
            )
        return ids, mask, hidden.float()

    def _checked_open(self, name: str):
        """The shard opened, once its bytes have the checksum the manifest recorded (FeatureError otherwise)."""
        path, digest = self.folder / name, self.digests.get(name)
        if name not in self.verified:  # once per shard: training reads conversations shuffled, shard to shard
            if not path.is_file() or (digest is not None and shard_digest(path) != digest):
                raise FeatureError(
                    f"{path} is missing or damaged (its bytes no longer match the manifest's sha256); run "
                    "`eagletree features` with the same config again: it writes the damaged shards anew"
                )
            self.verified.add(name)
        return safe_open(str(path), framework="pt")

"""What a run trains on: its conversations (or cached features) in a fixed order, and a fingerprint of them."""

from __future__ import annotations

import hashlib

import torch

from .config import TrainConfig, TrainingError
from .data import load_training_data, split
from .features import FeatureStore
from .render import RenderError, render_item


class Stream:
    """Deterministic conversation order: a fresh permutation per epoch; position = micro-batch index."""

    def __init__(self, conversations, seed: int):
        self.conversations, self.seed = conversations, seed
        self._perm_epoch, self._perm = -1, None

    def __getitem__(self, index: int):
        epoch, i = divmod(index, len(self.conversations))
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.conversations), generator=g), epoch
        return self.conversations[int(self._perm[i])]


class GroupStream:
    """Cached features in shard groups: micro-batch b (stream positions b x micro_batch onwards) reads group b mod N,
    taking that group's conversations in an order of its own (a `Stream` per group). A run of N processes (or a
    multiple of N) has process r read micro-batches r, r + N, ...: only group r's shards."""

    def __init__(self, groups: list[list[int]], seed: int, micro_batch: int):
        self.groups = [Stream(items, seed * 7_919 + g) for g, items in enumerate(groups)]
        self.micro_batch = micro_batch
        self.conversations = [i for items in groups for i in items]

    def __getitem__(self, position: int):
        batch, within = divmod(position, self.micro_batch)
        group, nth = batch % len(self.groups), batch // len(self.groups)
        return self.groups[group][nth * self.micro_batch + within]

    def sample(self, count: int, rank: int = 0, world: int = 1) -> list:
        """The first conversations of each group, `count` in all shared out evenly, of the groups process `rank` of
        `world` reads (groups rank, rank + world, ...): what it counts toward the draft vocabulary, the processes'
        counts summed making the same count as one process's over every group."""
        share, extra = divmod(count, len(self.groups))
        picked = []
        for g in range(rank, len(self.groups), world):
            stream = self.groups[g]
            picked += [stream[i] for i in range(min(share + (g < extra), len(stream.conversations)))]
        return picked


def training_conversations(cfg: TrainConfig):
    """The training side of the held-out split, cut to max_conversations. What was recovered or skipped reading a
    data file is warned about; the shipped ShareGPT file's known cut is not."""
    train_convs, _ = split(load_training_data(cfg.dataset), cfg.heldout_fraction)
    return train_convs[: cfg.max_conversations] if cfg.max_conversations else train_convs


def training_stream(
    cfg: TrainConfig, target_config, conversations, tokenizer=None, processes: int = 1
) -> tuple[FeatureStore | None, Stream | GroupStream]:
    """(feature store or None, stream): a run's items in training order, the cached features' indices when
    `features_dir` is set (their token ids checked to be `tokenizer`'s; in `feature_groups` shard groups, by default
    one per process: `GroupStream`), else `conversations`. TrainingError when there is nothing to train on."""
    store = None
    if cfg.features_dir:
        store = FeatureStore(cfg.features_dir, cfg, target_config, tokenizer)
        items = list(range(len(store)))
    else:
        items = conversations
    if not items:
        raise TrainingError(
            f"dataset {cfg.dataset!r} has no training conversations (heldout_fraction="
            f"{cfg.heldout_fraction}, max_conversations={cfg.max_conversations})"
        )
    if store is None and not has_assistant_text(items):
        raise TrainingError(
            f"dataset {cfg.dataset!r}: none of its {len(items)} training conversations has an "
            "assistant turn with text; the head learns from assistant tokens, so there is nothing to "
            "train on"
        )
    groups = cfg.feature_groups or processes
    if cfg.feature_groups and store is None:
        raise TrainingError(f"feature_groups={cfg.feature_groups} deals a feature cache's shards; set features_dir too")
    if groups % processes:
        raise TrainingError(
            f"feature_groups={groups} with {processes} processes: each would read every group's shards; use a "
            f"multiple of {processes} (or 0: one group per process)"
        )
    if store is not None and groups > 1:
        return store, GroupStream(store.shard_groups(groups), cfg.seed, cfg.micro_batch)
    return store, Stream(items, cfg.seed)


def data_fingerprint(items, store=None, stream=None) -> dict:
    """What a run trains on, for a resume to compare: the number of training conversations and a hash of their ids
    in order (None when the items have no ids, e.g. pre-tokenized records), and the shard groups a `GroupStream`
    reads them in."""
    ids = store.ids if store is not None else [getattr(item, "id", None) for item in items]
    digest = None if any(i is None for i in ids) else hashlib.sha256("\n".join(map(str, ids)).encode()).hexdigest()[:16]
    groups = {"groups": len(stream.groups)} if isinstance(stream, GroupStream) else {}
    return {"conversations": len(ids), "ids": digest, **groups}


def has_assistant_text(conversations) -> bool:
    """Whether some conversation has an assistant turn with text and not of weight 0 (the loss is on those tokens);
    items that are not chat conversations are taken as trainable."""
    for conv in conversations:
        messages = getattr(conv, "messages", None)
        if messages is None:
            return True
        if any(
            m.get("role") == "assistant" and m.get("weight", 1) != 0 and str(m.get("content") or "").strip()
            for m in messages
        ):
            return True
    return False


def assistant_tokens(tok, stream: Stream | GroupStream, cfg: TrainConfig, store=None, rank: int = 0, world: int = 1):
    """Assistant tokens of the first conversations in training order (to pick the draft vocabulary); from shard
    groups, the share of process `rank` of `world`, read from its own groups only (`GroupStream.sample`; every
    process reads the same conversations otherwise)."""
    if isinstance(stream, GroupStream):
        items = stream.sample(cfg.draft_vocab_sample, rank, world)
    else:
        items = [stream[i] for i in range(min(cfg.draft_vocab_sample, len(stream.conversations)))]
    for item in items:
        if store is not None:
            ids, mask, _ = store[item]
            yield ids[mask].tolist()
            continue
        try:
            r = render_item(tok, item, cfg.max_len)
        except RenderError:
            continue
        yield r.input_ids[r.loss_mask].tolist()


def special_ids(tok) -> list[int]:
    """The tokenizer's eos, bos and pad ids: always in the draft vocabulary."""
    ids = [tok.eos_token_id, tok.bos_token_id, tok.pad_token_id]
    return [i for i in ids if i is not None]

"""A feature cache's integrity: shard checksums, the tokenizer that made its ids, and records checked on read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagletree.train.config import TrainConfig, TrainingError
from eagletree.train.features import FeatureError, FeatureStore, cache_features, shard_digest

from helpers import tiny_conversations, tiny_model, tiny_tokenizer


def cached(tmp_path, shard_size=3):
    model, tok, convs = tiny_model("llama"), tiny_tokenizer(), tiny_conversations(7)
    cfg = TrainConfig(
        out_dir=str(tmp_path / "run"), features_dir=str(tmp_path / "feats"), feature_dtype="fp32", max_len=40
    )
    manifest = cache_features(cfg, model, tok, convs, shard_size=shard_size, progress=False)
    return cfg, model, tok, convs, manifest


def read_all(store: FeatureStore) -> list:
    return [store[n] for n in range(len(store))]


def test_every_shard_carries_its_checksum_and_a_damaged_one_is_refused_then_written_again(tmp_path):
    cfg, model, tok, convs, manifest = cached(tmp_path)
    folder = tmp_path / "feats"
    assert all(s["sha256"] == shard_digest(folder / s["file"]) for s in manifest["shards"])
    want = read_all(FeatureStore(folder, cfg, model.config, tok))
    shard = folder / manifest["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in a feature value
    shard.write_bytes(bytes(data))
    store = FeatureStore(folder, cfg, model.config, tok)
    store[0]  # shard 0 is intact
    with pytest.raises(
        FeatureError, match=r"shard-00001.safetensors is missing or damaged .* run `eagletree features`"
    ):
        read_all(store)
    untouched = (folder / manifest["shards"][0]["file"]).stat().st_mtime_ns
    cache_features(cfg, model, tok, convs, shard_size=3, progress=False)  # writes shard 1 again, alone
    assert (folder / manifest["shards"][0]["file"]).stat().st_mtime_ns == untouched
    for (a_ids, a_mask, a_feats), (b_ids, b_mask, b_feats) in zip(
        read_all(FeatureStore(folder, cfg, model.config)), want
    ):
        assert torch.equal(a_ids, b_ids) and torch.equal(a_mask, b_mask) and torch.equal(a_feats, b_feats)


def test_ids_made_by_another_tokenizer_are_refused(tmp_path):
    cfg, model, tok, convs, _ = cached(tmp_path)
    other = tiny_tokenizer()
    other.chat_template = other.chat_template.replace("<|assistant|>", "<|assistant|> ")
    with pytest.raises(FeatureError, match="its token ids were made by tokenizer .*, not by this target's"):
        FeatureStore(tmp_path / "feats", cfg, model.config, other)
    with pytest.raises(FeatureError, match="its token ids were made by tokenizer"):
        cache_features(cfg, model, other, convs, shard_size=3, progress=False)


def test_a_record_whose_ids_and_features_disagree_is_refused_on_read(tmp_path):
    cfg, model, tok, _, manifest = cached(tmp_path)
    folder = tmp_path / "feats"
    entry = manifest["shards"][0]
    width = FeatureStore(folder, cfg, model.config)[0][2].shape[1]
    tensors = {  # one id short of its features (a generator that dropped a token, say)
        "0.ids": torch.arange(4, dtype=torch.int32),
        "0.mask": torch.ones(5, dtype=torch.uint8),
        "0.hidden": torch.zeros(5, width),
    }
    save_file(tensors, folder / entry["file"])
    entry["sha256"] = shard_digest(folder / entry["file"])
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FeatureError, match="holds 4 token ids .* 5 mask entries and 5 feature rows: expected as many"):
        FeatureStore(folder, cfg, model.config, tok)[0]


def test_shard_groups_give_each_process_only_its_own_shards(tmp_path):
    """feature_groups N: micro-batch b reads group b mod N (shard i in group i mod N), so process r of N, which takes
    micro-batches r, r + N, ..., opens only group r's shards; one process with N groups reads the same micro-batches
    in the same order, interleaved."""
    from eagletree.train.inputs import GroupStream, training_stream

    cfg, model, tok, convs, manifest = cached(tmp_path, shard_size=2)  # 7 conversations: 4 shards
    store = FeatureStore(tmp_path / "feats", cfg, model.config, tok)
    with pytest.warns(UserWarning, match=r"its shards make 2 groups of \[4, 3\] conversations; the smaller"):
        groups = store.shard_groups(2)
    shard_of = {n: name for n, (name, _) in enumerate(store.index)}
    files = [s["file"] for s in manifest["shards"]]
    assert [{shard_of[n] for n in g} for g in groups] == [{files[0], files[2]}, {files[1], files[3]}]
    micro, accum, world = 2, 3, 2
    with pytest.warns(UserWarning, match="smaller groups"):
        _, stream = training_stream(TrainConfig(**{**cfg.__dict__, "micro_batch": micro}), model.config, convs, tok, 2)
    assert isinstance(stream, GroupStream) and sorted(stream.conversations) == list(range(7))
    for rank in range(world):  # the positions the Stepper gives process `rank` (train/step.py)
        read = [
            stream[((step * accum + m) * world + rank) * micro + j]
            for step in range(8)
            for m in range(accum)
            for j in range(micro)
        ]
        assert set(read) == set(groups[rank])  # every conversation of its group, none of another
        group = read[: len(groups[rank])]
        assert sorted(group) == sorted(groups[rank])  # an epoch of its group before any repeat
    one = GroupStream(groups, cfg.seed, micro)
    assert [one[p] for p in range(40)] == [stream[p] for p in range(40)]
    with pytest.raises(FeatureError, match=r"holds 4 shards; 5 feature groups .* need one each at least"):
        store.shard_groups(5)
    with pytest.warns(UserWarning, match="smaller groups"):
        sizes = [len(g) for g in store.shard_groups(3)]  # each shard in turn to the group holding fewest
    assert sizes == [3, 2, 2]
    with pytest.raises(TrainingError, match=r"feature_groups=3 with 2 processes: each would read every group"):
        training_stream(TrainConfig(**{**cfg.__dict__, "feature_groups": 3}), model.config, convs, tok, 2)
    with pytest.raises(TrainingError, match=r"feature_groups=2 deals a feature cache's shards; set features_dir"):
        training_stream(TrainConfig(feature_groups=2), model.config, convs, tok, 2)


def test_the_draft_vocabulary_from_shard_groups_counts_each_group_once(tmp_path):
    """Process r counts its own groups' share of the sample; the counts summed equal one process's over all groups."""
    from eagletree.draft.vocab import token_counts
    from eagletree.train.inputs import assistant_tokens, training_stream

    cfg, model, tok, convs, _ = cached(tmp_path, shard_size=2)
    cfg = TrainConfig(**{**cfg.__dict__, "feature_groups": 4, "draft_vocab_sample": 5})
    with pytest.warns(UserWarning, match="smaller groups"):  # (the short last shard: a group of 1 conversation)
        store, stream = training_stream(cfg, model.config, convs, tok, 1)
    vocab = model.config.vocab_size
    whole = token_counts(assistant_tokens(tok, stream, cfg, store), vocab)
    parts = [token_counts(assistant_tokens(tok, stream, cfg, store, rank, 2), vocab) for rank in (0, 1)]
    assert torch.equal(parts[0] + parts[1], whole) and int(whole.sum()) > 0
    for rank in (0, 1):  # each process opened only its own groups' shards
        store = FeatureStore(tmp_path / "feats", cfg, model.config, tok)
        list(assistant_tokens(tok, stream, cfg, store, rank, 2))
        assert {int(name[6:11]) % 2 for name in store.verified} == {rank}


def test_a_resume_in_other_shard_groups_is_refused_naming_them(tmp_path):
    from test_train import run, tiny_cfg

    feats = tmp_path / "feats"
    cfg = tiny_cfg(tmp_path / "run", steps=4, stop_after=2, features_dir=str(feats), feature_dtype="fp32")
    cache_features(cfg, tiny_model("llama"), tiny_tokenizer(), tiny_conversations(12), shard_size=3, progress=False)
    run(cfg)
    with pytest.raises(
        TrainingError, match=r"read in 1 shard group and would be read in 2 shard groups .*set feature_groups=1 to"
    ):
        run(tiny_cfg(tmp_path / "run", steps=4, features_dir=str(feats), feature_dtype="fp32", feature_groups=2), True)

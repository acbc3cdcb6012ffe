"""The target without its layers (target/shell.py): what training from cached features loads, and nothing else."""

from __future__ import annotations

import json

import pytest
import torch

from eagletree.target import TargetError
from eagletree.target.shell import TargetShell, load_target_shell
from eagletree.train.config import TrainConfig
from eagletree.train.features import cache_features
from eagletree.train.loop import train

from helpers import tiny_conversations, tiny_model, tiny_tokenizer


def saved_target(folder, kind="llama", tied=False, shard_bytes=None):
    """A tiny target saved as an HF folder (safetensors; several files and an index below `shard_bytes`)."""
    model, tok = tiny_model(kind), tiny_tokenizer()
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.get_input_embeddings().weight
    model.save_pretrained(folder, **({"max_shard_size": shard_bytes} if shard_bytes else {}))
    tok.save_pretrained(folder)
    return model, tok


@pytest.mark.parametrize("kind, tied, shard_bytes", [("llama", False, None), ("qwen2", True, 20_000)])
def test_the_shell_holds_the_target_s_embedding_final_norm_and_lm_head_alone(tmp_path, kind, tied, shard_bytes):
    model, _ = saved_target(tmp_path / "target", kind, tied, shard_bytes)
    assert (tmp_path / "target" / "model.safetensors.index.json").is_file() == bool(shard_bytes)
    shell, tok = load_target_shell(tmp_path / "target", device="cpu")
    assert isinstance(shell, TargetShell) and tok.convert_tokens_to_ids("<|assistant|>") == 3
    assert shell.config.num_hidden_layers == model.config.num_hidden_layers  # the target's own config
    assert torch.equal(shell.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert torch.equal(shell.get_output_embeddings().weight, model.get_output_embeddings().weight)
    assert torch.equal(shell.get_decoder().norm.weight, model.get_decoder().norm.weight)
    x = torch.randn(3, model.config.hidden_size)
    assert torch.equal(shell.get_decoder().norm(x), model.get_decoder().norm(x))  # the model's own norm module
    assert (shell.get_output_embeddings().weight is shell.get_input_embeddings().weight) == tied
    layers = sum(p.numel() for p in model.model.layers.parameters())
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in shell.parameters()) >= layers
    assert not any(p.requires_grad for p in shell.parameters())
    with pytest.raises(TargetError, match="decoder layers are not loaded"):
        shell(torch.zeros(1, 1, dtype=torch.long))


def test_a_folder_without_the_tensors_says_which(tmp_path):
    saved_target(tmp_path / "target")
    (tmp_path / "target" / "model.safetensors").unlink()
    with pytest.raises(TargetError, match="has no safetensors weights"):
        load_target_shell(tmp_path / "target", device="cpu")


@pytest.mark.parametrize("head_type", ["eagle", "eagle3", "dflash"])
def test_training_from_cached_features_loads_no_layer_and_trains_the_same_head(tmp_path, head_type, monkeypatch):
    """train() on a features_dir loads the target's shell, never its layers, and trains the head the whole target
    trains from the same cache, weight for weight."""
    model, tok = saved_target(tmp_path / "target")
    convs = tiny_conversations(8)
    dataset = tmp_path / "data.jsonl"
    dataset.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in convs))
    base = dict(
        target=str(tmp_path / "target"),
        dataset=str(dataset),
        features_dir=str(tmp_path / "feats"),
        feature_dtype="fp32",
        head_type=head_type,
        report_to="none",
        steps=3,
        grad_accum=2,
        save_every=3,
        warmup_steps=1,
        max_len=40,
        lr=1e-3,
        device="cpu",
        precision="fp32",
    )
    cache_features(TrainConfig(**base, out_dir=str(tmp_path / "x")), model, tok, convs, progress=False)
    whole, _ = train(
        TrainConfig(**base, out_dir=str(tmp_path / "whole")), model_and_tokenizer=(model, tok), progress=False
    )

    def refuse(*args, **kwargs):
        raise AssertionError("training from cached features loaded the whole target")

    monkeypatch.setattr("eagletree.train.loop.load_target", refuse)
    shell_trained, _ = train(TrainConfig(**base, out_dir=str(tmp_path / "shell")), progress=False)
    for (name, a), (_, b) in zip(whole.state_dict().items(), shell_trained.state_dict().items()):
        assert torch.equal(a, b), name

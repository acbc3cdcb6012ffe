"""The block (DFlash-style) head: its drafter against its training forward, its objective, training (online,
offline, resumed) and lossless decoding with every search, batched and sampled."""

import json

import pytest
import torch

from eagletree.decode import Decoder, decode_steps, generate
from eagletree.decode.config import DecodeConfig
from eagletree.draft import DFlashHead, HeadError, load_head
from eagletree.draft.block_drafter import BlockDrafter
from eagletree.draft.dflash import default_context_layers
from eagletree.draft.objectives import block_anchors, block_weights
from eagletree.train.config import TrainConfig, TrainingError
from eagletree.train.loop import train

from helpers import (
    chi_square_p,
    eight_token_model,
    first_two_probs,
    small_block_head,
    tiny_conversations,
    tiny_model,
    tiny_tokenizer,
)


def test_context_layers_follow_the_anchors_rule():
    assert default_context_layers(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B's DFlash drafter reads these
    assert default_context_layers(30, 3) == [1, 14, 27]
    assert default_context_layers(32, 1) == [16]
    assert default_context_layers(2, 3) == [0, 0, 0]  # a tiny target: within its layers
    w = block_weights(8, 0.0)
    assert w.shape == (7,) and w[0] == 1.0 and torch.all(w[1:] < w[:-1])
    assert block_weights(16, 0.0)[7].item() == pytest.approx(torch.exp(torch.tensor(-1.0)).item())  # gamma 7


def test_the_drafter_commits_in_pieces_and_batches_what_training_computes_at_once(tiny):
    """A block drafted after committing positions in pieces (one row or several in one call) equals the
    training forward's block at the same anchor, where every anchor's block is computed in one call."""
    model = tiny
    head = small_block_head(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (24,), generator=g)
    h = head.config.hidden_size
    layers = head.feature_spec.training_features(model, ids)[:, h:]
    anchors = torch.tensor([3, 9, 22])
    trained = head(layers, ids, anchors, model.get_input_embeddings())  # [3, k, H]
    lm = model.get_output_embeddings().weight
    want = torch.softmax(torch.nn.functional.linear(trained[:, 1:], lm).float(), -1)  # [3, k-1, V]
    batch = head.make_batch_drafter(model)
    rows = [batch.add_row() for _ in anchors]
    halves, ends = [a // 2 for a in anchors.tolist()], anchors.tolist()
    # two catch-ups, rows of different lengths in one call: the first halves, then the rest
    batch.extend(rows, [layers[:c] for c in halves], [ids[1 : c + 1] for c in halves])
    batch.extend(rows, [layers[c:e] for c, e in zip(halves, ends)], [ids[c + 1 : e + 1] for c, e in zip(halves, ends)])
    for row in rows:
        level = batch.expand([(row, torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([0, 0]), 1)])[0]
        assert level.shape == (2, want.shape[-1])  # every node of a level: the same distribution
        got = torch.stack([batch.expand([(row, torch.tensor([1]), None, None, L)])[0][0] for L in range(1, 8)])
        torch.testing.assert_close(got, want[row], rtol=1e-4, atol=1e-6)
    single = head.make_drafter(model)
    probs = single.extend(layers[:9], ids[1:10])
    torch.testing.assert_close(probs, want[1, 0], rtol=1e-4, atol=1e-6)
    with pytest.raises(HeadError, match="block_size 8 drafts 7 levels; cannot draft level 8"):
        single(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), 8)


def test_blocks_trained_together_see_only_their_own_block_and_the_context_before_it():
    model = tiny_model("llama")
    head = small_block_head(model, block_size=4)
    ids = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    layers = head.feature_spec.training_features(model, ids)[:, head.config.hidden_size :]
    embed = model.get_input_embeddings()
    together = head(layers, ids, torch.tensor([2, 5, 20]), embed)
    for i, a in enumerate([2, 5, 20]):
        alone = head(layers, ids, torch.tensor([a]), embed)[0]
        torch.testing.assert_close(together[i], alone, rtol=1e-5, atol=1e-6)
    # anchors: drawn where the next token is an assistant token, at most `count`, ascending
    mask = torch.zeros(30, dtype=torch.bool)
    mask[10:20] = True
    drawn = block_anchors(mask, 4, torch.Generator().manual_seed(0))
    assert drawn.numel() == 4 and torch.all(drawn[1:] > drawn[:-1]) and torch.all(mask[drawn + 1])
    assert block_anchors(mask, 50).tolist() == list(range(9, 19))


def tiny_run(tmp_path, name, **changes) -> TrainConfig:
    cfg = TrainConfig(
        head_type="dflash",
        block_size=4,
        block_anchors=4,
        out_dir=str(tmp_path / name),
        report_to="none",
        steps=6,
        grad_accum=2,
        save_every=2,
        warmup_steps=1,
        max_len=40,
        lr=1e-3,
        device="cpu",
        precision="fp32",
    )
    for key, value in changes.items():
        setattr(cfg, key, value)
    return cfg


def test_a_block_head_trains_online_offline_and_resumed_to_the_same_weights(tmp_path):
    from eagletree.train.features import cache_features

    model, tok, convs = tiny_model("llama"), tiny_tokenizer(), tiny_conversations(8)
    data = dict(model_and_tokenizer=(model, tok), progress=False)
    straight, summary = train(tiny_run(tmp_path, "a"), conversations=convs, **data)
    assert summary["steps"] == 6 and type(straight) is DFlashHead
    train(tiny_run(tmp_path, "b", stop_after=2), conversations=convs, **data)
    resumed, _ = train(tiny_run(tmp_path, "b"), conversations=convs, resume=True, **data)
    offline_cfg = tiny_run(tmp_path, "c", features_dir=str(tmp_path / "f"), feature_dtype="fp32")
    manifest = cache_features(offline_cfg, model, tok, convs, shard_size=4, progress=False)
    assert manifest["identity"]["layers"] == list(straight.feature_spec.layers)
    offline, _ = train(offline_cfg, **data)
    for (name, a), (_, b), (_, c) in zip(*(h.state_dict().items() for h in (straight, resumed, offline))):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6, msg=name)
    head = load_head(tmp_path / "a" / "head", target_config=model.config)
    assert head.block_size == 4 and head.drafting.max_depth == 3 and head.drafting.calls(4) == 1
    history = [json.loads(line) for line in (tmp_path / "a" / "history.jsonl").read_text().splitlines()]
    assert all(r["loss"] > 0 for r in history)


def test_block_head_keys_are_checked_and_other_heads_refuse_them(tmp_path):
    with pytest.raises(
        TrainingError, match=r"block_size=4: has no effect on 'eagle' heads \(block_size is a key of 'dflash' heads\)"
    ):
        TrainConfig.from_sources(None, ["block_size=4"])
    with pytest.raises(TrainingError, match="'block_size' must be >= 2, got 1"):
        TrainConfig.from_sources(None, ["head_type=dflash", "block_size=1"])
    with pytest.raises(TrainingError, match=r"ttt_steps=2: has no effect on 'dflash' heads \(it ignores"):
        TrainConfig.from_sources(None, ["head_type=dflash", "ttt_steps=2"])
    model = tiny_model("llama")
    with pytest.raises(HeadError, match=r"mask_token_id must be a token id in \[0, 97\), got 500"):
        DFlashHead.for_target(model, mask_token_id=500)
    head = DFlashHead.for_target(model)
    head.save_pretrained(tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    config["extra"]["block_size"] = 1
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadError, match="block_size must be an integer >= 2"):
        load_head(tmp_path / "h")


@pytest.mark.parametrize("tree", ["eagle2", "optimal", "auto", "chain"])
def test_block_trees_are_lossless_with_every_search_and_copies(tree):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = small_block_head(model, block_size=5)
    prompts = [[4, 9, 16, 25, 36], [5, 6, 5, 6, 5, 6, 5], [7]]
    plain = Decoder(model, tok, None, DecodeConfig.from_options(max_new_tokens=20, copy=False))
    want = [r.token_ids for r in plain.generate_batch(prompts)]
    for copy in (False, True) if tree != "chain" else (False,):  # (copies go into searched trees)
        config = DecodeConfig.from_options(max_new_tokens=20, copy=copy, tree=tree, budget=12, depth=4)
        drafted = Decoder(model, tok, head, config)
        assert [r.token_ids for r in drafted.generate_batch(prompts, batch_size=3)] == want
        assert [drafted.generate(p).token_ids for p in prompts] == want


def test_a_trained_block_head_drafts_tokens_the_target_accepts():
    """Trained on the target's own continuations of a few prompts, a block head's trees for one of them are
    accepted far beyond the root (an untrained head's are not): what training learns is what the drafter drafts."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the target's greedy continuations: what its head has to draft
        texts = [
            model.generate(torch.randint(3, 97, (1, 6), generator=g), max_new_tokens=30, do_sample=False)[0]
            for _ in range(4)
        ]
    with torch.no_grad():  # a confident target: its greedy text is no string of near-ties
        model.get_output_embeddings().weight.mul_(6)
    torch.manual_seed(0)
    head = DFlashHead.for_target(model, block_size=4)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    lm = (model.get_output_embeddings().weight.detach(), None)
    cfg = TrainConfig(head_type="dflash", block_size=4, block_anchors=16, noise=0.0)
    untrained = generate(model, tok, head.eval(), texts[0][:6], max_new_tokens=30, tree="eagle2", budget=8, depth=3)
    head.train()
    for step in range(300):
        ids = texts[step % len(texts)]
        feats = head.feature_spec.training_features(model, ids).detach()
        mask = torch.ones_like(ids, dtype=torch.bool)
        loss, parts = head.training_loss(head, lm, model.get_input_embeddings(), feats, ids, mask, cfg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    head.eval()
    result = generate(model, tok, head, texts[0][:6], max_new_tokens=30, tree="eagle2", budget=8, depth=3)
    assert result.token_ids == texts[0][6:].tolist()
    assert result.stats.tokens_per_pass > 2.0 > untrained.stats.tokens_per_pass


@pytest.mark.real  # 2,000 sampled runs (about 15 s): the full run only
def test_sampling_with_a_block_head_keeps_the_targets_distribution():
    """Chi-square on the first two tokens of full sampled runs (a tiny 8-token target, a random block head)."""

    model = eight_token_model()
    head = DFlashHead.for_target(model, block_size=3).eval()
    prompt, sampling, draws = torch.tensor([1, 6, 3, 1, 6]), dict(temperature=0.8, top_p=0.9), 2000
    pairs = torch.zeros(8, 8)
    for i in range(draws):
        steps = decode_steps(
            model,
            None,
            head,
            prompt,
            max_new_tokens=2,
            tree="eagle2",
            budget=6,
            depth=2,
            top_k_draft=3,
            seed=i,
            copy=False,
            **sampling,
        )
        a, b = [t for step in steps for t in step]
        pairs[a, b] += 1
    p1, p2 = first_two_probs(model, prompt, **sampling)
    assert chi_square_p(pairs, p1[:, None] * p2) > 0.01
    assert chi_square_p(pairs.sum(1), p1) > 0.01


def test_auto_charges_a_block_heads_one_call_a_step_as_timed():
    """A block head's levels make no call, so auto charges its step the catch-up's measured seconds (a running
    mean), not a level's cost; a level-drafting head's catch-up stays counted as one more level."""
    from eagletree.draft import Drafting
    from eagletree.search.cost import LatencyProfile
    from eagletree.search.searchers import make_searcher

    model = tiny_model("llama")
    block = make_searcher("auto", profile=LatencyProfile([1, 64], [0.01, 0.012]))
    block.set_drafting(small_block_head(model).drafting)
    block.start()
    assert block.times_step_calls and block.catch_up_s is None
    block.observe_catch_up(0.004)
    block.observe_catch_up(0.009)
    assert block.catch_up_s == pytest.approx(0.004 + 0.2 * 0.005)
    level = make_searcher("auto", profile=LatencyProfile([1, 64], [0.01, 0.012], draft_s_per_step=0.002))
    level.set_drafting(Drafting())
    level.start()
    level.observe_catch_up(1.0)
    assert not level.times_step_calls and level.catch_up_s == 0.002  # (the profile's, never timed here)


def test_the_dflash_export_is_a_qwen3_drafter_checkpoint_and_imports_back(tmp_path):
    """The export's config is a Qwen3 config transformers reads, and its weights are named and shaped as Qwen3
    decoder layers' (the published drafter's layers are Qwen3 layers with another attention forward), plus fc,
    hidden_norm and norm; importing it gives the same head back, its draft vocabulary from token_map.pt."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from eagletree.export.convert import export_head, import_folder

    model = tiny_model("llama")
    head = DFlashHead.for_target(model, torch.arange(5, 97, 2), block_size=4, num_layers=2).eval()
    out = export_head(head, tmp_path / "x", "dflash", dtype=torch.float32, target=model)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "qwen3" and config.num_hidden_layers == 2
    assert config.dflash_config == {"block_size": 4, "target_layer_ids": [0, 0, 0], "mask_token_id": 0}
    state = load_file(str(out / "model.safetensors"))
    h = model.config.hidden_size
    want = {"fc.weight": (h, 3 * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(2):
        layer = Qwen3DecoderLayer(config, i)
        want |= {f"layers.{i}.{k}": tuple(v.shape) for k, v in layer.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    back = import_folder(out, model.config)
    assert torch.equal(back.d2t, head.d2t) and back.block_size == 4
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_a_batch_drafts_with_one_block_call_a_step(monkeypatch):
    """Three sequences decoded together: the head runs its block once per pass for all of them (never per row)."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = small_block_head(model, block_size=4)
    calls = []
    probs = BlockDrafter._probs  # once per head call: the blocks' distributions
    monkeypatch.setattr(BlockDrafter, "_probs", lambda self, out: calls.append(out.shape[0]) or probs(self, out))
    config = DecodeConfig.from_options(max_new_tokens=16, copy=False, tree="eagle2", budget=8, depth=3)
    results = Decoder(model, tok, head, config).generate_batch([[4, 9, 16], [5, 6, 5, 6], [7, 8]], batch_size=3)
    assert calls and max(calls) == 3  # rows in one call
    assert len(calls) <= max(r.stats.passes for r in results)

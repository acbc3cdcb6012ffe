import pytest
import torch

from eagletree.decode import generate
from eagletree.draft import Eagle3Head, TreeDrafter, load_head
from eagletree.search import optimal_search

from helpers import tiny_tokenizer


def four_layer_llama():
    from transformers import AutoModelForCausalLM

    from helpers import tiny_config

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 4
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_eagle3_head_shapes_and_init():
    model = four_layer_llama()
    head = Eagle3Head.for_target(model, torch.arange(0, 97, 2))
    h = model.config.hidden_size
    assert head.fused_layers == [1, 1, 0]  # outputs of layers 1, L/2-1, L-4 = inputs of layers 2, L/2, L-3
    assert head.fc.weight.shape == (h, 3 * h) and head.lm_head.weight.shape == (49, h)
    assert head.layer.self_attn.q_proj.weight.shape[1] == 2 * h
    assert torch.equal(head.lm_head.weight, model.lm_head.weight[::2])
    with pytest.raises(ValueError, match="fused_layers must be 3"):
        Eagle3Head.for_target(model, fused_layers=[0, 1, 3])


def test_eagle3_generation_is_lossless_and_round_trips(tmp_path):
    model, tok = four_layer_llama(), tiny_tokenizer()
    head = Eagle3Head.for_target(model, torch.arange(60)).eval()
    ids = torch.tensor([5, 17, 3, 44, 2, 9])
    with torch.no_grad():
        ref = model.generate(
            ids[None], attention_mask=torch.ones(1, 6, dtype=torch.long), max_new_tokens=30, do_sample=False
        )[0, 6:].tolist()
    for tree in ("eagle2", "optimal"):
        assert (
            generate(model, tok, head, ids, max_new_tokens=30, tree=tree, budget=12, depth=4, top_k_draft=3).token_ids
            == ref
        )
    head.save_pretrained(tmp_path / "h")
    back = load_head(tmp_path / "h", target_config=model.config)
    assert isinstance(back, Eagle3Head) and back.fused_layers == head.fused_layers
    x, t = torch.randn(1, 5, 64), torch.randint(97, (1, 5))
    with torch.no_grad():
        assert torch.equal(
            back(x, t, torch.arange(5), model.get_input_embeddings()),
            head(x, t, torch.arange(5), model.get_input_embeddings()),
        )


def test_eagle3_tree_call_equals_each_path_alone():
    model = four_layer_llama()
    head = Eagle3Head.for_target(model, torch.arange(70)).eval()
    g = torch.Generator().manual_seed(0)
    feats, toks = torch.randn(6, 3 * 64, generator=g), torch.randint(97, (6,), generator=g)
    drafter = TreeDrafter(head, model)
    drafter.extend(feats, toks)
    seen = {}

    def recording(nodes, tokens, parents, level):
        probs = drafter(nodes, tokens, parents, level)
        seen.update({v: row for v, row in zip(nodes.tolist(), probs)})
        return probs

    tree = optimal_search(recording, int(toks[-1]), budget=16, depth=3, top_k=3, token_map=drafter.token_map)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        for v in range(len(tree)):
            if tree.node_ids[v] not in seen:
                continue
            h, t = head.fuse(feats), toks
            out = head(h[None], t[None], torch.arange(t.numel()), embed)[0]
            for token in tree.tokens[tree.path_to(v)[1:]].tolist():
                h, t = torch.cat([h, out[-1:]]), torch.cat([t, torch.tensor([token])])
                out = head(h[None], t[None], torch.arange(t.numel()), embed)[0]
            ref = torch.softmax(head.draft_logits(out[-1]), -1)
            assert torch.allclose(seen[tree.node_ids[v]], ref, atol=1e-4), v


def test_ttt_mask_matches_inference_visibility():
    from eagletree.draft.objectives import ttt_mask

    m = ttt_mask(5, 3)
    # step 3 at position 4 drafts from start 2: context positions 0..2 (step 1), its chain at 3 (step 2) and 4 (step 3)
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert ttt_mask(4, 1).equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_eagle3_training_time_test_reduces_the_loss(tmp_path):
    from eagletree.train.loop import TrainConfig, train

    from helpers import tiny_conversations

    cfg = TrainConfig(
        out_dir=str(tmp_path),
        report_to="none",
        steps=30,
        grad_accum=2,
        save_every=30,
        warmup_steps=2,
        max_len=40,
        lr=3e-3,
        device="cpu",
        head_type="eagle3",
        draft_vocab=40,
        ttt_steps=3,
    )
    head, _ = train(
        cfg,
        model_and_tokenizer=(four_layer_llama(), tiny_tokenizer()),
        conversations=tiny_conversations(12),
        progress=False,
    )
    losses = [
        float(line.split('"loss": ')[1].split(",")[0]) for line in (tmp_path / "history.jsonl").read_text().splitlines()
    ]
    assert isinstance(head, Eagle3Head) and sum(losses[-5:]) < 0.8 * sum(losses[:5])


def test_eagle3_export_layout_and_import(tmp_path):
    import json

    from safetensors.torch import load_file

    from eagletree.export.convert import export_head
    from eagletree.export.eagle3 import import_eagle3

    model = four_layer_llama()
    d2t = torch.arange(3, 97, 3)
    head = Eagle3Head.for_target(model, d2t).eval()
    out = export_head(head, tmp_path / "e3", "eagle3", dtype=torch.float32, target=model)
    weights = load_file(str(out / "model.safetensors"))
    h = 64
    expected = (
        {
            "fc.weight",
            "norm.weight",
            "lm_head.weight",
            "d2t",
            "t2d",
            "embed_tokens.weight",
            "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight",
            "midlayer.post_attention_layernorm.weight",
        }
        | {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"}
        | {f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    )
    assert set(weights) == expected
    assert weights["fc.weight"].shape == (h, 3 * h) and weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert weights["lm_head.weight"].shape == (d2t.numel(), h)
    assert torch.equal(weights["d2t"] + torch.arange(d2t.numel()), d2t) and weights["t2d"].sum() == d2t.numel()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == d2t.numel()
    back = import_eagle3(out, model)
    x, t = torch.randn(1, 5, h), torch.randint(97, (1, 5))
    with torch.no_grad():
        assert torch.equal(
            back(x, t, torch.arange(5), model.get_input_embeddings()),
            head(x, t, torch.arange(5), model.get_input_embeddings()),
        )
    assert torch.equal(back.d2t, head.d2t)


def test_eagle3_evaluation_runs():
    from eagletree.train.evaluate import agreement

    from helpers import tiny_conversations

    model, tok = four_layer_llama(), tiny_tokenizer()
    head = Eagle3Head.for_target(model, torch.arange(60)).eval()
    result = agreement(head, model, tok, tiny_conversations(2), steps=3, max_len=40, stride=3)
    assert result["chains"] > 0 and len(result["free_running"]) == 3

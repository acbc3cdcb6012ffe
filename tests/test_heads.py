import copy

import pytest
import torch

from eagletree.draft import (
    EagleHead,
    HeadError,
    TreeDrafter,
    build_draft_vocab,
    t2d_mask,
    target_identity,
    target_to_draft,
)
from eagletree.search import eagle2_search, optimal_search

from helpers import tiny_model


def head_for(model, draft_tokens=None, seed=0):
    torch.manual_seed(seed)
    return EagleHead.for_target(model.config, draft_tokens).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_head_shapes_and_size(kind):
    model = tiny_model(kind)
    head = head_for(model)
    h = model.config.hidden_size
    assert head.fc.weight.shape == (h, 2 * h)
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters()) - h  # minus the dropped input norm
    assert head.num_parameters() == 2 * h * h + layer_params  # fc without bias (as vLLM loads it)
    assert not any(p is model.lm_head.weight or p is model.model.embed_tokens.weight for p in head.parameters())
    out = head(torch.randn(2, 5, h), torch.randint(97, (2, 5)), torch.arange(5), model.get_input_embeddings())
    assert out.shape == (2, 5, h)


def test_a_head_for_a_bf16_target_keeps_float32_weights():
    # Training's precision=auto loads the target in bf16, and its config then says dtype=bfloat16: the head's
    # weights must stay float32 (the optimizer's master copy) while autocast computes in bf16.
    from eagletree.draft.eagle3 import Eagle3Head

    model = tiny_model("llama").to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    for head in (EagleHead.for_target(model.config), Eagle3Head.for_target(model)):
        assert {p.dtype for p in head.parameters()} == {torch.float32}, type(head).__name__


@pytest.mark.real
def test_smollm2_head_is_about_three_percent_of_the_target(smollm2):
    model, _ = smollm2
    head = EagleHead.for_target(model.config)
    ratio = head.num_parameters() / sum(p.numel() for p in model.parameters())
    assert 0.02 < ratio < 0.05, ratio


def reference_child_probs(head, model, feats, toks, path_tokens, drafter):
    """Run the head without cache or tree mask along one path: the distribution after its last node."""
    embed = model.get_input_embeddings()
    with torch.no_grad():
        f, t = feats, toks
        out = head(f[None], t[None], torch.arange(t.numel()), embed)[0]
        for token in path_tokens:
            f = torch.cat([f, out[-1:]])
            t = torch.cat([t, torch.tensor([token])])
            out = head(f[None], t[None], torch.arange(t.numel()), embed)[0]
        return drafter.draft_probs(out[-1])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_tree_call_equals_running_each_path_alone(kind, draft_vocab):
    """The tree mask inside the head: every node's children come out as if its path ran alone."""
    model = tiny_model(kind)
    g = torch.Generator().manual_seed(0)
    d2t = None if draft_vocab is None else torch.randperm(97, generator=g)[:draft_vocab].sort().values
    head = head_for(model, d2t)
    feats, toks = torch.randn(7, 64, generator=g), torch.randint(97, (7,), generator=g)
    drafter = TreeDrafter(head, model)
    drafter.extend(feats, toks)
    seen = {}

    def recording(nodes, tokens, parents, level):
        probs = drafter(nodes, tokens, parents, level)
        for v, row in zip(nodes.tolist(), probs):
            seen[v] = row
        return probs

    tree = optimal_search(recording, int(toks[-1]), budget=24, depth=4, top_k=3, token_map=drafter.token_map)
    assert len(tree) == 24
    for v in range(len(tree)):
        path = tree.path_to(v)
        node_id = tree.node_ids[v]
        if node_id not in seen:
            continue  # a leaf that was never expanded
        ref = reference_child_probs(head, model, feats, toks, tree.tokens[path[1:]].tolist(), drafter)
        assert torch.allclose(seen[node_id], ref, atol=1e-4), (
            f"node {v} (path {path}): {(seen[node_id] - ref).abs().max()}"
        )
    if d2t is not None:
        assert set(tree.tokens[1:].tolist()) <= set(d2t.tolist())  # drafted ids map back to target ids


def test_drafting_on_cpu_reads_grouped_heads_in_place_with_sdpas_exact_outputs():
    """The drafter switches a CPU head's decoder layer (grouped key/value heads) to GQA_SDPA: every level's
    distributions are bitwise those of transformers' SDPA."""
    from eagletree.target.attention import GQA_SDPA

    model = tiny_model("llama")
    head = head_for(model)
    g = torch.Generator().manual_seed(2)
    feats, toks = torch.randn(11, 64, generator=g), torch.randint(97, (11,), generator=g)
    runs = {}
    for impl in (GQA_SDPA, "sdpa"):
        drafter = TreeDrafter(head, model)
        assert head.layer.self_attn.config._attn_implementation == head.layer_config._attn_implementation == GQA_SDPA
        if impl == "sdpa":
            head.layer.self_attn.config._attn_implementation = head.layer_config._attn_implementation = "sdpa"
        drafter.extend(feats, toks)
        seen = []

        def recording(nodes, tokens, parents, level):
            probs = drafter(nodes, tokens, parents, level)
            seen.append(probs)
            return probs

        optimal_search(recording, int(toks[-1]), budget=20, depth=4, top_k=3)
        runs[impl] = seen
    assert len(runs["sdpa"]) == 4 and all(torch.equal(a, b) for a, b in zip(runs[GQA_SDPA], runs["sdpa"]))


def test_extend_after_a_step_continues_the_committed_prefix():
    model = tiny_model("llama")
    head = head_for(model)
    g = torch.Generator().manual_seed(1)
    feats, toks = torch.randn(9, 64, generator=g), torch.randint(97, (9,), generator=g)
    whole = TreeDrafter(head, model)
    expected = whole.extend(feats, toks)
    parts = TreeDrafter(head, model)
    parts.extend(feats[:5], toks[:5])
    eagle2_search(parts, int(toks[4]), 10, 3, 2)  # a drafting step leaves tree entries in the cache ...
    got = parts.extend(feats[5:], toks[5:])  # ... which extend() drops before committing
    assert torch.allclose(got, expected, atol=1e-5)


def test_draft_vocab_is_a_bijection():
    streams = [[5, 5, 5, 9, 9, 1], [9, 7, 7, 7, 7]]
    d2t = build_draft_vocab(streams, 4, target_vocab=20, always=[2])
    assert d2t.tolist() == [2, 5, 7, 9]
    t2d = target_to_draft(d2t, 20)
    assert torch.equal(d2t[t2d[d2t]], d2t) and (t2d >= 0).sum() == 4
    assert t2d_mask(d2t, 20).nonzero().flatten().tolist() == [2, 5, 7, 9]
    with pytest.raises(ValueError, match="must be in"):
        build_draft_vocab(streams, 0, target_vocab=20)


@pytest.mark.parametrize("draft_vocab", [None, 30])
def test_save_load_round_trip(tmp_path, draft_vocab):
    model = tiny_model("qwen2")
    d2t = None if draft_vocab is None else torch.arange(0, 90, 3)
    head = head_for(model, d2t)
    head.save_pretrained(tmp_path / "head")
    loaded = EagleHead.from_pretrained(tmp_path / "head", target_config=model.config)
    x, t = torch.randn(1, 6, 64), torch.randint(97, (1, 6))
    embed = model.get_input_embeddings()
    with torch.no_grad():
        assert torch.equal(head(x, t, torch.arange(6), embed), loaded(x, t, torch.arange(6), embed))
    assert torch.equal(loaded.d2t, head.d2t) and loaded.config.draft_vocab_size == draft_vocab


def test_mismatched_target_and_corrupted_files(tmp_path):
    model = tiny_model("llama")
    head = head_for(model)
    head.save_pretrained(tmp_path / "head")
    other = tiny_model("qwen2")
    with pytest.raises(HeadError, match="model_type = 'llama', but this target has model_type = 'qwen2'"):
        EagleHead.from_pretrained(tmp_path / "head", target_config=other.config)
    # The same shapes with another RoPE base (not in the fingerprint under transformers 5) is another target.
    rebased = copy.deepcopy(model.config)
    rebased.rope_parameters = dict(rebased.rope_parameters, rope_theta=rebased.rope_parameters["rope_theta"] * 2)
    assert target_identity(rebased) == target_identity(model.config)
    with pytest.raises(HeadError, match=r"rope_theta = 10000.0, but this target has rope_theta = 20000.0"):
        EagleHead.from_pretrained(tmp_path / "head", target_config=rebased)
    EagleHead.from_pretrained(tmp_path / "head", target_config=model.config)
    weights = tmp_path / "head" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(HeadError, match="truncated or corrupted"):
        EagleHead.from_pretrained(tmp_path / "head")
    with pytest.raises(HeadError, match="is not a head folder"):
        EagleHead.from_pretrained(tmp_path / "nothing")


def test_medusa_head_round_trip_and_drafting(tmp_path):
    from eagletree.draft import MedusaDrafter, MedusaHead, load_head

    model = tiny_model("llama")
    head = MedusaHead.for_target(model.config, num_heads=3).eval()
    lm = model.get_output_embeddings().weight
    feats = torch.randn(5, 64)
    with torch.no_grad():
        # zero-initialized blocks: every head starts as the target's own next-token prediction
        assert torch.allclose(head(feats, lm)[2], feats @ lm.T, atol=1e-5)
    torch.nn.init.normal_(head.blocks[1][0].linear.weight, std=0.1)
    head.save_pretrained(tmp_path / "medusa")
    loaded = load_head(tmp_path / "medusa", target_config=model.config)
    assert isinstance(loaded, MedusaHead)
    with torch.no_grad():
        assert torch.equal(loaded(feats, lm), head(feats, lm))
    drafter = MedusaDrafter(loaded, model)
    first = drafter.extend(feats, torch.arange(5))
    assert torch.allclose(
        drafter(torch.tensor([3, 4]), torch.tensor([1, 2]), torch.tensor([0, 0]), 2)[1],
        torch.softmax(head(feats[-1], lm)[1], -1),
        atol=1e-6,
    )
    assert torch.allclose(first, torch.softmax(head(feats[-1], lm)[0], -1), atol=1e-6)
    with pytest.raises(ValueError, match="has 3 heads; cannot draft level 4"):
        drafter(torch.tensor([1]), torch.tensor([1]), torch.tensor([0]), 4)


EAGLE_KEYS = (
    {"fc.weight"}
    | {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    | {f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    | {"layers.0.post_attention_layernorm.weight"}
)


@pytest.mark.parametrize(
    "fmt, arch, bias",
    [
        ("eagle", "LlamaForCausalLM", False),
        ("vllm", "LlamaForCausalLM", False),
        ("sglang", "LlamaForCausalLMEagle", True),
    ],
)
def test_export_layout_and_import_round_trip(tmp_path, fmt, arch, bias):
    import json

    from safetensors.torch import load_file

    from eagletree.export.convert import export_head
    from eagletree.export.eagle import import_eagle

    model = tiny_model("llama")
    head = head_for(model, torch.arange(50))
    out = export_head(head, tmp_path / fmt, fmt, dtype=torch.float32)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == EAGLE_KEYS | ({"fc.bias"} if bias else set())
    h = model.config.hidden_size
    assert weights["fc.weight"].shape == (h, 2 * h)
    assert weights["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, h)  # 2 kv heads x head_dim 16
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch] and config["num_hidden_layers"] == 1 and config["bias"] is False
    back = import_eagle(out, model.config)
    x, t = torch.randn(1, 6, h), torch.randint(97, (1, 6))
    with torch.no_grad():
        assert torch.equal(
            back(x, t, torch.arange(6), model.get_input_embeddings()),
            head(x, t, torch.arange(6), model.get_input_embeddings()),
        )


def test_export_refusals(tmp_path):
    from eagletree.draft import HeadError
    from eagletree.export.convert import export_head

    llama = tiny_model("llama")
    biased = EagleHead.for_target(llama.config, fc_bias=True)
    torch.nn.init.normal_(biased.fc.bias)
    with pytest.raises(HeadError, match="vLLM's EAGLE fc has no bias"):
        export_head(biased, tmp_path / "v", "vllm")
    export_head(biased, tmp_path / "e", "eagle")  # the original EAGLE format keeps the bias
    with pytest.raises(HeadError, match="Llama-architecture heads; this head's target is 'qwen2'"):
        export_head(head_for(tiny_model("qwen2")), tmp_path / "q", "sglang")
    with pytest.raises(HeadError, match="not one of"):
        export_head(biased, tmp_path / "x", "onnx")


def test_cli_export_and_load_head_reads_eagle_layouts(tmp_path):
    from eagletree.cli import main
    from eagletree.loading import load_head  # any head folder: an export is imported

    model = tiny_model("llama")
    head = head_for(model)
    head.save_pretrained(tmp_path / "head")
    assert (
        main(
            [
                "export",
                "--head",
                str(tmp_path / "head"),
                "--format",
                "vllm",
                "--out",
                str(tmp_path / "v"),
                "--dtype",
                "fp32",
            ]
        )
        == 0
    )
    back = load_head(tmp_path / "v", target_config=model.config)
    x, t = torch.randn(1, 4, 64), torch.randint(97, (1, 4))
    with torch.no_grad():
        assert torch.equal(
            back(x, t, torch.arange(4), model.get_input_embeddings()),
            head(x, t, torch.arange(4), model.get_input_embeddings()),
        )

"""Exports read the way each engine's loader reads them (vLLM 0.33, SGLang 0.5.23, SafeAILab/EAGLE).

Each test states the loader's rule it checks (file and what it does) and applies that rule to the
exported files. The engines' own code runs in two scripts outside the test run: scripts/check_exports.py
(EAGLE's model classes) and scripts/check_engine_loaders.py (vLLM's and SGLang's draft classes, load_weights
and target-weight sharing, from their wheels).
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from eagletree.draft_heads import Eagle3Head, EagleHead, TreeDrafter
from eagletree.draft_heads.export import TOKEN_MAP, engine_notes, export_head, import_eagle, import_eagle3

from helpers import tiny_config

THETA = 100000.0  # SmolLM2's RoPE base; EAGLE's fallback is 10000


def llama(layers=2, seed=0):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = layers
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": THETA}
    cfg.tie_word_embeddings = True  # as SmolLM2's: the draft head's config must not copy it
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def eagle_head(model, draft=True):
    torch.manual_seed(1)
    return EagleHead.for_target(model.config, torch.arange(5, 97, 2) if draft else None).eval()


def exported(head, tmp_path, fmt, target=None):
    out = export_head(head, tmp_path / fmt, fmt, dtype=torch.float32, target=target)
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors")), out


def stacked(name: str) -> str:
    """vLLM's and SGLang's stacked-parameter mapping: q/k/v -> qkv_proj, gate/up -> gate_up_proj."""
    for old, new in (
        (".q_proj", ".qkv_proj"),
        (".k_proj", ".qkv_proj"),
        (".v_proj", ".qkv_proj"),
        (".gate_proj", ".gate_up_proj"),
        (".up_proj", ".gate_up_proj"),
    ):
        name = name.replace(old, new)
    return name


def eagle1_params(h, inter, q, kv, fc_bias):
    """The parameters an EAGLE-1/2 draft model of one layer has (layer 0 without input_layernorm), by name -> shape."""
    params = {
        "model.fc.weight": (h, 2 * h),
        "model.layers.0.self_attn.qkv_proj.weight": (q + 2 * kv, h),
        "model.layers.0.self_attn.o_proj.weight": (h, q),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * inter, h),
        "model.layers.0.mlp.down_proj.weight": (h, inter),
        "model.layers.0.post_attention_layernorm.weight": (h,),
    }
    if fc_bias:
        params["model.fc.bias"] = (h,)
    return params


def loaded_shapes(weights, rename):
    """name -> shape after a loader's renaming; stacked shards add their rows."""
    shapes = {}
    for name, w in weights.items():
        new = rename(name)
        if new is None:
            continue
        if new in shapes:
            shapes[new] = (shapes[new][0] + w.shape[0], *w.shape[1:])
        else:
            shapes[new] = tuple(w.shape)
    return shapes


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "eagle"])
def test_eagle1_weights_fill_exactly_the_engines_parameters(tmp_path, fmt):
    model = llama()
    head = eagle_head(model)
    config, weights, _ = exported(head, tmp_path, fmt)
    h, inter, hd = 64, 128, 16
    # vLLM llama_eagle.py: "model." + name unless lm_head, then the stacked mapping; fc has no bias.
    # SGLang llama_eagle.py: the same renaming (LlamaForCausalLM.load_weights); its fc always has a bias.
    # EAGLE cnets1.py Model: names as written (q/k/v separate), load_state_dict(strict=False).
    if fmt == "eagle":
        expected = {k.removeprefix("model."): v for k, v in eagle1_params(h, inter, 4 * hd, 2 * hd, False).items()}
        expected = {k: v for k, v in expected.items() if "qkv" not in k and "gate_up" not in k}
        for p, rows in (("q", 4 * hd), ("k", 2 * hd), ("v", 2 * hd)):
            expected[f"layers.0.self_attn.{p}_proj.weight"] = (rows, h)
        for p, shape in (("gate", (inter, h)), ("up", (inter, h))):
            expected[f"layers.0.mlp.{p}_proj.weight"] = shape
        assert {k: tuple(v.shape) for k, v in weights.items()} == expected
        assert config["bias"] is False  # ea_model.py: con["bias"] decides fc's bias
    else:
        got = loaded_shapes(weights, lambda n: stacked("model." + n))
        assert got == eagle1_params(h, inter, 4 * hd, 2 * hd, fc_bias=fmt == "sglang")
        # Both read config "bias" as the attention's bias (llama.py: attention_bias or bias): it must be false.
        assert config["bias"] is False and config["attention_bias"] is False


def test_sglang_never_ties_the_draft_head_and_gets_the_draft_vocabulary_as_a_token_map(tmp_path):
    model = llama()
    head = eagle_head(model)
    config, _, out = exported(head, tmp_path, "sglang")
    # llama_eagle.py: tie_word_embeddings makes lm_head the draft's embedding; set_embed_and_head then deletes
    # the same .weight twice. The draft head has no lm_head of its own: never tie.
    assert config["tie_word_embeddings"] is False and config["architectures"] == ["LlamaForCausalLMEagle"]
    # spec_utils.load_token_map: torch.tensor(torch.load(path, weights_only=True), dtype=int64) = hot_token_id;
    # eagle_worker_v2.init_lm_head: head = target_lm_head[hot_token_id]; a drafted index i is token hot_token_id[i].
    hot = torch.tensor(torch.load(out / TOKEN_MAP, weights_only=True), dtype=torch.int64)
    assert torch.equal(hot, head.d2t)
    lm = model.get_output_embeddings().weight
    feature = torch.randn(64)
    ours = TreeDrafter(head, model).draft_probs(feature)  # the head's own draft distribution
    sglang = torch.softmax(feature @ lm[hot].T, -1)
    assert torch.allclose(ours, sglang, atol=1e-6) and int(hot[sglang.argmax()]) == int(head.d2t[ours.argmax()])
    assert any("--speculative-token-map" in n for n in engine_notes(head, "sglang"))


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "eagle", "eagle3"])
def test_rope_base_dtype_and_ties_are_written_for_every_reader(tmp_path, fmt):
    model = llama(layers=4)
    head = Eagle3Head.for_target(model).eval() if fmt == "eagle3" else eagle_head(model)
    out = export_head(head, tmp_path / fmt, fmt, dtype=torch.bfloat16, target=model)
    config = json.loads((out / "config.json").read_text())
    # EAGLE (transformers 4) cnets.py/cnets1.py _init_rope: rope_scaling None -> base = config.rope_theta if present,
    # else 10000. transformers 5 (vLLM, SGLang) reads rope_parameters.
    assert config["rope_scaling"] is None and config["rope_theta"] == THETA
    assert config["rope_parameters"]["rope_theta"] == THETA
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is False
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(out)  # what vLLM and SGLang parse it with
    assert loaded.rope_parameters["rope_theta"] == THETA and loaded.tie_word_embeddings is False


def test_rope_scaling_is_written_for_eagle_when_the_target_scales():
    from eagletree.draft_heads import HeadError
    from eagletree.draft_heads.export import rope_fields

    linear = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    fields = rope_fields(linear)  # transformers 5 readers (vLLM, SGLang)
    assert fields == {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "rope_type": "linear", "factor": 2.0}}
    # EAGLE's EConfig takes exactly {type, factor} ("must be a dictionary with two fields")
    assert rope_fields(linear, "eagle") == {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    llama3 = {
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 8.0,
            "rope_theta": 5e5,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        }
    }
    with pytest.raises(
        HeadError, match="only linearly or dynamically .* the target's is 'llama3': export with --format vllm or sglang"
    ):
        rope_fields(llama3, "eagle")


def test_eagle3_export_carries_the_real_embedding_and_each_engines_layer_ids(tmp_path):
    model = llama(layers=6)
    head = Eagle3Head.for_target(model, torch.arange(3, 97, 3), fused_layers=[0, 2, 3]).eval()
    with pytest.raises(Exception, match="carries the target's embedding"):
        export_head(head, tmp_path / "none", "eagle3")
    config, weights, out = exported(head, tmp_path, "eagle3", target=model)
    # EAGLE cnets.py Model: with target_hidden_size in the config it does not load the target's embedding,
    # so load_state_dict must find it in the file.
    assert "target_hidden_size" in config
    assert torch.equal(weights["embed_tokens.weight"], model.get_input_embeddings().weight)
    # vLLM gpu_model_runner: top-level eagle_aux_hidden_state_layer_ids; llama.py captures id i after layer i-1
    # (hidden_states entering layer i), i.e. output of layer i - 1.
    assert [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]] == head.fused_layers
    # SGLang spec_aux_hidden_state.py reads eagle_config only; llama.py set_eagle3_layers_to_capture adds 1 and
    # captures the input of that layer, i.e. the output of the layer named in the config.
    captured = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    assert [i - 1 for i in captured] == head.fused_layers
    # EAGLE's modeling_llama_kv.py fuses the inputs of layers 2, L/2, L-3 whatever the config says: said at export.
    assert any("EAGLE's own code" in n for n in engine_notes(head, "eagle3", model.config))
    eight = llama(layers=8)  # EAGLE's layers 2, 4, 5 are the default fused ones
    assert engine_notes(Eagle3Head.for_target(eight).eval(), "eagle3", eight.config) == []
    # d2t: vLLM compute_logits / SGLang hot_token_id: target id = draft id + d2t[draft id]; t2d marks those.
    draft = torch.arange(weights["d2t"].numel())
    assert torch.equal(draft + weights["d2t"], head.d2t)
    assert torch.equal(weights["t2d"].nonzero().flatten(), head.d2t)
    assert config["draft_vocab_size"] == head.d2t.numel() == weights["lm_head.weight"].shape[0]
    # vLLM llama_eagle3.py / SGLang llama_eagle3.py: midlayer. -> layers.0., q/k/v stacked, "model." prefix.
    got = loaded_shapes(
        weights,
        lambda n: (
            None
            if n in ("d2t", "t2d")
            else (n if n.startswith("lm_head") else stacked("model." + n.replace("midlayer.", "layers.0.")))
        ),
    )
    h, hd = 64, 16
    assert got["model.layers.0.self_attn.qkv_proj.weight"] == (8 * hd, 2 * h)
    assert got["model.fc.weight"] == (h, 3 * h) and got["model.embed_tokens.weight"] == (97, h)
    assert {
        "model.layers.0.hidden_norm.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
    } <= set(got)
    assert config["bias"] is False  # SGLang: fc bias and attention bias both read it


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "eagle"])
def test_eagle1_round_trip_keeps_tensors_draft_vocabulary_and_drafts(tmp_path, fmt):
    model = llama()
    head = eagle_head(model)
    _, weights, out = exported(head, tmp_path, fmt)
    back = import_eagle(out, model.config)
    assert torch.equal(back.d2t, head.d2t) and back.config.draft_vocab_size == head.config.draft_vocab_size
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    feats, nxt = torch.randn(6, 64), torch.randint(97, (6,))
    assert torch.equal(TreeDrafter(back, model).extend(feats, nxt), TreeDrafter(head, model).extend(feats, nxt))
    full = eagle_head(model, draft=False)
    back_full = import_eagle(exported(full, tmp_path / "full", fmt)[2], model.config)
    assert back_full.config.draft_vocab_size is None


def test_eagle3_round_trip_drafts_identically(tmp_path):
    model = llama(layers=4)
    head = Eagle3Head.for_target(model, torch.arange(3, 97, 3)).eval()
    back = import_eagle3(exported(head, tmp_path, "eagle3", target=model)[2], model)
    feats, nxt = torch.randn(5, 3 * 64), torch.randint(97, (5,))
    assert torch.equal(TreeDrafter(back, model).extend(feats, nxt), TreeDrafter(head, model).extend(feats, nxt))


def test_full_vocabulary_eagle3_export_has_no_token_maps_and_comes_back_full(tmp_path):
    model = llama(layers=4)
    head = Eagle3Head.for_target(model).eval()  # the training default: the whole vocabulary
    config, weights, out = exported(head, tmp_path, "eagle3", target=model)
    assert "d2t" not in weights and "t2d" not in weights  # vLLM has no such parameter then (its loader refused it)
    assert config["draft_vocab_size"] == 97
    back = import_eagle3(out, model)
    assert back.config.draft_vocab_size is None  # (was 97: a "draft vocabulary" of every token)
    # an overwrite of an earlier EAGLE-1/2 export there leaves no token map of that other head
    old = export_head(eagle_head(model), tmp_path / "old", "sglang", dtype=torch.float32)
    assert (old / TOKEN_MAP).is_file()
    export_head(head, old, "eagle3", dtype=torch.float32, target=model, overwrite=True)
    assert not (old / TOKEN_MAP).is_file()
    # SGLang's form of the layer ids alone (outputs of decoder layers, as eagletree counts them)
    layered = Eagle3Head.for_target(model, torch.arange(3, 97, 3), fused_layers=[0, 1, 2]).eval()
    _, _, out = exported(layered, tmp_path / "sg", "eagle3", target=model)
    config = json.loads((out / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(config))
    assert import_eagle3(out, model).fused_layers == [0, 1, 2]  # (fell back to the default layers)


def test_sglang_zero_bias_comes_back_as_no_bias(tmp_path):
    model = llama()
    torch.manual_seed(1)
    head = EagleHead.for_target(model.config, torch.arange(5, 97, 2), fc_bias=False).eval()
    _, weights, out = exported(head, tmp_path, "sglang")
    assert weights["fc.bias"].abs().max() == 0  # SGLang's layout always has one
    assert import_eagle(out, model.config).config.fc_bias is False


def test_an_export_for_another_target_or_with_damaged_files_is_refused(tmp_path):
    from transformers import AutoConfig

    from eagletree.draft_heads import HeadError

    model = llama()
    _, _, out = exported(eagle_head(model), tmp_path, "vllm")
    other = AutoConfig.for_model(
        **{**model.config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    )
    deeper = AutoConfig.for_model(**{**model.config.to_dict(), "num_hidden_layers": 3})
    with pytest.raises(HeadError, match="exported for a target with fingerprint"):  # (imported silently before)
        import_eagle(out, deeper)
    config = json.loads((out / "config.json").read_text())
    del config["eagletree"]  # an export made elsewhere: its layer fields are compared
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadError, match="has rope_theta = 100000.0, but this target has rope_theta = 10000.0"):
        import_eagle(out, other)
    (out / TOKEN_MAP).write_bytes(b"garbage")  # (a pickle traceback before)
    with pytest.raises(HeadError, match="token_map.pt' is not a token map"):
        import_eagle(out, model.config)
    (out / TOKEN_MAP).unlink()
    (out / "model.safetensors").unlink()
    (out / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(HeadError, match="are truncated or corrupted"):
        import_eagle(out, model.config)


def test_a_bad_token_map_is_refused(tmp_path):
    from eagletree.draft_heads import HeadError

    model = llama()
    _, _, out = exported(eagle_head(model), tmp_path, "sglang")
    torch.save(torch.tensor([3, 3, 4]), out / TOKEN_MAP)
    with pytest.raises(HeadError, match="token_map.pt.*repeats a target id"):
        import_eagle(out, model.config)

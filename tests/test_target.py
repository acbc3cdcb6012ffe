import pytest
import torch

from eagletree.target import TargetError, cache_length, load_target, new_cache, resolve_target, tree_forward
from eagletree.target import loading as target_mod
from eagletree.target.attention import GQA_SDPA, use_gqa_sdpa
from eagletree.verify import prefill, verify_tree

from helpers import path_logits_reference, random_tree, tiny_model, tiny_tokenizer


def test_unknown_alias_names_what_was_tried_and_the_aliases():
    with pytest.raises(TargetError) as e:
        resolve_target("smollm9-1b")
    assert "smollm9-1b" in str(e.value) and "smollm2-135m" in str(e.value)


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TargetError, match="nope"):
        load_target(missing)


def test_folder_without_config(tmp_path):
    with pytest.raises(TargetError, match="config.json"):
        resolve_target(tmp_path)


def test_non_causal_model_is_refused(tmp_path):
    from transformers import BertConfig, T5Config

    for config in (BertConfig(), T5Config()):
        folder = tmp_path / config.model_type
        config.save_pretrained(folder)
        with pytest.raises(TargetError, match="not a decoder-only causal LM"):
            load_target(folder)


def test_local_folder_loads(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(97)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(
        tmp_path
    )
    loaded, tok = load_target(tmp_path, device="cpu")
    assert loaded.dtype == torch.float32 and not loaded.training
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_gguf_cache_is_written_atomically(tmp_path, monkeypatch):
    """An interrupted conversion leaves nothing loadable behind; a finished one is reused."""
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really gguf")
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        target_mod.gguf_to_folder(gguf)
    targets = tmp_path / "cache" / "targets"
    assert list(targets.iterdir()) == []  # the partial folder was removed

    # A folder at the final name without the completion marker (killed after rename) is not trusted.
    final = targets / f"m-{target_mod._file_digest(gguf)}"
    final.mkdir()
    (final / "config.json").write_text("{}")

    def fake_convert(*args, **kwargs):
        calls.append(2)
        raise RuntimeError("conversion attempted")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_convert)
    with pytest.raises(RuntimeError, match="conversion attempted"):
        target_mod.gguf_to_folder(gguf)
    assert [p.name for p in targets.iterdir()] == [final.name]  # no partial folder left behind

    # A conversion that finishes replaces that unmarked folder (the rename onto it failed on every run).
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny_model("llama"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    assert target_mod.gguf_to_folder(gguf) == final and (final / target_mod._CACHE_COMPLETE).is_file()
    assert (final / "model.safetensors").is_file() and [p.name for p in targets.iterdir()] == [final.name]

    # A complete folder is returned without converting again.
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_convert)
    assert target_mod.gguf_to_folder(gguf) == final
    assert calls == [1, 2]
    # A file named in capitals (model.GGUF) is a GGUF file too (it was "neither an alias, a folder, nor .gguf").
    upper = tmp_path / "M.GGUF"
    upper.write_bytes(gguf.read_bytes())
    target_mod.check_target_spec(upper)
    with pytest.raises(RuntimeError, match="conversion attempted"):
        target_mod.resolve_target(upper)
    assert calls == [1, 2, 2]


def test_mask_shape_is_checked():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="expected"):
        tree_forward(
            model, torch.tensor([[1, 2]]), new_cache(model), torch.ones(2, 3, dtype=torch.bool), torch.arange(2)
        )


def check_tree_forward(model, prefix, trees, tol):
    """Every node's logits from one tree pass equal a plain forward over its root path."""
    for tree in trees:
        cache = new_cache(model)
        prefill(model, cache, prefix)
        out = verify_tree(model, cache, tree)
        assert cache_length(cache) == prefix.numel() + len(tree)
        ref = path_logits_reference(model, prefix, tree)
        diff = (out.logits[0] - ref).abs().max().item()
        assert diff <= tol, f"{tree}: max |tree - path| logit diff {diff:.2e} > {tol}"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager", "gqa"])
def test_tree_forward_equals_path_forward_tiny(kind, attn):
    model = tiny_model(kind, "sdpa" if attn == "gqa" else attn)
    if attn != "sdpa":
        assert use_gqa_sdpa(model) == (attn == "gqa")  # eager is left alone
    g = torch.Generator().manual_seed(1)
    trees = [random_tree(n, d, 97, g, root_token=5) for n, d in [(1, 0), (2, 1), (9, 3), (33, 8), (64, 8), (64, 2)]]
    prefix = torch.randint(97, (23,), generator=g)
    check_tree_forward(model, prefix, trees, tol=1e-4)


def test_grouped_heads_read_in_place_give_sdpas_exact_outputs():
    """A CPU model on SDPA with grouped key/value heads switches to GQA_SDPA; its tree passes (several masked
    rows: where transformers copies the keys and values per query head) are bitwise SDPA's; a model without
    grouped heads keeps SDPA."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    tree = random_tree(33, 6, 97, g, root_token=5)
    prefix = torch.randint(97, (40,), generator=g)
    outs = []
    for switch in (False, True):
        if switch:
            assert use_gqa_sdpa(model) and model.config._attn_implementation == GQA_SDPA
        cache = new_cache(model)
        prefill(model, cache, prefix)
        outs.append(verify_tree(model, cache, tree))
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    assert not use_gqa_sdpa(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))


@pytest.mark.real
def test_tree_forward_equals_path_forward_smollm2(smollm2):
    model, tok = smollm2
    g = torch.Generator().manual_seed(2)
    prefix = tok("The quick brown fox jumps over the lazy dog because", return_tensors="pt").input_ids[0]
    trees = [random_tree(n, d, model.config.vocab_size, g, root_token=int(prefix[-1])) for n, d in [(16, 4), (64, 8)]]
    check_tree_forward(model, prefix[:-1], trees, tol=1e-4)


@pytest.mark.real
def test_smollm2_answers_a_chat_prompt(smollm2):
    model, tok = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_tree_forward_returns_chosen_layer_states():
    model = tiny_model("qwen2")
    ids = torch.randint(97, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    out = tree_forward(model, ids, new_cache(model), causal, torch.arange(12), layers=[0])
    assert set(out.layer_hidden) == {0}
    assert torch.allclose(out.layer_hidden[0], ref[1], atol=1e-5)
    assert torch.allclose(out.hidden, ref[-1], atol=1e-5)
    for bad in ([1], [-1]):
        with pytest.raises(ValueError, match=r"must be decoder layer indices in \[0, 0\]"):
            tree_forward(model, ids, new_cache(model), causal, torch.arange(12), layers=bad)

"""DecodeConfig: one home for decoding options, validated once; the library and the CLI share its defaults."""

import dataclasses

import pytest
import torch

from eagletree.cli import build_parser
from eagletree.decode.config import (
    CPU_BUDGET,
    GPU_BUDGET,
    TREE_KINDS,
    CopyOptions,
    DecodeConfig,
    OptionError,
    Sampling,
    TreeKind,
    default_budget,
)


def test_tree_kinds_know_static_from_searched():
    assert TREE_KINDS == ("eagle2", "optimal", "chain", "sequoia", "auto")
    assert [k.value for k in TreeKind if k.static] == ["chain", "sequoia"]
    assert DecodeConfig(tree="chain").tree is TreeKind.CHAIN and str(TreeKind.AUTO) == "auto"
    with pytest.raises(ValueError, match=r"tree must be one of \('eagle2', .*'auto'\), got 'bushy'"):
        DecodeConfig(tree="bushy")


def test_copying_defaults_to_on_for_searched_trees_and_is_refused_on_fixed_shapes():
    assert DecodeConfig(tree="eagle2").copies and DecodeConfig(tree="auto").copies
    assert not DecodeConfig(tree="sequoia").copies and not DecodeConfig(copy=CopyOptions(enabled=False)).copies
    with pytest.raises(ValueError, match=r"copy=True needs a searched tree .*tree='chain' is a fixed shape"):
        DecodeConfig(tree="chain", copy=CopyOptions(enabled=True))
    with pytest.raises(ValueError, match="store adds retrieved spans to the copied ones, so it needs copying on"):
        DecodeConfig(copy=CopyOptions(enabled=False, datastore="store.npz"))
    with pytest.raises(ValueError, match="copy_len must be an integer >= 1, got 0"):
        CopyOptions(length=0)
    with pytest.raises(ValueError, match="store must be 'auto', None, a TokenStore or a datastore file's path, got 3"):
        CopyOptions(datastore=3)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("depth", 0, "depth must be >= 1, got 0"),
        ("budget", 0, "budget must be >= 1, got 0"),
        ("top_k_draft", 0, "top_k_draft must be >= 1"),
        ("max_new_tokens", -1, "max_new_tokens must be >= 0"),
        ("max_new_tokens", 2.5, "max_new_tokens must be an integer, got 2.5"),
    ],
)
def test_a_config_out_of_range_names_the_field_and_the_value(field, value, message):
    with pytest.raises(OptionError, match=message) as e:
        DecodeConfig(**{field: value})
    assert e.value.option == field


def test_sampling_is_checked_on_construction():
    for bad, message in (
        ({"top_p": 2.0}, r"top_p must be > 0 and <= 1.0, got 2.0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": 1e-30}, r"temperature must be 0 \(greedy\) or >= 1e-20"),
        ({"top_k": -1}, r"top_k must be >= 0, got -1 \(0 = no top-k filter\)"),
        ({"seed": -1}, "seed must be >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            Sampling(**bad)
    assert Sampling().greedy and not Sampling(temperature=0.7).greedy


def test_a_config_is_frozen_and_from_options_maps_the_flat_names():
    config = DecodeConfig.from_options(
        tree="optimal", budget=16, temperature=0.5, seed=3, copy=False, copy_len=8, store=None, stop=["<|im_end|>"]
    )
    assert config.sampling == Sampling(temperature=0.5, seed=3) and config.stop == ("<|im_end|>",)
    assert config.copy == CopyOptions(enabled=False, length=8, datastore=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.budget = 4
    with pytest.raises(TypeError, match="unknown decoding option budgte; known: tree, budget"):
        DecodeConfig.from_options(budgte=8)
    with pytest.raises(TypeError, match="stop must be a list of token ids or token strings"):
        DecodeConfig(stop="<|im_end|>")
    with pytest.raises(ValueError, match="tree_paths gives the fixed shape of tree='sequoia', got tree='eagle2'"):
        DecodeConfig(tree="eagle2", tree_paths=[(0,)])
    with pytest.raises(ValueError, match="tree_paths make a tree of 4 nodes with the root, more than budget=3"):
        DecodeConfig(tree="sequoia", budget=3, tree_paths=[(0,), (1,), (0, 0)])


def test_the_budget_is_chosen_by_device_unless_given():
    assert default_budget("cuda") == default_budget("cuda:1") == GPU_BUDGET == 60
    assert default_budget("cpu") == CPU_BUDGET == 8 and default_budget("mps") == CPU_BUDGET
    assert DecodeConfig().for_device("cpu").budget == 8 and DecodeConfig(budget=20).for_device("cuda").budget == 20


def test_the_command_line_and_the_library_share_defaults_and_rules():
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    config = DecodeConfig.from_args(args)
    assert config == DecodeConfig()  # one set of defaults: auto, budget by device, depth 6, top-k 10, copies on
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--head", "none"])
    assert not DecodeConfig.from_args(args).copies  # --head none: plain decoding unless --copy on
    for flags, message in (
        (["--depth", "0"], "--depth must be >= 1, got 0"),
        (["--top-p", "2"], "--top-p must be > 0 and <= 1.0, got 2.0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--tree", "chain", "--copy", "on"], "--copy on needs a searched tree"),
        (["--copy", "off", "--datastore", "x.npz"], "--datastore x.npz adds retrieved spans"),
        (["--datastore", "no/such.npz"], "--datastore 'no/such.npz': no such file"),
        (["--datastore", "tests"], "--datastore 'tests': a folder; expected auto, none, or the file"),
    ):
        args = build_parser().parse_args(["generate", "--prompt", "hi", *flags])
        with pytest.raises(ValueError, match=message):
            DecodeConfig.from_args(args)


def test_the_library_decodes_with_the_device_default_too():
    from eagletree.decode import Decoder
    from eagletree.draft import EagleHead
    from eagletree.search import LatencyProfile

    from helpers import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config)
    decoder = Decoder(model, None, head, profile=LatencyProfile([1, 8], [0.01, 0.011]))
    assert decoder.config.tree is TreeKind.AUTO and decoder.config.budget == CPU_BUDGET
    assert decoder.searcher.budget == CPU_BUDGET and decoder.config.copies
    plain = DecodeConfig(max_new_tokens=12, copy=CopyOptions(enabled=False))
    want = Decoder(model, tok, None, plain).generate([5, 6, 7, 5, 6]).token_ids
    assert (
        Decoder(model, tok, head, DecodeConfig(max_new_tokens=12), profile=LatencyProfile([1, 8], [0.01, 0.011]))
        .generate([5, 6, 7, 5, 6])
        .token_ids
        == want
    )  # lossless: plain decoding's tokens


def test_generate_reuses_its_last_decoder_while_models_options_and_files_are_the_same(tmp_path, monkeypatch):
    import eagletree.decode.api as api
    from eagletree.draft import EagleHead, load_head
    from eagletree.search.store import SEPARATOR, TokenStore, vocab_fingerprint

    from helpers import tiny_model, tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    EagleHead.for_target(model.config).save_pretrained(tmp_path / "head")
    head = load_head(tmp_path / "head")
    built = []
    real = api.Decoder
    monkeypatch.setattr(api, "Decoder", lambda *a, **kw: built.append(a[3]) or real(*a, **kw))
    monkeypatch.setattr(api, "_LAST", api._LastDecoder())
    options = dict(tree="eagle2", budget=8, max_new_tokens=4)
    first = api.generate(model, tok, head, [5, 6, 7], **options).token_ids
    assert api.generate(model, tok, head, [5, 6, 7], **options).token_ids == first and len(built) == 1
    api.generate(model, tok, head, [5, 6, 7], **{**options, "budget": 6})  # other options: a new one
    api.generate(model, tok, head, [5, 6, 7], **{**options, "budget": 6})
    assert len(built) == 2
    TokenStore([5, 6, 7, 8, SEPARATOR]).save(tmp_path / "head" / "datastore.npz", vocab_fingerprint(tok))
    api.generate(model, tok, head, [5, 6, 7], **{**options, "budget": 6})  # the head's files changed
    assert len(built) == 3 and api._LAST.decoder.store is not None
    list(api.generate(model, tok, head, [5, 6, 7], stream=True, **{**options, "budget": 6}))  # a stream: its own
    api.generate(model, tok, head.to(torch.float64), [5, 6, 7], **{**options, "budget": 6})  # another dtype
    assert len(built) == 5

"""Heads declare what they read and how they draft; code outside draft/ asks them, never tests their kind."""

import ast
import json
from pathlib import Path

import pytest
import torch

from eagletree.draft import Drafting, Eagle3Head, EagleHead, FeatureSpec, MedusaHead, head_class, head_types

from helpers import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
HEAD_CLASSES = {"DraftHead", "EagleHead", "Eagle3Head", "MedusaHead"}
# what only a head's own module may read: declarations replaced these, and a kind name is not a capability
KIND_ATTRIBUTES = {"fused_layers", "drafts_from_own_features"}


def _kind_tests(path: Path) -> list[str]:
    """Lines of `path` that test a head's class or kind: isinstance/issubclass on a head class, hasattr on a head,
    a comparison with head_type, or reading an attribute that declarations replaced."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
        ):
            names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in ast.walk(node.args[1])}
            if names & HEAD_CLASSES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id} on a head class")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
            if "head" in ast.unparse(node.args[0]).lower():
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} hasattr on a head")
        elif isinstance(node, ast.Compare) and any(
            isinstance(e, ast.Attribute) and e.attr == "head_type" for e in ast.walk(node)
        ):
            sides = [node.left, *node.comparators]
            named = [
                e for side in sides for e in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])
            ]
            if any(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in named):  # a kind named in code
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return found


def test_nothing_outside_the_heads_tests_a_heads_kind():
    files = [
        p
        for p in [*ROOT.glob("eagletree/**/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("benchmarks/*.py")]
        if "draft" not in p.relative_to(ROOT).parts
    ]
    found = [line for path in sorted(files) for line in _kind_tests(path)]
    assert not found, "ask the head (feature_spec, drafting, its factories) instead:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_test(tmp_path):
    sample = ROOT / "tests" / "_kind_sample.py"
    sample.write_text(
        "isinstance(h, EagleHead)\nhasattr(head, 'layer')\nh.config.head_type == 'eagle3'\nh.fused_layers\n"
        "isinstance(x, int)\nh.feature_spec.layers\n'head_type' in config\n"
    )
    try:
        assert [line.split(" ", 1)[0].rsplit(":", 1)[1] for line in _kind_tests(sample)] == ["1", "2", "3", "4"]
    finally:
        sample.unlink()


def test_each_kind_declares_its_features_and_drafting():
    model = tiny_model("llama")
    eagle, eagle3 = EagleHead.for_target(model.config), Eagle3Head.for_target(model, fused_layers=[0, 0, 0])
    medusa = MedusaHead.for_target(model.config, num_heads=3)
    h = model.config.hidden_size
    assert eagle.feature_spec == FeatureSpec(h) and eagle.feature_spec.width == h
    assert eagle3.feature_spec == FeatureSpec(h, (0, 0, 0)) and eagle3.feature_spec.width == 3 * h
    assert eagle3.feature_spec.training_width == 4 * h
    assert head_class("eagle3").feature_spec_for(model.config).layers == (0, 0, 0)  # 2 layers: the default
    assert eagle.drafting == eagle3.drafting == Drafting(batched=True)
    assert medusa.drafting.max_depth == 3 and not medusa.drafting.follows_drafts and not medusa.drafting.batched
    # a step's head calls: the catch-up, then one per level below the root (a block drafter: one for them all)
    assert eagle.drafting.calls(4) == 4 and medusa.drafting.calls(4) == 1
    assert Drafting(level_calls=0, block_calls=1).calls(6) == 2
    ids = torch.arange(10)
    states = model.get_decoder()(input_ids=ids[None], output_hidden_states=True).hidden_states
    feats = eagle3.target_features(model, ids)
    assert torch.equal(feats[:, :h], states[-1][0]) and torch.equal(feats[:, h:], torch.cat([states[1][0]] * 3, -1))
    for kind in head_types():
        cls = head_class(kind)
        assert set(cls.ignored_train_keys) <= {
            f for f in __import__("eagletree.train.config").train.config.TrainConfig.__dataclass_fields__
        }


def test_medusa_drafts_under_draft_dtype_auto_on_a_bf16_cpu(tmp_path, monkeypatch):
    """--draft-dtype auto times the head's drafter in fp32 and bf16: that drafter is the head's own batch drafter
    (a ragged EAGLE drafter read `head.layer`, which a Medusa head has none of)."""
    from eagletree import generate
    from eagletree.draft import precision
    from eagletree.loading import load_models

    model, tok = tiny_model("llama"), tiny_tokenizer()
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    monkeypatch.setattr("eagletree.target.cpu_has_bf16", lambda: True)
    monkeypatch.setattr(precision, "cache_dir", lambda: tmp_path / "cache")
    MedusaHead.for_target(model.config, num_heads=2).save_pretrained(tmp_path / "medusa")
    head = load_models("tiny", tmp_path / "medusa")[2]
    chosen = json.loads(next((tmp_path / "cache" / "profiles").glob("draft-dtype-*")).read_text())
    assert set(chosen["step_seconds"]) == {"float32", "bfloat16"}
    assert next(head.parameters()).dtype == getattr(torch, chosen["chosen"])
    messages = [{"role": "user", "content": "hello how are you"}]
    plain = generate(model, tok, None, messages, max_new_tokens=12, copy=False)
    drafted = generate(model, tok, head, messages, max_new_tokens=12, tree="eagle2", budget=6, depth=2, copy=False)
    assert drafted.token_ids == plain.token_ids


def test_plan_measures_an_eagle3_heads_drafting_without_a_profile(tmp_path, monkeypatch):
    """Without --profile, plan times the head's drafting on this device: on the features the head reads (an EAGLE-3
    head's three layers, not the last hidden state alone)."""
    from eagletree.cli import main
    from eagletree.search.cost import LatencyProfile

    class Planned(BaseException):
        """Stops the command once its profile is measured (a random head's acceptance would end it anyway)."""

    def capture(*args, **kwargs):
        raise Planned(next(a for a in (*args, *kwargs.values()) if isinstance(a, LatencyProfile)))

    model, tok = tiny_model("llama"), tiny_tokenizer()
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    monkeypatch.setattr("eagletree.plan.make_plan", capture)
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    Eagle3Head.for_target(model, torch.arange(60)).save_pretrained(tmp_path / "head")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in ["hello how are you", "what is two plus four"]))
    args = ["plan", "--target", "tiny", "--head", str(tmp_path / "head"), "--engine", "vllm", "--prompts", str(prompts)]
    with pytest.raises(Planned) as planned:
        main(args + ["-o", str(tmp_path / "plan.json")])
    assert planned.value.args[0].draft_s_per_level > 0 and planned.value.args[0].draft_s_per_step > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_offline_features_hold_what_the_head_reads_and_train_like_online(tmp_path, kind):
    from eagletree.train.config import TrainConfig
    from eagletree.train.features import cache_features
    from eagletree.train.loop import train

    from helpers import tiny_conversations

    model, tok, convs = tiny_model("llama"), tiny_tokenizer(), tiny_conversations(6)
    base = dict(report_to="none", steps=2, grad_accum=2, save_every=2, warmup_steps=1, max_len=40, lr=1e-3)
    base |= dict(device="cpu", precision="fp32", head_type=kind)
    offline_cfg = TrainConfig(
        out_dir=str(tmp_path / "off"), features_dir=str(tmp_path / "f"), feature_dtype="fp32", **base
    )
    manifest = cache_features(offline_cfg, model, tok, convs, shard_size=4, progress=False)
    assert manifest["identity"].get("layers") == ([0, 0, 0] if kind == "eagle3" else None)
    offline, _ = train(offline_cfg, model_and_tokenizer=(model, tok), progress=False)
    online, _ = train(
        TrainConfig(out_dir=str(tmp_path / "on"), **base),
        model_and_tokenizer=(model, tok),
        conversations=convs,
        progress=False,
    )
    for (name, a), (_, b) in zip(offline.state_dict().items(), online.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    if kind == "eagle3":  # an EAGLE-1/2 run on this cache: refused, naming what it holds
        other = TrainConfig(
            out_dir=str(tmp_path / "x"),
            features_dir=str(tmp_path / "f"),
            feature_dtype="fp32",
            **(base | {"head_type": "eagle"}),
        )
        with pytest.raises(Exception, match="holds features for"):
            train(other, model_and_tokenizer=(model, tok), progress=False)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "dflash"])
def test_profile_times_a_head_of_the_kind_it_is_given(tmp_path, kind):
    """`eagletree profile --head DIR` profiles a random head of DIR's kind, its drafting per step as the head
    declares it (catch-up, then its calls per level)."""
    from eagletree.bench.profile import profile_costs, profile_head_type, random_model

    from helpers import tiny_config

    model, head = random_model(tiny_config("llama"), "cpu", torch.float32, None, kind)
    assert head.head_type == kind
    head.save_pretrained(tmp_path / "head")
    assert profile_head_type(tmp_path / "head") == kind and profile_head_type(None) == "eagle"
    rows = profile_costs(model, head, [1, 4], depth=3, top_k=2, prefix=8, reps=1, progress=False)
    assert rows[0]["draft_ms"] == 0.0 and rows[1]["draft_ms"] > 0
    (tmp_path / "head" / "config.json").write_text(json.dumps({"head_type": "wizard"}))
    with pytest.raises(Exception, match="unknown head_type 'wizard'"):
        profile_head_type(tmp_path / "head")


@pytest.mark.parametrize("tree", ["eagle2", "optimal", "chain", "sequoia", "auto"])
def test_a_head_is_drafted_as_deep_as_it_drafts(tree):
    """A Medusa head of 2 heads drafts 2 levels: deeper levels are not asked of it (the config's depth is a
    maximum), and a static shape deeper than that is refused when the decoder is built."""
    from eagletree import Decoder, generate
    from eagletree.decode.config import DecodeConfig

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = MedusaHead.for_target(model.config, num_heads=2).eval()
    messages = [{"role": "user", "content": "hello how are you"}]
    plain = generate(model, tok, None, messages, max_new_tokens=10, copy=False)
    out = generate(model, tok, head, messages, max_new_tokens=10, tree=tree, budget=8, depth=6, copy=False)
    assert out.token_ids == plain.token_ids
    assert Decoder(model, tok, head, DecodeConfig.from_options(depth=6, copy=False)).depth == 2
    with pytest.raises(ValueError, match=r"tree_paths reach depth 3, but this 'medusa' head drafts 2 levels deep"):
        Decoder(
            model,
            tok,
            head,
            DecodeConfig.from_options(tree="sequoia", tree_paths=[(0,), (0, 0), (0, 0, 0)], copy=False),
        )


def test_a_steps_other_head_calls_are_priced():
    from eagletree.search import LatencyProfile
    from eagletree.search.searchers import make_searcher

    profile = LatencyProfile([1, 8], [0.010, 0.012], draft_s_per_level=0.001, draft_s_per_step=0.002)
    assert float(profile.step_time(8, 3)) == pytest.approx(0.012 + 3 * 0.001 + 0.002)
    assert float(profile.step_time(1, 0)) == pytest.approx(0.010)  # a plain step drafts nothing
    searcher = make_searcher("auto", profile=profile)
    assert searcher.step_calls == 1  # the catch-up, unless the head says otherwise
    searcher.set_drafting(Drafting(catch_up=0, level_calls=0, block_calls=1))
    assert searcher.step_calls == 1
    searcher.set_drafting(Drafting(catch_up=2))
    assert searcher.step_calls == 2


def test_a_new_kind_of_head_is_a_class_and_a_registration(tmp_path):
    """A kind of head added from outside the package (here: Medusa's heads declared as a block drafter, one call a
    step for all its levels) is saved, loaded, trained, profiled and decoded with, batched too, by registering it:
    nothing outside its class is changed."""
    from eagletree import Decoder
    from eagletree.bench.profile import profile_costs
    from eagletree.decode.config import DecodeConfig
    from eagletree.draft import base, load_head, register_head
    from eagletree.train.config import TrainConfig
    from eagletree.train.loop import train

    from helpers import tiny_conversations

    class BlockHead(MedusaHead):
        head_type = "test-block"

        @property
        def drafting(self) -> Drafting:
            return Drafting(max_depth=self.num_heads, follows_drafts=False, catch_up=0, level_calls=0, block_calls=1)

    register_head(BlockHead)
    try:
        model, tok = tiny_model("llama"), tiny_tokenizer()
        cfg = TrainConfig.from_sources(None, ["head_type=test-block", "medusa_heads=2", "noise=0.2"])
        cfg.out_dir, cfg.report_to, cfg.steps, cfg.device, cfg.save_every = str(tmp_path / "run"), "none", 2, "cpu", 2
        cfg.max_len, cfg.warmup_steps, cfg.grad_accum = 40, 1, 1
        trained, _ = train(cfg, model_and_tokenizer=(model, tok), conversations=tiny_conversations(4), progress=False)
        assert type(trained) is BlockHead
        head = load_head(tmp_path / "run" / "head", target_config=model.config)
        assert type(head) is BlockHead and head.drafting.block_calls == 1
        rows = profile_costs(model, head, [1, 4], depth=3, top_k=2, prefix=8, reps=1, progress=False)
        assert rows[1]["draft_ms"] > 0  # its block, drafted when the accepted tokens are committed
        prompts = [[{"role": "user", "content": p}] for p in ("hello how are you", "tell me a joke", "why")]
        plain = Decoder(model, tok, None, DecodeConfig.from_options(max_new_tokens=8, copy=False))
        drafted = Decoder(model, tok, head, DecodeConfig.from_options(max_new_tokens=8, copy=False, tree="eagle2"))
        want = [r.token_ids for r in plain.generate_batch(prompts)]
        assert [r.token_ids for r in drafted.generate_batch(prompts)] == want
        assert [drafted.generate(p).token_ids for p in prompts] == want
    finally:
        base._REGISTRY.pop("test-block", None)

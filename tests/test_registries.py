"""The export formats and serving engines are registries (eagletree/export, eagletree/serve): every format's layouts
declare the heads they take and import recognizes what each writes; refusals are one line; the CLI lists the
registries' names."""

import json
import sys
import types

import pytest
import torch

from eagletree import export, serve
from eagletree.draft import DFlashHead, Eagle3Head, EagleHead, HeadError, MedusaHead
from eagletree.export.convert import check_format, export_head, import_folder, recognize_folder
from eagletree.export.layout import Layout

from helpers import mark_gguf_source, tiny_config, tiny_tokenizer_gguf


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Llama target saved to and loaded from a folder (a speculators export names that folder), which reads
    as de-quantized from a GGUF file (format "gguf" copies the tokenizer from it)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 4
    folder = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    mark_gguf_source(folder, tiny_tokenizer_gguf(folder.parent / f"{folder.name}.gguf", cfg.vocab_size))
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def make_head(head_type: str, model):
    torch.manual_seed(1)
    if head_type == "eagle3":
        return Eagle3Head.for_target(model, torch.arange(3, 97, 3)).eval()
    if head_type == "medusa":
        return MedusaHead.for_target(model.config, num_heads=2).eval()
    if head_type == "dflash":
        return DFlashHead.for_target(model, torch.arange(5, 97, 2), block_size=4).eval()
    return EagleHead.for_target(model.config, torch.arange(5, 97, 2)).eval()


LAYOUTS = [(name, layout) for name in export.format_names() for layout in export.format_layouts(name)]
IDS = [f"{name}-{'+'.join(layout.heads)}" for name, layout in LAYOUTS]


def test_every_format_declares_its_heads_and_the_registry_picks_the_layout_by_the_heads_type(target):
    names = {"eagle", "eagle3", "vllm", "sglang", "speculators", "dflash", "gguf", "hf-generate"}
    assert set(export.format_names()) == names
    taken = {}
    for name, layout in LAYOUTS:
        assert isinstance(layout, Layout) and layout.format == name and layout.heads and layout.kind
        for head_type in layout.heads:
            taken.setdefault(head_type, []).append(name)
            assert export.layout_for(name, make_head(head_type, target)) is layout
    assert taken == {
        "eagle": ["eagle", "vllm", "sglang", "hf-generate"],
        "eagle3": ["eagle3", "vllm", "speculators", "gguf", "hf-generate"],
        "dflash": ["speculators", "dflash", "gguf", "hf-generate"],
        "medusa": ["hf-generate"],  # every head eagletree decodes with runs inside `generate`
    }
    # "vllm" is two layouts, one per kind of head
    vllm = export.format_layouts("vllm")
    assert [layout.heads for layout in vllm] == [("eagle",), ("eagle3",)]


@pytest.mark.parametrize(("name", "layout"), LAYOUTS, ids=IDS)
def test_an_export_is_recognized_as_its_own_format_and_imports_back(tmp_path, target, name, layout):
    head = make_head(layout.heads[0], target)
    out = export_head(head, tmp_path / name, name, dtype=torch.float32, target=target)
    assert recognize_folder(out) is layout
    back = import_folder(out, target if layout.imports_with_model else target.config)
    assert type(back) is type(head) and torch.equal(back.d2t, head.d2t)
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    if name == "gguf":  # one GGUF file, no config.json (one made elsewhere: tests/test_gguf_export.py)
        return
    # Made elsewhere (no eagletree marker): the same kind of head; the same format where the files tell it apart
    # (EAGLE's own EAGLE-1/2 layout without a bias is vLLM's, file for file).
    config = json.loads((out / "config.json").read_text())
    del config["eagletree"]
    (out / "config.json").write_text(json.dumps(config))
    foreign = recognize_folder(out)
    assert foreign.heads == layout.heads
    assert foreign.format == ("vllm" if name == "eagle" else name)


@pytest.mark.parametrize("name", export.format_names())
@pytest.mark.parametrize("head_type", ["eagle", "eagle3", "medusa", "dflash"])
def test_a_format_refuses_a_head_it_does_not_take_in_one_line(tmp_path, target, name, head_type):
    head = make_head(head_type, target)
    if name in export.formats_taking(head_type):
        check_format(head, name)
        return
    with pytest.raises(HeadError) as refused:
        export_head(head, tmp_path / "out", name, target=target)
    message = str(refused.value)
    assert "\n" not in message and f"{name!r}" in message, message
    takers = export.formats_taking(head_type)
    kind = {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3", "medusa": "Medusa", "dflash": "DFlash"}[head_type]
    assert kind in message and ", ".join(repr(f) for f in takers or export.format_names()) in message, message
    assert not (tmp_path / "out").exists()


def test_an_unknown_format_or_engine_names_the_registered_ones(target):
    with pytest.raises(HeadError, match=r"export format 'onnx' is not one of \('eagle', 'eagle3', "):
        check_format(make_head("eagle", target), "onnx")
    with pytest.raises(ValueError, match=r"engine must be one of \('vllm', 'sglang', 'eagle', 'llamacpp'\), got 'tgi'"):
        serve.engine("tgi")


def test_a_new_format_is_one_module_and_one_register_line(tmp_path, target, monkeypatch):
    """A format registered from outside the package: listed, chosen for its heads, written, recognized."""

    class Plain(Layout):
        format, heads, kind = "plain", ("eagle",), "EAGLE-1/2"

        def state(self, head, embedding=None):
            return {k: v.detach() for k, v in head.state_dict().items()}

        def config(self, head, dtype, target=None, speculative_tokens=None):
            return {"plain": True, "eagletree": {"format": self.format}}

        def recognizes(self, config):
            return config.get("plain") is True

    module = types.ModuleType("plain_format")
    module.LAYOUTS = (Plain(),)
    monkeypatch.setitem(sys.modules, "plain_format", module)
    monkeypatch.setitem(export.registry._MODULES, "plain", "plain_format")
    assert export.format_names()[-1] == "plain"
    out = export_head(make_head("eagle", target), tmp_path / "p", "plain", dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert recognize_folder(out) is module.LAYOUTS[0]
    with pytest.raises(HeadError, match=r"^format 'plain' takes EAGLE-1/2 heads, not an EAGLE-3 head .*'speculators'"):
        check_format(make_head("eagle3", target), "plain")


def test_each_engine_says_tree_or_chain_its_vocabulary_and_its_settings():
    from eagletree.plan import Acceptance, best_plan, engine_config
    from eagletree.search import LatencyProfile

    assert serve.engine_names() == ("vllm", "sglang", "eagle", "llamacpp")
    rules = {name: (serve.engine(name).chain, serve.engine(name).full_vocab) for name in serve.engine_names()}
    assert rules == {"vllm": (True, True), "sglang": (False, False), "eagle": (False, True), "llamacpp": (True, False)}
    acceptance = Acceptance({"0": 60, "1": 30, "0,0": 40, "1,0": 20}, 100, [[0.0]], [100], 2, 1)
    flat = LatencyProfile([1, 64], [0.010, 0.0101])
    tree_planned = [name for name in serve.engine_names() if not serve.engine(name).measured_costs]
    assert tree_planned == ["vllm", "sglang", "eagle"]  # llama.cpp's plan: tests/test_plan_llamacpp.py
    for name in tree_planned:
        plan = best_plan(acceptance, flat, name, 8, 2)
        assert all(not any(p) for p in plan.paths) == serve.engine(name).chain  # a chain: rank 0 at every depth
        assert engine_config(plan, "out", False, True) == serve.engine(name).settings(plan, "out", False, True)


def test_the_cli_choices_are_the_registries_names():
    from eagletree.cli import build_parser

    def choices(command: str, flag: str):
        sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
        return tuple(next(a for a in sub._actions if flag in a.option_strings).choices)

    assert choices("export", "--format") == export.format_names()
    assert choices("plan", "--engine") == serve.engine_names()


def test_each_engine_names_the_format_it_loads_a_head_kind_in():
    from eagletree.serve import engine

    assert [engine("sglang").format_for(k) for k in ("eagle", "eagle3")] == ["sglang", "eagle3"]
    assert [engine("vllm").format_for(k) for k in ("eagle", "eagle3")] == ["vllm", "vllm"]
    assert [engine("eagle").format_for(k) for k in ("eagle", "eagle3")] == ["eagle", "eagle3"]
    with pytest.raises(ValueError, match="sglang loads sglang, eagle3 exports, none of which takes 'medusa' heads"):
        engine("sglang").format_for("medusa")

"""The machinery of scripts/check_engine_loaders.py (in scripts/engines/), on a tiny engine written here (the real run
needs SGLang's wheel).

The fake engine is Python source executed the way the script executes SGLang's files: imports resolved from a
Sandbox of stand-in modules, a stacked q/k/v loader as SGLang writes it. The self-test's broken copies are made from
small export folders written here.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from engines import broken_exports, load_audit, sandbox, standins  # noqa: E402

ENGINE = """
import torch
from torch import nn
from fakeengine.layers.linear import QKVParallelLinear
from fakeengine.loader import default_weight_loader


class Draft(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=False)
        self.norm = nn.Linear(hidden, 1, bias=False)  # no weight_loader: the default loader's parameter

    def load_weights(self, weights):
        stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v")]
        params = dict(self.named_parameters())
        for name, w in weights:
            name = "." + name
            for param_name, shard_name, shard in stacked:
                if shard_name in name:
                    name = name.replace(shard_name, param_name)[1:]
                    if name in params:
                        params[name].weight_loader(params[name], w, shard)
                    break
            else:
                name = name[1:]
                if name in params:
                    getattr(params[name], "weight_loader", default_weight_loader)(params[name], w)


def share(model, embed):
    model.norm.weight = embed
"""


def default_weight_loader(param, w):
    assert param.shape == w.shape, f"{tuple(w.shape)} into {tuple(param.shape)}"
    param.data.copy_(w)


def engine():
    box = sandbox.Sandbox("fake")
    box.stub("fakeengine.layers.linear", "test", QKVParallelLinear=standins.QKVParallelLinear)
    box.stub("fakeengine.loader", "test", default_weight_loader=default_weight_loader)
    return box, box.run("fakeengine.models.draft", ENGINE, "fakeengine/models/draft.py")


def checkpoint():
    torch.manual_seed(0)  # hidden 8, 2 heads and 1 kv head of 4
    return {
        "q_proj.weight": torch.randn(8, 8),
        "k_proj.weight": torch.randn(4, 8),
        "v_proj.weight": torch.randn(4, 8),
        "norm.weight": torch.randn(1, 8),
    }


def audit(state, after=None):
    box, module = engine()
    model = module.Draft(8, 2, 1, 4)
    result = load_audit.Audit("fake", "export")
    with box.active():
        load_audit.audit_load(
            result,
            model,
            state,
            model.load_weights,
            default_weight_loader,
            {},
            after and (lambda: after(module, model)),
        )
    return result, model


def test_a_complete_checkpoint_fills_every_shard_at_its_offset():
    state = checkpoint()
    result, model = audit(state)
    assert result.problems == []
    expected = torch.cat([state["q_proj.weight"], state["k_proj.weight"], state["v_proj.weight"]])
    assert torch.equal(model.qkv_proj.weight, expected) and torch.equal(model.norm.weight, state["norm.weight"])
    assert "4 tensors -> 2 parameters" in result.notes[0]


def test_a_missing_shard_an_extra_tensor_and_a_wrong_shape_are_each_reported():
    state = checkpoint()
    del state["k_proj.weight"]
    state["rotary.inv_freq"] = torch.randn(2)
    state["v_proj.weight"] = torch.randn(5, 8)
    result, _ = audit(state)
    text = "\n".join(result.problems)
    assert "shape mismatch: v_proj.weight -> qkv_proj.weight: tensor of shape (5, 8) into shard 'v'" in text
    assert "skipped: ['rotary.inv_freq']" in text
    assert "never loaded: ['qkv_proj.weight (64 of 128 values)']" in text  # k's and v's rows: 2 x 4 x 8


def test_weights_the_engine_takes_from_the_target_are_not_missing_and_are_listed():
    state = checkpoint()
    del state["norm.weight"]
    assert "never loaded: ['norm.weight']" in "\n".join(audit(state)[0].problems)
    result, _ = audit(state, after=lambda module, model: module.share(model, torch.nn.Parameter(torch.ones(1, 8))))
    assert result.problems == [] and "taken from the target after loading: ['norm.weight']" in result.notes[0]


def test_an_engine_function_runs_from_its_source_and_the_sandbox_leaves_sys_modules_as_it_was():
    fn = sandbox.definition(ENGINE, "Draft.load_weights", "draft.py", {})
    assert (
        fn.__code__.co_filename == "draft.py"
        and fn.__code__.co_firstlineno == ENGINE.split("\n").index("    def load_weights(self, weights):") + 1
    )
    with pytest.raises(SystemExit, match="defines no Draft.forward"):
        sandbox.definition(ENGINE, "Draft.forward", "draft.py", {})
    box, _ = engine()
    with box.active():
        assert "fakeengine.loader" in sys.modules
    assert "fakeengine.loader" not in sys.modules and "fakeengine" not in sys.modules


def test_a_drop_rule_must_be_in_the_engine_source():
    source = 'for name, w in weights:\n    if "t2d" in name:\n        continue\n'
    assert load_audit.drop_rule(source, "t2d", "x.py") == {"t2d": "x.py"}
    with pytest.raises(SystemExit, match="no longer skips 'd2t'"):
        load_audit.drop_rule(source, "d2t", "x.py")


def export_folder(tmp_path, name, fmt, draft_ids, **weights):
    folder = tmp_path / name
    folder.mkdir()
    config = (
        {"architectures": ["X"], **broken_exports.aux_eagle_config([1, 2, 3])}
        if fmt == "eagle3"
        else {"architectures": ["X"]}
    )
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    if fmt == "sglang":
        torch.save(list(draft_ids), folder / "token_map.pt")  # as the export writes it
    return load_audit.Export(folder, fmt, [0, 1, 2] if fmt == "eagle3" else None, draft_ids)


def test_the_self_test_breaks_the_exports_over_a_draft_vocabulary_and_expects_sglang_to_report_all_but_one(tmp_path):
    sglang = export_folder(tmp_path, "s", "sglang", [0, 2, 5], **{"fc.bias": torch.zeros(2)})
    full = export_folder(tmp_path, "full", "eagle3", None, **{"embed_tokens.weight": torch.zeros(2, 2)})
    d2t = torch.tensor([0, 1, 3])  # target id = index + offset: 0, 2, 5
    draft = export_folder(tmp_path, "d", "eagle3", [0, 2, 5], d2t=d2t, **{"embed_tokens.weight": torch.zeros(2, 2)})
    cases = broken_exports.broken_exports(
        [sglang, full, draft], tmp_path / "work"
    )  # the full-vocabulary one is skipped
    assert [e.draft_ids for _, e, _ in cases] == [[0, 2, 5]] * len(cases)
    assert [e.fmt for _, e, _ in cases] == ["sglang"] * 4 + ["eagle3"] * 6
    assert [what for what, _, reported in cases if not reported] == [
        "no embed_tokens (SGLang takes the target's; only EAGLE's own code needs it, see check_exports.py)"
    ]
    from safetensors.torch import load_file

    by_what = {what: e.folder for what, e, _ in cases}
    broken_d2t = load_file(str(by_what["d2t as target ids instead of offsets"] / "model.safetensors"))["d2t"]
    assert broken_d2t.tolist() == [0, 2, 5]
    assert broken_exports.aux_layer_ids(by_what["eagle_config layer ids + 1 (SGLang adds 1 itself)"]) == [2, 3, 4]
    assert torch.load(by_what["token_map.pt in another order"] / "token_map.pt") == [5, 2, 0]
    with pytest.raises(SystemExit, match="each over a draft vocabulary"):
        broken_exports.broken_exports([sglang, full], tmp_path / "work2")

"""--draft-dtype auto: the head drafts in the faster of fp32 and bf16, measured on this machine and cached."""

import json

import pytest
import torch

from eagletree.draft import Eagle3Head, EagleHead, precision
from eagletree.draft.precision import draft_dtype_path, load_or_measure_draft_dtype, measure_draft_dtypes
from eagletree.loading import draft_dtype, load_models

from helpers import tiny_model, tiny_tokenizer


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_drafting_step_is_timed_in_each_precision(kind):
    model = tiny_model("llama")
    head = Eagle3Head.for_target(model) if kind == "eagle3" else EagleHead.for_target(model.config)
    seconds = measure_draft_dtypes(head.eval(), model, steps=2, context=16)
    assert set(seconds) == {"float32", "bfloat16"} and all(s > 0 for s in seconds.values())
    assert next(head.parameters()).dtype == torch.float32  # measured on copies
    from eagletree.packing import pack_linears, packing_problem

    if packing_problem(head) is None:  # a head a drafter packed can still be measured (its copies are rebuilt)
        pack_linears(head)
        assert set(measure_draft_dtypes(head, model, steps=1, context=8)) == {"float32", "bfloat16"}


def test_the_faster_precision_is_kept_and_cached(tmp_path, monkeypatch):
    model = tiny_model("llama")
    head = EagleHead.for_target(model.config).eval()
    path = tmp_path / "choice.json"
    monkeypatch.setattr(precision, "measure_draft_dtypes", lambda h, m: {"float32": 0.002, "bfloat16": 0.001})
    assert load_or_measure_draft_dtype(head, model, path) == torch.bfloat16
    assert json.loads(path.read_text())["step_seconds"] == {"float32": 0.002, "bfloat16": 0.001}
    monkeypatch.setattr(precision, "measure_draft_dtypes", lambda h, m: pytest.fail("measured again"))
    assert load_or_measure_draft_dtype(head, model, path) == torch.bfloat16  # from the cache
    path.write_text("{not json")  # a damaged entry is measured again and replaced
    monkeypatch.setattr(precision, "measure_draft_dtypes", lambda h, m: {"float32": 0.001, "bfloat16": 0.003})
    assert load_or_measure_draft_dtype(head, model, path) == torch.float32
    assert json.loads(path.read_text())["chosen"] == "float32"
    assert draft_dtype_path(head, model).name.startswith("draft-dtype-")


@pytest.mark.parametrize("bf16_cpu, faster", [(True, "bfloat16"), (True, "float32"), (False, "bfloat16")])
def test_load_models_drafts_in_the_measured_precision_where_the_cpu_has_bf16(tmp_path, monkeypatch, bf16_cpu, faster):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    monkeypatch.setattr("eagletree.target.cpu_has_bf16", lambda: bf16_cpu)
    monkeypatch.setattr(precision, "cache_dir", lambda: tmp_path / "cache")
    slower = {"bfloat16": "float32", "float32": "bfloat16"}[faster]
    monkeypatch.setattr(precision, "measure_draft_dtypes", lambda h, m: {faster: 0.001, slower: 0.002})
    EagleHead.for_target(model.config).save_pretrained(tmp_path / "head")
    head = load_models("tiny", tmp_path / "head")[2]
    # without native bf16 the head drafts in the target's precision, unmeasured
    assert next(head.parameters()).dtype == (getattr(torch, faster) if bf16_cpu else torch.float32)
    assert next(load_models("tiny", tmp_path / "head", head_dtype="bfloat16")[2].parameters()).dtype == torch.bfloat16
    assert draft_dtype("float16", model) == torch.float16

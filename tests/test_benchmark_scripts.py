"""The benchmark scripts that reach into the decoder's internals (benchmarks/draft_cost.py wraps the batch
drafter's and the search's calls to time them) still run against them: a tiny model and head, two prompts."""

import argparse
import importlib.util
from pathlib import Path

import torch

from eagletree.draft import EagleHead

from helpers import tiny_config, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_draft_cost_times_every_part_of_a_drafting_level(monkeypatch):
    draft_cost = script("draft_cost")
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(97, (n,), generator=g).tolist() for n in (5, 9)]
    monkeypatch.setattr(draft_cost, "load_prompts", lambda spec: prompts)
    # (the script wraps the batch drafter's and a decoding pass's functions for the process; undone after the test)
    drafter_class = type(draft_cost.make_batch_drafter(head, model))
    for owner, name in ((drafter_class, "expand"), (drafter_class, "extend")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(draft_cost.decoding_step, "verify_rows", draft_cost.decoding_step.verify_rows)
    monkeypatch.setattr(draft_cost.TreeDrafter, "draft_probs", draft_cost.TreeDrafter.draft_probs)
    monkeypatch.setattr(draft_cost.batch_drafter, "lean_forward", draft_cost.batch_drafter.lean_forward)
    args = argparse.Namespace(
        max_new_tokens=12, tree="eagle2", budget=8, depth=4, copy="on", batch_size=2, prompts="two", lean="on"
    )
    clock, counts, timed, seen = draft_cost.instrument(head, drafter_class)
    rows, skipped = draft_cost.measure(model, tok, head, args, clock, counts, timed, seen)
    assert rows and skipped == 0
    for row in rows:
        assert row["levels_per_pass"] > 0 and row["level"] > 0 and row["extend"] > 0 and row["verify_one"] > 0


def test_verify_cost_prints_transformers_and_the_decoding_passes(tmp_path, capsys):
    config = tmp_path / "config.json"
    tiny_config("llama").to_json_file(config)
    script("verify_cost").main(["--config", str(config), "--sizes", "1,3", "--reps", "1", "--prefix", "6"])
    out = capsys.readouterr().out
    assert "stock kernels" in out and "the passes decoding runs" in out
    last = out.split("the passes decoding runs")[1]
    assert "| 1 |" in last and "| 3 |" in last and "| 1.00 |" in last


def test_hostile_inputs_judges_each_outcome():
    """benchmarks/hostile_inputs.py: a refused input is fine when refused in one line before the target loads; a
    kill (time or memory limit) is a hang, a Python traceback counts as one, a success where a refusal was due is
    silent wrong."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("hostile_inputs", ROOT / "benchmarks" / "hostile_inputs.py")
    hostile = importlib.util.module_from_spec(spec)
    sys.modules["hostile_inputs"] = hostile  # (its dataclass looks its module up there)
    spec.loader.exec_module(hostile)
    Run = hostile.Run
    assert Run(2, "", "error: --out 'x': a folder").refused() == "fine"
    assert Run(2, "", "loaded smollm2-135m (...)\nerror: bad").refused() == "late"
    assert Run(1, "", "Traceback (most recent call last):\n  ...\nTypeError: x").refused() == "traceback"
    assert Run(None, "", "").refused() == Run(-9, "", "").refused() == Run(137, "", "").refused() == "hang"
    assert Run(0, "", "").refused() == "silent wrong"
    assert len(hostile.CLI_CASES) >= 15

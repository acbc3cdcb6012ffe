"""scripts/check_llamacpp.py: its build flags, log reading and near-tie rule here (no llama.cpp), and under
`llamacpp` (pytest --llamacpp) the real thing: llama.cpp's own converter against `export --format gguf`, and a
block head served by llama-server next to eagletree."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "check_llamacpp.py"
spec = importlib.util.spec_from_file_location("check_llamacpp", SCRIPT)
cl = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = cl
spec.loader.exec_module(cl)
from engines import llamacpp_build, llamacpp_runs  # noqa: E402  (scripts/ is on the path: the script put it there)

XEON = "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16\n"
EPYC_ZEN2 = "flags\t\t: fpu sse2 avx avx2 fma f16c\n"


def test_the_build_is_never_native_never_amx_and_follows_the_cpus_flags():
    xeon = llamacpp_build.cpu_options(XEON)
    assert xeon["GGML_NATIVE"] == "OFF" and all(xeon[f"GGML_AMX_{k}"] == "OFF" for k in ("TILE", "INT8", "BF16"))
    assert xeon["GGML_AVX512"] == xeon["GGML_AVX512_VNNI"] == xeon["GGML_AVX512_BF16"] == "ON"
    zen2 = llamacpp_build.cpu_options(EPYC_ZEN2)
    assert zen2["GGML_AVX2"] == "ON" and zen2["GGML_AVX512"] == zen2["GGML_AVX512_BF16"] == "OFF"


def test_the_servers_verified_drafts_are_read_from_its_debug_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "0.08.278 D slot operator(): id  3 | task 0 | add accepted tokens: sampled=8844, ids.size=1, n_draft=7\n"
        "0.08.278 D slot operator(): id  3 | task 0 | accepted 0/7 draft tokens, new n_tokens = 20\n"
        "0.08.401 D slot operator(): id  3 | task 0 | accepted 2/7 draft tokens, new n_tokens = 24\n"
        "0.09.001 D slot operator(): id  3 | task 1 | accepted 7/7 draft tokens, new n_tokens = 40\n"
    )
    assert llamacpp_runs.passes(log) == [(7, 0), (7, 2), (7, 7)]


def test_margins_are_the_gap_between_the_two_likeliest_tokens():
    import math

    response = {
        "completion_probabilities": [
            {"top_logprobs": [{"logprob": math.log(0.6)}, {"logprob": math.log(0.3)}]},
            {"top_logprobs": [{"logprob": math.log(0.41)}, {"logprob": math.log(0.4)}]},
            {"top_logprobs": [{"logprob": 0.0}]},
        ]
    }
    gaps = llamacpp_runs.margins(response)
    assert gaps[0] == pytest.approx(0.3) and gaps[1] == pytest.approx(0.01) and gaps[2] is None


def test_an_answer_may_part_from_plain_only_at_a_near_tie():
    plain = [[1, 2, 3, 4], [5, 6, 7]]
    gaps = [[0.9, 0.5, 0.01, 0.4], [0.8, 0.7, 0.6]]
    ok, partings = llamacpp_runs.near_tie_problems({"head": [[1, 2, 9, 9], [5, 6, 7]]}, plain, gaps, tie=0.02)
    assert ok == [] and partings == [("head", 0, 2, 0.01)]
    bad, _ = llamacpp_runs.near_tie_problems({"head": [[1, 2, 3, 4], [5, 9, 9]]}, plain, gaps, tie=0.02)
    assert len(bad) == 1 and "prompt 1 at token 1" in bad[0] and "0.7000" in bad[0]


def test_the_command_line_refuses_bad_sizes():
    with pytest.raises(SystemExit):
        cl.parse_args(["--head", "x", "--k", "0"])


@pytest.mark.llamacpp
@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_the_gguf_export_equals_llama_cpps_converter(tmp_path, smollm2, kind):
    """A SmolLM2 head exported as the checkpoint llama.cpp's converter reads ("dflash"; "speculators" for EAGLE-3),
    fp32, converted by the sdist's convert_hf_to_gguf.py, against `export --format gguf` of the same head: every
    tensor the converter writes, byte for byte, and its keys; the converter's own file imports back."""
    import gguf
    import numpy as np

    from eagletree.draft import DFlashHead, Eagle3Head
    from eagletree.export.convert import export_head, import_folder
    from eagletree.target import resolve_target

    model, _ = smollm2
    torch.manual_seed(0)
    if kind == "dflash":
        head = DFlashHead.for_target(model, None, block_size=8).eval()
    else:
        head = Eagle3Head.for_target(model, torch.arange(0, model.config.vocab_size, 6)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # (every tensor distinct, norms too)
    ours = export_head(head, tmp_path / "gguf", "gguf", dtype=torch.float32, target=model) / "model.gguf"
    theirs = tmp_path / "foreign" / "model.gguf"
    source = "dflash" if kind == "dflash" else "speculators"
    checkpoint = export_head(head, tmp_path / source, source, dtype=torch.float32, target=model)
    command = [*llamacpp_build.converter(), str(checkpoint), "--target-model-dir", str(resolve_target("smollm2-135m"))]
    theirs.parent.mkdir()
    subprocess.run([*command, "--outfile", str(theirs), "--outtype", "f32"], check=True, capture_output=True)
    a, b = gguf.GGUFReader(str(theirs)), gguf.GGUFReader(str(ours))
    skip = {"general.name", "general.size_label", "GGUF.kv_count"}
    for key, field in a.fields.items():
        if key not in skip:
            assert key in b.fields and b.fields[key].contents() == field.contents(), key
            assert b.fields[key].types == field.types, key
    mine = {t.name: t for t in b.tensors}
    assert set(mine) == {t.name for t in a.tensors}
    for t in a.tensors:
        assert t.tensor_type == mine[t.name].tensor_type and list(t.shape) == list(mine[t.name].shape), t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(mine[t.name].data)), t.name
    back = import_folder(theirs.parent, model if kind == "eagle3" else model.config)
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


@pytest.mark.llamacpp
def test_llama_cpp_serves_a_block_head_as_eagletree_drafts_it(tmp_path, smollm2):
    """An untrained SmolLM2 block head (its acceptance near 0 in both engines: this checks the pipeline and the
    answers; docs/results.md has the trained head's run)."""
    from eagletree.draft import DFlashHead

    model, _ = smollm2
    torch.manual_seed(0)
    DFlashHead.for_target(model, None, block_size=4).save_pretrained(tmp_path / "head")
    args = ["--head", str(tmp_path / "head"), "--k", "3", "--prompts", "4", "--max-new-tokens", "40"]
    assert cl.main([*args, "--work", str(tmp_path / "work")]) == 0


def test_each_steps_phases_are_read_from_the_servers_timestamps(tmp_path):
    """A drafted step (two draft calls, a pass over 3 tokens) and one that drafted nothing (one call, a pass over
    the token alone), closed by the answer's end."""
    log = tmp_path / "server.log"
    lines = [
        "0.01.000.000 D slot get_n_draft_: id  0 | task 0 | max possible draft: 60",
        "0.01.002.000 D spec        draft:  - seq_id 0, draft candidate   0, pos   0:   812 (   0.610) ' the'",
        "0.01.002.001 D spec        draft:  - seq_id 0, draft candidate   1, pos   0:    11 (   0.100) ','",
        "0.01.004.000 D spec        draft:  - seq_id 0, draft candidate   0, pos   1:  2201 (   0.300) ' cat'",
        "0.01.004.500 D slot handle_last_: id  0 | task 0 | generate_draft: id=339, #tokens=54, #draft=2, pos_next=54",
        "0.01.005.000 D srv        decode: n_batch (effective) = 2048, off = 0",
        "0.01.025.000 D que  yield_to_que: done yielding to queue",
        "0.01.027.000 D slot   operator(): id  0 | task 0 | accepted 1/2 draft tokens, new n_tokens = 24",
        "0.01.028.000 D slot get_n_draft_: id  0 | task 0 | max possible draft: 58",
        "0.01.030.000 D spec        draft:  - seq_id 0, draft candidate   0, pos   0:    42 (   0.050) ' a'",
        "0.01.030.500 D slot handle_last_: id  0 | task 0 | slot decode token, id=30, n_ctx = 4096, n_tokens = 72",
        "0.01.031.000 D srv        decode: n_batch (effective) = 2048, off = 0",
        "0.01.041.000 D que  yield_to_que: done yielding to queue",
        "0.01.042.000 I slot      release: id  0 | task 0 | stop processing: n_tokens = 80, truncated = 0",
    ]
    log.write_text("\n".join(lines) + "\n")
    steps = llamacpp_runs.step_timeline(log, call_per_draft=True)
    assert [(s["size"], s["calls"]) for s in steps] == [(3, 2), (1, 1)]
    assert [round(s["draft_ms"], 3) for s in steps] == [4.5, 2.5]
    assert [round(s["verify_ms"], 3) for s in steps] == [20.0, 10.0]
    assert [round(s["after_ms"], 3) for s in steps] == [3.0, 1.0]
    blocks = llamacpp_runs.step_timeline(log, call_per_draft=False)  # a block head: its call is the pos-0 line
    assert [(s["size"], s["calls"]) for s in blocks] == [(3, 1), (1, 1)]


def test_the_step_costs_are_fitted_to_the_timed_runs_over_the_debug_runs_steps():
    profile = importlib.util.spec_from_file_location("profile_llamacpp", ROOT / "scripts" / "profile_llamacpp.py")
    pl = importlib.util.module_from_spec(profile)
    profile.loader.exec_module(pl)

    def steps(count, size, calls):  # drafting 2 ms a call, the target's pass 3/4 of a drafting step
        return [
            {"size": size, "calls": calls, "draft_ms": 2.0 * calls, "verify_ms": 30.0, "after_ms": 10.0 - 2 * calls}
        ]

    timelines = [steps(1, 2, 1) * 10, steps(1, 3, 2) * 10, steps(1, 1, 1) * 6 + steps(1, 2, 2) * 4]
    # truth: a plain token 10 ms, a step drafting nothing 12, one draft 20, each further draft 5, a stop call 2
    runs = [{"ms": 10 * 20.0}, {"ms": 10 * 25.0}, {"ms": 6 * 12.0 + 4 * 20.0 + 4 * 2.0}]
    costs, residuals = pl.fit(runs, timelines, plain_ms=10.0)
    assert costs == pytest.approx(
        {"empty_ms": 12.0, "one_ms": 20.0, "draft_ms": 5.0, "stop_call_ms": 2.0, "target_share": 0.75}
    )
    assert max(map(abs, residuals)) < 1e-9
    assert pl.counts(timelines[2]) == {"sizes": [0, 6, 4], "calls": [0, 6, 8]}
    assert pl.default_settings(True, None)[-1] == (1, 0.5) and max(k for k, _ in pl.default_settings(False, 3)) == 3


def test_a_plans_check_judges_ratios_to_plain():
    from engines import llamacpp_plan_check as pc

    head = {"mode": "head", "threads": 2, "k": 1, "p_min": 0.0, "tokens_per_s": 60.0}
    plan = {"choice": {"mode": "plain", "threads": 2, "tokens_per_s": 100.0}, "best_head": head}
    plan["options"] = [plan["choice"], {"mode": "plain", "threads": 1, "tokens_per_s": 70.0}, head]
    rows = pc.settings(plan)
    assert list(rows) == ["plain", "best head"]  # the choice is plain itself: served once
    # the machine ran 20% slower than at the profile: the ratios still hold
    ok = pc.judge(rows, {"plain": 80.0, "best head": 49.0}, 16)
    assert ok["ok"] and ok["rows"]["best head"]["ratio_error"] == pytest.approx(49 / 80 / 0.6 - 1)
    bad = pc.judge(rows, {"plain": 80.0, "best head": 40.0}, 16)
    assert not bad["ok"] and "best head" in bad["problems"][0]
    head_plan = {"choice": head | {"tokens_per_s": 130.0}, "best_head": head | {"tokens_per_s": 130.0}}
    head_plan["options"] = [{"mode": "plain", "threads": 2, "tokens_per_s": 100.0}, head_plan["choice"]]
    rows = pc.settings(head_plan)
    assert list(rows) == ["plain", "choice"]
    slower = pc.judge(rows, {"plain": 100.0, "choice": 98.0}, 16)
    assert any("below plain" in p for p in slower["problems"])
    assert pc.flags(head, "h.gguf", "draft-eagle3") == [
        *("-md", "h.gguf", "--spec-type", "draft-eagle3", "--spec-draft-n-max", "1", "--spec-draft-p-min", "0.0")
    ]

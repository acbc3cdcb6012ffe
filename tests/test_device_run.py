"""The prepared GPU run (scripts/device/): pre-tokenized data, pieces and their checks, the stage runner,
the device checks on CPU, and the rehearsal: pack, unpack into a fresh folder, run every stage (dry run)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eagletree.train import pretokenized
from eagletree.train.data import DataError
from eagletree.train.loop import TrainConfig, train
from eagletree.train.render import render

from helpers import tiny_conversations, tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parent.parent
DEVICE = REPO / "scripts" / "device"
sys.path.insert(0, str(DEVICE))

import checks  # noqa: E402
import run as device_run  # noqa: E402


def test_pretokenized_round_trip_and_refusals(tmp_path):
    tok = tiny_tokenizer()
    records = [render(tok, c.messages, max_len=20) for c in tiny_conversations(6)]
    path = tmp_path / "d.npz"
    header = pretokenized.save(path, records, tok, source="tiny", max_len=20)
    assert header["records"] == 6 and header["truncated"] == sum(r.truncated for r in records) > 0
    back, read = pretokenized.load(path, tok)
    assert read == header == pretokenized.read_header(path)
    for a, b in zip(records, back):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert a.truncated == b.truncated
    other = tiny_tokenizer()
    other.chat_template = "{{ messages }}"
    with pytest.raises(DataError, match="made with tokenizer .* pack it again"):
        pretokenized.load(path, other)
    old = tmp_path / "old.npz"  # written before the loss masks changed (version 3 starts them at the answer's text)
    header.pop("masks")
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files} | {"header": np.array(json.dumps(header))}
    np.savez_compressed(old, **arrays)
    with pytest.raises(
        DataError, match=r"old.npz: made with no loss-mask version .* renders version \d+ .* pack it again"
    ):
        pretokenized.load(old, tok)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match="cut.npz"):
        pretokenized.load(cut)
    # every other way the file can be wrong is a DataError naming it (a single .npy array once escaped as a TypeError)
    np.save(tmp_path / "array.npy", np.arange(3))
    (tmp_path / "array.npz").write_bytes((tmp_path / "array.npy").read_bytes())
    (tmp_path / "text.npz").write_text("not a zip")
    np.savez_compressed(
        tmp_path / "store.npz",
        tokens=np.arange(3),
        header=np.array(json.dumps({"format": "eagletree-datastore", "version": 1})),
    )
    np.savez_compressed(tmp_path / "nohead.npz", ids=np.arange(3))
    np.savez_compressed(
        tmp_path / "nocounts.npz",
        **(arrays | {"header": np.array(json.dumps({"format": "eagletree-pretokenized", "version": 1}))}),
    )
    for name, message in [
        ("array.npz", r"not a pre-tokenized data file \(a single array, not an .npz archive\)"),
        ("text.npz", "not a pre-tokenized data file"),
        ("store.npz", "format 'eagletree-datastore' version 1, expected 'eagletree-pretokenized'"),
        ("nohead.npz", "not a pre-tokenized data file \\(no readable header"),
        ("missing.npz", "pre-tokenized data '.*missing.npz' does not exist"),
    ]:
        for read in (pretokenized.load, pretokenized.read_header):
            with pytest.raises(DataError, match=message):
                read(tmp_path / name)
    with pytest.raises(DataError, match="the header's records and tokens must be counts, got None and None"):
        pretokenized.load(tmp_path / "nocounts.npz")
    big = records[0].__class__(torch.tensor([70_000]), torch.tensor([True]), False)
    with pytest.raises(DataError, match="token id 70000 does not fit the uint16 format"):
        pretokenized.save(tmp_path / "big.npz", [big], tok)


def test_training_on_pretokenized_records_equals_training_on_conversations(tmp_path):
    tok, convs = tiny_tokenizer(), tiny_conversations(8)
    path = tmp_path / "d.npz"
    pretokenized.save(path, [render(tok, c.messages, max_len=30) for c in convs], tok)
    records, _ = pretokenized.load(path, tok)
    heads = []
    for name, data in (("conv", convs), ("pre", records)):
        cfg = TrainConfig(
            out_dir=str(tmp_path / name),
            report_to="none",
            steps=4,
            grad_accum=2,
            save_every=4,
            warmup_steps=1,
            max_len=24,
            lr=1e-3,
            device="cpu",
            draft_vocab=40,
            draft_vocab_sample=4,
        )
        heads.append(train(cfg, model_and_tokenizer=(tiny_model("llama"), tok), conversations=data, progress=False))
    (a, sa), (b, sb) = heads
    assert sa["truncated"] == sb["truncated"] > 0 and sa["tokens"] == sb["tokens"]  # cut again to max_len 24
    assert torch.equal(a.d2t, b.d2t)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def _pieces(tmp_path, contents: dict) -> Path:
    folder = tmp_path / "pieces"
    folder.mkdir()
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    manifest = {
        "format": device_run.FORMAT,
        "payload": "c",
        "pieces": [{"name": n, "bytes": len(d), "sha256": device_run.sha256(folder / n)} for n, d in contents.items()],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_check_names_missing_and_corrupted_pieces(tmp_path, capsys):
    folder = _pieces(tmp_path, {"a": b"one", "b": b"two", "c": b"three"})
    assert device_run.check(folder) == 0
    (folder / "b").unlink()
    assert device_run.check(folder) == 3
    assert "still to upload: b" in capsys.readouterr().out
    (folder / "b").write_bytes(b"twx")
    assert device_run.check(folder) == 1
    assert "piece b (0.0 MiB): sha256" in capsys.readouterr().out
    (folder / "b").write_bytes(b"tw")
    assert device_run.check(folder) == 1
    assert "2 bytes, expected 3" in capsys.readouterr().out
    with pytest.raises(device_run.PieceError, match="pieces not ready: b: 2 bytes"):
        device_run.unpack(folder, tmp_path / "work")
    (folder / "manifest.json").unlink()
    with pytest.raises(device_run.PieceError, match="manifest.json is missing"):
        device_run.check(folder)


def test_a_stage_past_its_limit_is_killed_and_recorded(tmp_path):
    python, env = device_run.stage_env(tmp_path, simulate=False, hide=())
    result = device_run.run_stage(python, env, "env", 0.5, tmp_path, tmp_path / "out", dry_run=True)
    assert result["status"] == "timeout" and result["seconds"] < 5
    assert (tmp_path / "out" / "env" / "log.txt").is_file()


def test_chi_square_p_matches_scipy_and_rejects():
    from scipy.stats import chisquare

    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    counts = torch.tensor([96.0, 212.0, 290.0, 402.0])
    assert checks.chi_square_p(counts, probs) == pytest.approx(chisquare(counts.numpy(), (probs * 1000).numpy()).pvalue)
    assert checks.chi_square_p(torch.tensor([400.0, 200.0, 200.0, 200.0]), probs) < 1e-6
    assert checks.chi_square_p(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == 0.0


def test_device_checks_pass_on_cpu():
    greedy = checks.greedy_check("cpu", torch.float32, kinds=("llama",), prompts=2, max_new=10)
    assert greedy["ok"] and greedy["identical"] == greedy["sequences"] == 6, greedy  # 2 prompts x 3 runs
    assert checks.sampled_check("cpu", draws=400)["ok"]
    tree = checks.tree_pass_check("cpu", torch.float32, kinds=("qwen2",), sizes=(1, 9))
    assert tree["ok"] and tree["max_abs_diff"] < 1e-4 and tree["trees"] == 2


@pytest.mark.real
def test_rehearsal_packs_unpacks_into_a_fresh_folder_and_runs_every_stage(tmp_path):
    """The device's sequence on CPU: pack, check, run --dry-run with only what the device has (python -S,
    no gguf/scipy/datasets/... from this machine: the carried gguf package and data only)."""
    share = tmp_path / "share.jsonl"
    share.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"c{i}",
                    "conversations": [
                        {"from": "human", "value": f"Say something about the number {i}."},
                        {"from": "gpt", "value": f"The number {i} is a fine number, and here is a sentence about it."},
                    ],
                }
            )
            + "\n"
            for i in range(12)
        )
    )
    distill = tmp_path / "distill.jsonl"
    distill.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"d{i}",
                    "messages": [
                        {"role": "user", "content": f"Count to {i}."},
                        {"role": "assistant", "content": " ".join(map(str, range(i)))},
                    ],
                    "finish": "eos",
                }
            )
            + "\n"
            for i in range(2, 8)
        )
    )
    pieces = tmp_path / "pieces"
    py = sys.executable
    subprocess.run(
        [
            py,
            str(DEVICE / "pack.py"),
            "--out",
            str(pieces),
            "--dataset",
            str(share),
            "--distill",
            str(distill),
            "--max-len",
            "96",
        ],
        check=True,
        cwd=REPO,
    )
    manifest = json.loads((pieces / "manifest.json").read_text())
    assert [p["name"] for p in manifest["pieces"]][-1] == "payload.tar" and len(manifest["pieces"]) == 3
    assert manifest["data"]["distill"]["records"] >= 5 and manifest["data"]["sharegpt"]["records"] >= 10
    assert subprocess.run([py, str(DEVICE / "run.py"), "check", "--pieces", str(pieces)], cwd=REPO).returncode == 0
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            py,
            str(DEVICE / "run.py"),
            "run",
            "--pieces",
            str(pieces),
            "--out",
            str(out),
            "--dry-run",
            "--simulate-device",
            "--work-root",
            str(tmp_path / "work"),
            "--scale",
            "4",
            "--limit",
            "3000",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    record = json.loads((out / "run.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [s["stage"] for s in record["stages"]] == ["env", "checks", "profile", "smollm2", "train"]
    assert all(s["status"] == "ok" for s in record["stages"]), record
    env = json.loads((out / "env" / "results.json").read_text())["packages"]
    assert env["scipy"].startswith("missing") and env["datasets"].startswith("missing")
    assert str(tmp_path / "work") in env["gguf"]  # the carried package, not this machine's
    assert all(c["ok"] for c in json.loads((out / "checks" / "results.json").read_text()).values())
    assert json.loads((out / "profile" / "profile.json").read_text())["rows"][0]["n"] == 1
    bench = json.loads((out / "smollm2" / "results.json").read_text())
    assert {r["method"] for r in bench["results"]} == {"plain", "eagle2", "auto"}
    assert all(r["identical"] for r in bench["results"] if r["temperature"] == 0)
    trained = json.loads((out / "train" / "results.json").read_text())
    assert trained["conversations"] == manifest["data"]["sharegpt"]["records"] + manifest["data"]["distill"]["records"]
    assert (
        trained["mtbench"]["trained"]["tokens_per_pass"] >= 1.0
        and (out / "train" / "head" / "model.safetensors").is_file()
    )
    assert not list((tmp_path / "work").iterdir())  # the unpacked folder is removed after the run


def test_docs_gpu_section_names_the_stages_limits_and_pieces_the_code_uses():
    from eagletree.target import ALIASES

    results = (REPO / "docs" / "results.md").read_text()
    section = results[results.index("## The GPU run (prepared, not run)") :]
    table = {m.group(1): int(m.group(2)) for m in re.finditer(r"^   \| (\w+) \| (\d+) s \|", section, re.M)}
    assert table == dict(device_run.STAGES)
    assert f"within {device_run.RUN_LIMIT:.0f} s in all" in section
    gguf = ALIASES["smollm2-135m"][1]
    for piece in (f"{gguf}.1", f"{gguf}.2", "payload.tar", "manifest.json"):
        assert f"device-pieces/{piece}" in section, piece

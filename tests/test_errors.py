"""Nothing lost, every bad input one clear error: output folders, leftovers, permissions (issue 17)."""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from eagletree.cli import main
from eagletree.draft import EagleHead
from eagletree.loading import load_head  # any head folder: an export is imported

from helpers import tiny_model


@pytest.fixture
def saved_head(tmp_path):
    model = tiny_model("llama")
    head = EagleHead.for_target(model.config)
    head.save_pretrained(tmp_path / "head")
    (tmp_path / "head" / "calibration.json").write_text("{}")
    return model, tmp_path / "head"


def _export(head_dir, out, *extra):
    return main(["export", "--head", str(head_dir), "--format", "eagle", "--out", str(out), "--dtype", "fp32", *extra])


def test_export_into_the_current_or_a_parent_folder_is_refused(saved_head, tmp_path, monkeypatch, capsys):
    _, head_dir = saved_head
    here = tmp_path / "work" / "here"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    for out, extra in ((".", ()), ("..", ("--overwrite",)), (str(here), ())):  # (".": 'has an empty name' before)
        assert _export(head_dir, out, *extra) == 2
        assert "is the current folder or holds it; the output folder is replaced as a whole" in capsys.readouterr().err
    assert list(here.iterdir()) == [] and [p.name for p in here.parent.iterdir()] == ["here"]
    assert _export(head_dir, "out") == 0 and (here / "out" / "config.json").is_file()  # a folder below is fine


def test_export_under_a_file_is_refused_before_the_head_is_read(saved_head, tmp_path, monkeypatch, capsys):
    import eagletree.loading as loading

    _, head_dir = saved_head
    (tmp_path / "afile").write_text("x")
    monkeypatch.setattr(loading, "load_head", lambda *a, **k: pytest.fail("the head was read first"))
    assert _export(head_dir, tmp_path / "afile" / "x") == 2
    assert f"--out '{tmp_path / 'afile' / 'x'}': '{tmp_path / 'afile'}' is a file" in capsys.readouterr().err


def test_export_refuses_a_non_empty_out_and_overwrite_keeps_other_files(saved_head, tmp_path, capsys):
    model, head_dir = saved_head
    out = tmp_path / "x"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("n")
    assert _export(head_dir, out) == 2
    assert "is not empty (it holds notes.txt, sub); pass --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "sub"]
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []
    assert _export(head_dir, out, "--overwrite") == 0
    assert {"config.json", "model.safetensors", "notes.txt", "sub"} <= {p.name for p in out.iterdir()}
    assert (out / "notes.txt").read_text() == "n"
    load_head(out, target_config=model.config)
    assert _export(head_dir, tmp_path / "empty") == 0  # absent: created
    (tmp_path / "e2").mkdir()
    assert _export(head_dir, tmp_path / "e2") == 0  # empty: filled


def test_export_and_import_never_write_onto_their_source(saved_head, tmp_path, capsys):
    _, head_dir = saved_head
    before = {p.name: p.read_bytes() for p in head_dir.iterdir()}
    for extra in ((), ("--overwrite",)):
        assert _export(head_dir, head_dir, *extra) == 2
        assert "is the source" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in head_dir.iterdir()} == before
    assert _export(head_dir, tmp_path / "ex") == 0
    assert (
        main(
            [
                "import",
                "--eagle",
                str(tmp_path / "ex"),
                "--target",
                str(tmp_path / "nowhere"),
                "--out",
                str(tmp_path / "ex"),
                "--overwrite",
            ]
        )
        == 2
    )
    assert "is the source" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert _export(head_dir, tmp_path / "file", "--overwrite") == 2
    assert "is a file; expected a folder" in capsys.readouterr().err


def test_import_keeps_a_heads_other_files_and_names_bad_inputs(saved_head, tmp_path, capsys):
    model, head_dir = saved_head
    target = tmp_path / "target"
    model.save_pretrained(target)
    assert _export(head_dir, tmp_path / "ex") == 0
    existing = tmp_path / "existing"
    EagleHead.for_target(model.config).save_pretrained(existing)
    (existing / "calibration.json").write_text("{}")
    (existing / "metrics.json").write_text("{}")
    imp = ["import", "--eagle", str(tmp_path / "ex"), "--target", str(target), "--out", str(existing)]
    assert main(imp) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert main(imp + ["--overwrite"]) == 0
    # the other files stay, but not the replaced head's calibration: decoding would apply it to the new head
    assert sorted(p.name for p in existing.iterdir()) == ["config.json", "metrics.json", "model.safetensors"]
    with pytest.raises(SystemExit):  # and import --help says so
        main(["import", "--help"])
    assert "delete the calibration.json and copy_calibration*.json" in " ".join(capsys.readouterr().out.split())
    load_head(existing, target_config=model.config)
    # an eagletree head is not an EAGLE export; a broken config.json is named
    assert main(["import", "--eagle", str(head_dir), "--target", str(target), "--out", str(tmp_path / "o")]) == 2
    assert "is an eagletree head (head_type 'eagle'), not an EAGLE export" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert (
        main(["import", "--eagle", str(tmp_path / "bad"), "--target", str(target), "--out", str(tmp_path / "o")]) == 2
    )
    assert f"{tmp_path / 'bad' / 'config.json'} is not a readable JSON config" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_written_folders_follow_the_umask(saved_head, tmp_path):
    _, head_dir = saved_head
    old = os.umask(0o022)
    try:
        assert _export(head_dir, tmp_path / "pub") == 0
        EagleHead.for_target(tiny_model("llama").config).save_pretrained(tmp_path / "h2")
    finally:
        os.umask(old)
    for folder in (tmp_path / "pub", tmp_path / "h2"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755
        for f in folder.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_cached_files_are_written_whole_and_follow_the_umask(tmp_path):
    """Latency profiles, kernel choices, plans, copy calibrations and feature shards go through files.writing: a
    failed write leaves the old file and no temporary one; a new file is not private to its owner (mkstemp's or
    safetensors' 0600)."""
    import json

    from safetensors.torch import save_file

    from eagletree.files import write_json_atomic, writing
    from eagletree.search import LatencyProfile

    old = os.umask(0o022)
    try:
        path = tmp_path / "cache" / "profile.json"
        LatencyProfile([1, 8], [0.01, 0.02]).save(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644 and LatencyProfile.load(path).verify_s == [0.01, 0.02]
        with pytest.raises(TypeError):  # not JSON-serializable: the write fails part-way
            write_json_atomic(path, {"sizes": [1], "bad": object()})
        with pytest.raises(KeyboardInterrupt), writing(path) as tmp:
            tmp.write_text("half")
            raise KeyboardInterrupt
        assert json.loads(path.read_text())["verify_s"] == [0.01, 0.02]
        assert sorted(p.name for p in path.parent.iterdir()) == ["profile.json"]
        shard = tmp_path / "features" / "shard-00000.safetensors"  # how feature shards are written
        with writing(shard) as tmp:
            save_file({"x": torch.zeros(2)}, str(tmp))  # (safetensors makes its files 0600)
        assert stat.S_IMODE(shard.stat().st_mode) == 0o644
    finally:
        os.umask(old)


def test_a_published_folder_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    """Heads, exports and checkpoints are published by a rename; their files are flushed (fsync) before it, so a
    power loss cannot leave the new name over files the disk never received."""
    from eagletree import files

    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: renamed.append((str(a), len(synced))) or real_replace(a, b))
    with files.building(tmp_path / "out") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "model.safetensors").write_bytes(b"x" * 100)
        (tmp / "sub" / "config.json").write_text("{}")
    files.publish(tmp, tmp_path / "out")
    assert renamed == [(str(tmp), len(synced))]  # one rename, after every flush
    assert sorted(synced) == sorted(
        str(p) for p in (tmp, tmp / "sub", tmp / "model.safetensors", tmp / "sub" / "config.json")
    )
    assert (tmp_path / "out" / "sub" / "config.json").read_text() == "{}"


KILLED_WRITER = """
import os, sys
from eagletree.files import building
with building(sys.argv[1]) as tmp:
    (tmp / "model.safetensors").write_bytes(b"x" * 1000)
    print(tmp, flush=True)
    os._exit(9)  # killed: no cleanup runs
"""


def test_a_killed_writers_partial_folder_is_removed_by_the_next_run_a_live_ones_is_kept(saved_head, tmp_path):
    _, head_dir = saved_head
    out = tmp_path / "ex"
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(out)], capture_output=True, text=True)
    left = tmp_path / killed.stdout.strip().rsplit("/", 1)[1]
    assert killed.returncode == 9 and left.is_dir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from eagletree import files

        mine = files.partial_path(out)
        theirs = mine.with_name(mine.name.replace(f"-{os.getpid()}-", f"-{live.pid}-"))
        theirs.mkdir()
        assert _export(head_dir, out) == 0
        assert not left.exists() and theirs.is_dir()
    finally:
        live.kill()
        live.wait()


@pytest.fixture
def tiny_cli(tmp_path, monkeypatch):
    from helpers import tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    EagleHead.for_target(model.config).save_pretrained(tmp_path / "head")
    loads = []
    monkeypatch.setattr(
        "eagletree.target.load_target", lambda spec, dtype=None, device=None: loads.append(spec) or (model, tok)
    )
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    return loads, ["--target", "tiny", "--head", str(tmp_path / "head"), "--max-new-tokens", "4"]


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--depth", "0", "--depth must be >= 1, got 0"),
        ("--depth", "-2", "--depth must be >= 1, got -2"),
        ("--top-p", "2", "--top-p must be > 0 and <= 1.0, got 2.0"),
        ("--top-p", "0", "--top-p must be > 0"),
        ("--top-k-draft", "0", "--top-k-draft must be >= 1, got 0"),
        ("--budget", "0", "--budget must be >= 1"),
        ("--temperature", "-1", "--temperature must be >= 0"),
        ("--temperature", "nan", "--temperature must be a finite"),
        ("--temperature", "1e-300", "--temperature must be 0 (greedy) or >= 1e-20, got 1e-300"),
        ("--top-k", "-1", "--top-k must be >= 0"),
        ("--max-new-tokens", "-3", "--max-new-tokens must be >= 1"),
        ("--max-new-tokens", "0", "--max-new-tokens must be >= 1, got 0"),
        ("--seed", "-1", "--seed must be >= 0"),
    ],
)
def test_decoding_options_out_of_range_are_one_line_naming_the_option(tiny_cli, capsys, option, value, message):
    loads, args = tiny_cli
    assert main(["generate", *args, "--prompt", "hello", option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert loads == []  # refused before the model is loaded


def test_decoding_options_are_checked_in_the_python_api():
    from eagletree.decode import generate

    from helpers import tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    for bad, message in (
        ({"depth": 0}, "depth must be >= 1, got 0"),
        ({"top_p": 2.0}, "top_p must be > 0 and <= 1"),
        ({"top_k_draft": 0}, "top_k_draft must be >= 1"),
        ({"temperature": float("inf")}, "finite"),
        ({"temperature": 1e-30}, r"temperature must be 0 \(greedy\) or >= 1e-20"),
    ):
        with pytest.raises(ValueError, match=message):
            generate(model, tok, head, "hello", max_new_tokens=4, **bad)


def test_a_prompt_that_is_not_utf8_is_refused_and_chat_goes_on(tiny_cli, capsys, monkeypatch):
    import io

    _, args = tiny_cli
    bad = b"caf\xff".decode("utf-8", "surrogateescape")  # how Python passes such an argument
    assert main(["generate", *args, "--prompt", bad]) == 2
    assert "--prompt is not valid UTF-8 text (byte 0xff at character 3)" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{bad}\nhello\n\n"))
    assert main(["chat", *args]) == 0
    err = capsys.readouterr().err
    assert "that line is not valid UTF-8 text" in err and err.count("tokens/pass") == 1


def test_a_cuda_device_without_cuda_is_one_clear_error(monkeypatch):
    from eagletree.target import TargetError, load_target

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TargetError, match="device 'cuda': CUDA is not available on this machine"):
        load_target("smollm2-135m", device="cuda")
    with pytest.raises(TargetError, match="device 'gpu0' is not a device name"):
        load_target("smollm2-135m", device="gpu0")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(TargetError, match="device 'mps': MPS is not available on this machine"):
        load_target("smollm2-135m", device="mps")  # (was taken, and failed inside transformers' loading)
    with pytest.raises(TargetError, match="device 'meta' is not supported; expected cpu or cuda"):
        load_target("smollm2-135m", device="meta")
    from eagletree.train.loop import TrainConfig, train

    with pytest.raises(TargetError, match="device 'cuda': CUDA is not available"):  # not a silent CPU run
        train(TrainConfig(device="cuda", report_to="none"), conversations=[], progress=False)


def _train_main(argv):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("train_script", Path(__file__).parent.parent / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_train_py_turns_bad_inputs_into_one_line_and_leaves_no_empty_out_dir(tmp_path, capsys):
    out = tmp_path / "run"
    common = [f"out_dir={out}", "report_to=none", "device=cpu"]
    (tmp_path / "broken.yaml").write_text("steps: [1,\n")
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{oops\n')
    cases = [
        (["--config", str(tmp_path / "missing.yaml")], "missing.yaml' cannot be read"),
        (["--config", str(tmp_path / "broken.yaml")], "broken.yaml' is not valid YAML"),
        (["--config", str(tmp_path / "empty.yaml")], "empty.yaml' sets no key (empty, or comments only)"),
        ([f"dataset={tmp_path / 'nowhere.jsonl'}"], "nowhere.jsonl' does not exist"),
        ([f"dataset={tmp_path / 'empty.jsonl'}"], "empty.jsonl' is empty"),
        ([f"dataset={tmp_path / 'bad.jsonl'}"], "bad.jsonl: line 2 is not valid JSON"),
        (["lr=abc"], "config key 'lr' must be a number, got 'abc'"),
    ]
    for argv, message in cases:
        assert _train_main(argv + common) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
        assert not out.exists(), argv


def test_float_keys_take_what_float_takes_and_ranges_are_checked(tmp_path):
    from eagletree.train.loop import TrainConfig, TrainingError

    assert TrainConfig.from_sources(None, ["lr=1e-4"]).lr == 1e-4
    (tmp_path / "c.yaml").write_text("lr: 1.0e10\nnoise: 2E-1\nclip: 1\n")
    cfg = TrainConfig.from_sources(tmp_path / "c.yaml")
    assert (cfg.lr, cfg.noise, cfg.clip) == (1.0e10, 0.2, 1.0)
    for bad, message in (
        ("lr=nan", "'lr' must be a finite number"),
        ("lr=0", "'lr' must be > 0.0, got 0.0"),
        ("lr=-1e-3", "'lr' must be > 0.0"),
        ("min_lr_ratio=1.5", "'min_lr_ratio' must be in [0, 1]"),
        ("warmup_steps=-1", "'warmup_steps' must be >= 0"),
        ("lr=true", "'lr' must be float"),
    ):
        with pytest.raises(TrainingError, match=message.replace("[", r"\[").replace("]", r"\]")):
            TrainConfig.from_sources(None, [bad])


def _tiny_cfg(tmp_path, **kw):
    from eagletree.train.loop import TrainConfig

    base = dict(
        out_dir=str(tmp_path),
        report_to="none",
        steps=6,
        grad_accum=2,
        save_every=2,
        warmup_steps=2,
        max_len=40,
        lr=1e-3,
        device="cpu",
        dataset="tiny-chats",
    )
    return TrainConfig(**(base | kw))


def _run(cfg, resume=False, conversations=None, **kw):
    from eagletree.train.loop import train

    from helpers import tiny_conversations, tiny_tokenizer

    return train(
        cfg,
        resume=resume,
        model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
        conversations=conversations or tiny_conversations(12),
        progress=False,
        **kw,
    )


def test_no_trainable_tokens_is_an_error_naming_the_dataset_and_saves_no_head(tmp_path):
    from eagletree.train.data import Conversation
    from eagletree.train.loop import TrainingError

    users_only = [Conversation(f"u{i}", [{"role": "user", "content": "hello how are you"}]) for i in range(4)]
    with pytest.raises(
        TrainingError, match="dataset 'tiny-chats': none of its 4 training conversations has an assistant turn"
    ):
        _run(_tiny_cfg(tmp_path / "a"), conversations=users_only)
    with pytest.raises(TrainingError, match=r"dataset 'tiny-chats': 2 steps saw no assistant token .* 4 dropped"):
        _run(_tiny_cfg(tmp_path / "b", steps=2, max_len=3, long="drop"))
    assert not (tmp_path / "b" / "head").exists()


def test_resume_refuses_changed_run_keys_unless_allowed_and_then_applies_them(tmp_path):
    from eagletree.train.config import TrainingError
    from eagletree.train.config import lr_lambda as _lr_lambda

    _run(_tiny_cfg(tmp_path, stop_after=4))
    with pytest.raises(
        TrainingError,
        match=r"changed run-defining keys: max_len 40 -> 30, lr 0.001 -> 0.002; "
        "pass --allow-changes",
    ):
        _run(_tiny_cfg(tmp_path, lr=2e-3, max_len=30), resume=True)
    _run(_tiny_cfg(tmp_path, save_every=3), resume=True)  # where and how often it saves is not the run
    assert (tmp_path / "checkpoints" / "step-0000006").is_dir()
    # once more from step 4 with a new lr: the schedule follows it from there
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "step-0000006")
    new = _tiny_cfg(tmp_path, lr=2e-3)
    _run(new, resume=True, allow_changes=True)
    records = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[4]["lr"] == pytest.approx(2e-3 * _lr_lambda(new)(4))  # step 5 ran at the new lr
    assert records[3]["lr"] == pytest.approx(1e-3 * _lr_lambda(new)(3))


def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys):
    from eagletree.train.loop import TrainingError

    straight, _ = _run(_tiny_cfg(tmp_path / "a"))
    _run(_tiny_cfg(tmp_path / "b", stop_after=4))
    trainer = tmp_path / "b" / "checkpoints" / "step-0000004" / "trainer.pt"
    trainer.write_bytes(trainer.read_bytes()[: trainer.stat().st_size // 2])  # cut, as by a full disk
    resumed, summary = _run(_tiny_cfg(tmp_path / "b"), resume=True)
    err = capsys.readouterr().err
    assert "step-0000004 is damaged" in err and "resuming from" in err and "step-0000002" in err
    assert summary["steps"] == 6
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert (a - b).abs().max() <= 1e-6, name
    for ckpt in (tmp_path / "b" / "checkpoints").iterdir():
        (ckpt / "trainer.pt").write_bytes(b"")
    with pytest.raises(TrainingError, match="no intact checkpoint in .* to resume from: step-0000006"):
        _run(_tiny_cfg(tmp_path / "b"), resume=True)


def _dead_partial(final):
    """A partial folder next to `final` as a killed process of this machine leaves it."""
    from eagletree import files

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    mine = files.partial_path(final)
    left = mine.with_name(mine.name.replace(f"-{os.getpid()}-", f"-{int(gone.stdout)}-"))
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"x" * 100)
    return left


def test_killed_checkpoint_saves_and_de_quantizations_leave_nothing_after_the_next_run(tmp_path, monkeypatch):
    from eagletree.target import loading as target_mod

    left = _dead_partial(tmp_path / "run" / "checkpoints" / "step-0000002")
    _run(_tiny_cfg(tmp_path / "run", steps=2))
    assert not left.exists() and [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-0000002"]
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"not really gguf")
    left = _dead_partial(tmp_path / "cache" / "targets" / f"m-{target_mod._file_digest(gguf)}")
    import transformers

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        target_mod.gguf_to_folder(gguf)  # interrupted too, after removing the killed one's folder
    assert list((tmp_path / "cache" / "targets").iterdir()) == []


def test_a_held_out_split_without_assistant_text_is_an_error_naming_the_dataset(tmp_path):
    from eagletree.train.evaluate import evaluation_conversations
    from eagletree.train.loop import TrainConfig, TrainingError

    data = tmp_path / "users.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "hi"}]}) + "\n" for i in range(40))
    )
    cfg = TrainConfig(dataset=str(data), heldout_fraction=0.5, eval_conversations=2)
    with pytest.raises(TrainingError, match=r"users.jsonl: none of its \d+ held-out conversations has an assistant"):
        evaluation_conversations(cfg)


def test_features_refuses_a_folder_of_other_files_before_loading(tmp_path, monkeypatch, capsys):
    (tmp_path / "todo.txt").write_text("mine")
    monkeypatch.setattr("eagletree.target.load_target", lambda *a, **k: pytest.fail("loaded the target"))
    assert main(["features", "--config", "configs/smollm2-135m-eagle.yaml", f"features_dir={tmp_path}"]) == 2
    assert "holds other files (todo.txt) and no manifest.json" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["todo.txt"]


def test_features_loads_the_target_on_the_configs_device(monkeypatch, tmp_path, capsys):
    seen = []

    def load(spec, dtype=None, device=None):
        seen.append(device)
        raise ValueError("stop here")

    monkeypatch.setattr("eagletree.target.load_target", load)
    base = ["features", "--config", "configs/smollm2-135m-eagle.yaml", f"features_dir={tmp_path / 'f'}"]
    assert main([*base, "device=cpu"]) == 2 and main([*base, "device=cpu", "--device", "meta"]) == 2
    assert seen == ["cpu", "meta"]  # (the config's device was ignored: None, the default device)


def test_commands_that_need_a_head_refuse_head_none_before_loading(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("eagletree.target.load_target", lambda *a, **k: pytest.fail("loaded the target"))
    for argv in (
        ["viz", "--prompt", "hi", "-o", str(tmp_path / "v.html")],
        ["plan", "--engine", "sglang", "-o", str(tmp_path / "p.json")],
        ["calibrate-copy", "--out", str(tmp_path / "c.json")],
    ):
        assert main([*argv, "--head", "none"]) == 2
        assert "--head none" in capsys.readouterr().err, argv
    from eagletree.cli import build_parser

    for command in ("viz", "plan", "calibrate-copy"):
        sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
        assert "'none'" not in next(a for a in sub._actions if a.dest == "head").help  # not offered where refused


def test_the_evaluation_command_checks_its_counts(capsys, tmp_path, monkeypatch):
    from eagletree.train.evaluate import main as evaluate_main

    for flag, value, least in (("--prompts", "0", 1), ("--max-new-tokens", "1", 2), ("--depth", "-1", 1)):
        assert evaluate_main(["--config", "configs/smollm2-135m-eagle.yaml", flag, value]) == 2
        assert f"{flag} must be >= {least}, got {value}" in capsys.readouterr().err
    # --ship onto a file: refused before the evaluation (it ran to the end, then died with a traceback)
    (tmp_path / "dest").write_text("x")
    monkeypatch.setattr("eagletree.train.evaluate.evaluate_run", lambda *a, **k: pytest.fail("evaluated"))
    assert evaluate_main(["--config", "configs/smollm2-135m-eagle.yaml", "--ship", str(tmp_path / "dest")]) == 2
    assert "--ship '" in (err := capsys.readouterr().err) and "dest' is a file; expected a folder" in err


def test_a_damaged_calibration_is_named_with_its_file(tmp_path):
    from eagletree.decode.resources import head_calibrator

    head_dir = tmp_path / "head"
    EagleHead.for_target(tiny_model("llama").config).save_pretrained(head_dir)
    head = EagleHead.from_pretrained(head_dir)
    assert head_calibrator(head) is None  # none saved: the raw probabilities
    (head_dir / "calibration.json").write_text(json.dumps({"method": "isotonic", "xs": [0.1, 0.5], "ys": [0.2, 0.6]}))
    assert head_calibrator(head).ys == [0.2, 0.6]
    for text, reason in (
        ('{"method": "isotonic", "xs": [0.1', "Expecting"),  # cut off
        ('{"x": 1}', "expected a JSON object with a method"),
        ('{"method": "isotonic", "xs": [0.1, 0.5], "ys": [0.2]}', "equally many knots"),
        ('{"method": "isotonic", "xs": [0.5, 0.1], "ys": [0.2, 0.3]}', "xs ascending"),
        ('{"method": "temperature", "scale": null}', "finite scale and bias"),
        ('{"method": "isotonic", "xs": [false, true], "ys": [0.2, 0.3]}', "numbers in [0, 1]"),
        ('{"method": "platt"}', "'platt' is not one of"),
    ):
        (head_dir / "calibration.json").write_text(text)
        with pytest.raises(ValueError) as e:
            head_calibrator(head)
        assert f"{head_dir / 'calibration.json'} is not a valid calibration (" in str(e.value), text
        assert reason in str(e.value), text


def _another_run_writes(monkeypatch, write):
    """While this run publishes (after its early check, before its rename), another run writes its output."""
    from eagletree import files

    real = files.sync_tree

    def sync_then_race(folder):
        real(folder)
        write()

    monkeypatch.setattr(files, "sync_tree", sync_then_race)


@pytest.mark.parametrize("command", ["export", "import"])
def test_of_two_runs_into_one_new_out_the_later_is_refused_at_publish(
    saved_head, tmp_path, monkeypatch, capsys, command
):
    """Both pass the early "new or empty" check; the one that publishes second must not replace the first's folder."""
    model, head_dir = saved_head
    exported = tmp_path / "exported"
    assert _export(head_dir, exported) == 0
    model.config.save_pretrained(tmp_path / "target")
    out = tmp_path / "out"

    def other():
        out.mkdir()
        (out / "config.json").write_text('{"theirs": 1}')

    _another_run_writes(monkeypatch, other)
    if command == "export":
        code = _export(head_dir, out)
    else:
        code = main(["import", "--eagle", str(exported), "--target", str(tmp_path / "target"), "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "was filled by another run while this one worked" in err and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == '{"theirs": 1}'
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_of_two_datastore_runs_into_one_new_file_the_later_is_refused(tmp_path, monkeypatch):
    from eagletree.files import WriteError, writing

    path = tmp_path / "store.npz"
    with pytest.raises(WriteError, match="was written by another run while this one worked"):
        with writing(path, replace=False) as tmp:
            tmp.write_bytes(b"mine")
            path.write_bytes(b"theirs")  # the other run published first
    assert path.read_bytes() == b"theirs" and [p.name for p in tmp_path.iterdir()] == ["store.npz"]
    with writing(path, replace=True) as tmp:  # --overwrite replaces it
        tmp.write_bytes(b"mine")
    assert path.read_bytes() == b"mine"
    with writing(tmp_path / "new.npz", replace=False) as tmp:  # absent: written
        tmp.write_bytes(b"new")
    assert (tmp_path / "new.npz").read_bytes() == b"new" and len(list(tmp_path.iterdir())) == 2


def _fill_disk_after(nbytes, error):
    """safetensors' save_file that writes `nbytes` and then finds the disk full, raising `error` as it does."""

    def write(tensors, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"x" * nbytes)
        raise error

    return write


def test_a_full_disk_is_one_line_naming_the_path_and_the_space_and_leaves_the_old_output(
    saved_head, tmp_path, monkeypatch, capsys
):
    from safetensors import SafetensorError

    from eagletree.export import layout
    from eagletree.files import WriteError, appending, writing

    _, head_dir = saved_head
    out = tmp_path / "out"
    assert _export(head_dir, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    full = SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    )
    monkeypatch.setattr(layout, "save_file", _fill_disk_after(3 * 2**20, full))
    assert _export(head_dir, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"the disk holding {str(out)!r} is full (" in err and "after 3.0 MiB of this write" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old export is intact
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []
    # a file (datastore, features, profiles) and an append-only file (distill, generate --prompts, history)
    with (
        pytest.raises(WriteError, match=r"store.npz' is full .* after 0.0 MiB"),
        writing(tmp_path / "store.npz") as tmp,
    ):
        tmp.write_bytes(b"abc")
        raise OSError(28, "No space left on device")
    assert not list(tmp_path.glob("*store.npz*"))
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"id": 1}\n')
    with pytest.raises(WriteError, match="answers.jsonl' is full .* the whole records written before are kept"):
        with appending(answers) as f:
            f.write('{"id": 2')
            f.flush()
            raise OSError(28, "No space left on device")


def test_overwrite_keeps_the_folders_mode_and_writes_through_a_symlinked_out(saved_head, tmp_path, capsys):
    import stat

    _, head_dir = saved_head
    real = tmp_path / "real"
    assert _export(head_dir, real) == 0
    (real / "notes.txt").write_text("n")
    real.chmod(0o750)
    assert _export(head_dir, real, "--overwrite") == 0
    assert stat.S_IMODE(real.stat().st_mode) == 0o750  # not the umask's 0755
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    old = (real / "model.safetensors").stat().st_ino
    assert _export(head_dir, link, "--overwrite") == 0
    assert link.is_symlink() and link.resolve() == real.resolve()  # still the user's link, to the same folder
    assert (real / "model.safetensors").stat().st_ino != old and (real / "notes.txt").read_text() == "n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head", "link", "real"]  # no partial left anywhere
    assert stat.S_IMODE(real.stat().st_mode) == 0o750


def test_a_cache_folder_that_cannot_be_written_names_eagletree_cache(tmp_path, monkeypatch):
    """An empty read-only $EAGLETREE_CACHE: the first write there (a profile, the kernel choice, the de-quantized
    model) names the folder and the variable, not a bare Errno 30/13."""
    from eagletree.files import WriteError, building, write_json_atomic

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("EAGLETREE_CACHE", str(cache))
    real_mkdir = type(cache).mkdir

    def read_only(self, *a, **k):  # (a chmod'ed folder does not stop root, who runs CI here)
        if cache in self.parents or self == cache:
            raise OSError(30, "Read-only file system", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(type(cache), "mkdir", read_only)
    for write in (
        lambda: write_json_atomic(cache / "profiles" / "p.json", {}),
        lambda: building(cache / "m").__enter__(),
    ):
        with pytest.raises(
            WriteError, match=r"in eagletree's cache folder .*Read-only file system.*set EAGLETREE_CACHE"
        ):
            write()
    from eagletree.files import cache_write_error

    outside = OSError(30, "Read-only file system")  # elsewhere the error stays the filesystem's own
    assert cache_write_error(tmp_path / "out" / "p.json", outside) is None
    assert cache_write_error(cache / "p.json", OSError(28, "No space left on device")) is None


def test_a_bad_head_is_named_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """Issue 69: a missing --head folder, one that is not a head's, one whose config.json transformers refuses and a
    head for another target's sizes were reported only after the target had loaded (the target's config is read
    from its folder, without the weights)."""
    llama, qwen = tiny_model("llama"), tiny_model("qwen2")
    llama.config.save_pretrained(tmp_path / "llama")  # a target folder: its config.json alone
    EagleHead.for_target(llama.config).save_pretrained(tmp_path / "llama-head")
    EagleHead.for_target(qwen.config).save_pretrained(tmp_path / "qwen-head")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    _edit_head_config(tmp_path / "llama-head", tmp_path / "odd-head", hidden_size=1024, num_attention_heads=9)
    loads = []

    def load(spec, dtype=None, device=None):
        loads.append(spec)
        raise ValueError("stop here")

    monkeypatch.setattr("eagletree.target.load_target", load)
    for head, message in (
        ("nowhere", "is not a head folder: no such folder (expected config.json and model.safetensors)"),
        ("notes", "is not a head folder: expected config.json and model.safetensors"),
        (
            "qwen-head",
            "head was trained for a target with model_type = 'qwen2', but this target has model_type = 'llama'",
        ),
        (
            "odd-head",
            "layer_config is not a valid 'llama' config: The hidden size (1024) is not a multiple of the number",
        ),
    ):
        argv = ["--target", str(tmp_path / "llama"), "--head", str(tmp_path / head)]
        assert main(["generate", *argv, "--prompt", "hi", "--tree", "eagle2"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (head, err)
    assert loads == []
    assert (
        main(
            ["generate", "--target", str(tmp_path / "llama"), "--head", str(tmp_path / "llama-head"), "--prompt", "hi"]
        )
        == 2
    )
    assert loads == [str(tmp_path / "llama")] and "stop here" in capsys.readouterr().err  # a good head: loaded


def _edit_head_config(head, out, **values):
    """A copy of the head folder `head` in `out` whose config.json sets `values` everywhere they appear."""
    import shutil

    shutil.copytree(head, out)

    def edit(node):
        if isinstance(node, dict):
            return {k: values[k] if k in values else edit(v) for k, v in node.items()}
        return node

    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(edit(config)))


@pytest.mark.parametrize("fmt", ["vllm", "eagle"])
def test_export_of_a_head_whose_config_transformers_refuses_is_one_line(saved_head, tmp_path, capsys, fmt):
    """Issue 69: a head whose config.json says hidden_size 1024 throughout (not a multiple of its 9 attention heads,
    as SmolLM2's) raised huggingface_hub's StrictDataclassClassValidationError from building the head's layer."""
    _, head_dir = saved_head
    _edit_head_config(head_dir, tmp_path / "odd", hidden_size=1024, num_attention_heads=9)
    assert main(["export", "--head", str(tmp_path / "odd"), "--format", fmt, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {tmp_path / 'odd' / 'config.json'}: layer_config is not a valid 'llama' config: The hidden size "
        "(1024) is not a multiple of the number of attention heads (9).\n"
    )
    assert not (tmp_path / "x").exists()


def test_a_prompts_file_is_checked_as_the_api_checks_prompts_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """Issue 69: a lone surrogate in a JSON prompt ("\\ud800 hi") raised `TypeError: function takes exactly 5
    arguments` after the model had loaded; the CLI and the API now share one check of chat messages."""
    monkeypatch.setattr("eagletree.target.load_target", lambda *a, **k: pytest.fail("loaded the target"))
    path = tmp_path / "p.json"
    for prompts, message in (
        (
            ["ok", "\ud800 hi"],
            "item 1: message 0's content is not valid UTF-8 text (a lone surrogate U+D800 at character 0)",
        ),
        ([{"messages": [{"role": "wizard", "content": "hi"}]}], 'item 0: message 0: expected {"role": system|'),
    ):
        path.write_text(json.dumps(prompts))  # (json writes the surrogate as "\ud800", which json.loads reads back)
        assert main(["generate", "--target", "tiny", "--head", "none", "--prompts", str(path)]) == 2
        assert message in capsys.readouterr().err

"""Nothing lost, every bad input one clear error: output folders, leftovers, permissions (issue 17)."""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from eagletree.cli import main
from eagletree.draft_heads import EagleHead, load_head

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
    assert main(["import", "--eagle", str(tmp_path / "ex"), "--target", str(tmp_path / "nowhere"),
                 "--out", str(tmp_path / "ex"), "--overwrite"]) == 2
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
    assert sorted(p.name for p in existing.iterdir()) == ["calibration.json", "config.json", "metrics.json",
                                                          "model.safetensors"]
    load_head(existing, target_config=model.config)
    # an eagletree head is not an EAGLE export; a broken config.json is named
    assert main(["import", "--eagle", str(head_dir), "--target", str(target), "--out", str(tmp_path / "o")]) == 2
    assert "is an eagletree head (head_type 'eagle'), not an EAGLE export" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert main(["import", "--eagle", str(tmp_path / "bad"), "--target", str(target), "--out", str(tmp_path / "o")]) == 2
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
    monkeypatch.setattr("eagletree.target.load_target",
                        lambda spec, dtype=None, device=None: loads.append(spec) or (model, tok))
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    return loads, ["--target", "tiny", "--head", str(tmp_path / "head"), "--max-new-tokens", "4"]


@pytest.mark.parametrize("option, value, message", [
    ("--depth", "0", "--depth must be >= 1, got 0"), ("--depth", "-2", "--depth must be >= 1, got -2"),
    ("--top-p", "2", "--top-p must be > 0 and <= 1.0, got 2.0"), ("--top-p", "0", "--top-p must be > 0"),
    ("--top-k-draft", "0", "--top-k-draft must be >= 1, got 0"), ("--budget", "0", "--budget must be >= 1"),
    ("--temperature", "-1", "--temperature must be >= 0"), ("--temperature", "nan", "--temperature must be a finite"),
    ("--top-k", "-1", "--top-k must be >= 0"), ("--max-new-tokens", "-3", "--max-new-tokens must be >= 0"),
    ("--seed", "-1", "--seed must be >= 0")])
def test_decoding_options_out_of_range_are_one_line_naming_the_option(tiny_cli, capsys, option, value, message):
    loads, args = tiny_cli
    assert main(["generate", *args, "--prompt", "hello", option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert loads == []  # refused before the model is loaded


def test_decoding_options_are_checked_in_the_python_api():
    from eagletree.generate import generate
    from helpers import tiny_tokenizer

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    for bad, message in (({"depth": 0}, "depth must be >= 1, got 0"), ({"top_p": 2.0}, "top_p must be > 0 and <= 1"),
                         ({"top_k_draft": 0}, "top_k_draft must be >= 1"), ({"temperature": float("inf")}, "finite")):
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

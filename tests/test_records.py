"""Record files (`eagletree.records`): what `generate --prompts --out` and `distill --out` write, and every file they
refuse to touch (issue 69): foreign files, other settings, a second writer, paths that are not regular files."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eagletree
from eagletree.bench import read_prompt_file
from eagletree.cli import main as cli_main
from eagletree.draft import EagleHead
from eagletree.records import RecordFileError, RecordFormat, RecordStore, header
from eagletree.train.distill import DistillError, answered_ids, distill

from helpers import records_of, tiny_conversations, tiny_model, tiny_tokenizer

FAST = ["--max-new-tokens", "8", "--tree", "eagle2", "--budget", "6", "--pack", "off"]
ROOT = Path(eagletree.__file__).resolve().parent.parent  # (the package these tests import, for a subprocess)


@pytest.fixture
def tiny_cli(tmp_path, monkeypatch):
    """`generate --prompts` on the tiny model (loading it is reported as 'loaded' on stderr)."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    EagleHead.for_target(model.config).save_pretrained(tmp_path / "head")
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "p.txt").write_text("hello how are you\ntell me a joke\nwhy is the sky blue\n")
    return [
        "generate",
        "--target",
        "tiny",
        "--head",
        str(tmp_path / "head"),
        *FAST,
        "--prompts",
        str(tmp_path / "p.txt"),
    ]


def _refused(argv, capsys) -> str:
    """The one error line of a command refused before its model loaded."""
    assert cli_main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "loaded" not in err, err  # refused before the target was loaded
    [line] = [line for line in err.splitlines() if line.startswith("error: ")]
    return line


def test_a_file_that_is_not_generates_own_is_refused_untouched(tiny_cli, tmp_path, capsys):
    notes, prompts = tmp_path / "notes.jsonl", tmp_path / "one.txt"
    notes.write_text("my notes")  # no newline: what the cut-off-line repair used to remove
    prompts.write_text("hello")
    distilled = tmp_path / "d.jsonl"
    distilled.write_text(json.dumps(header("distill", {"temperature": 0.0})) + "\n")
    legacy = tmp_path / "legacy.jsonl"  # answers from before headers
    legacy.write_text(json.dumps({"index": 0, "prompt": "hello how are you", "text": "x"}) + "\n")
    for out, argv, message in (
        (
            notes,
            ["--head", "/nonexistent"],
            "its first line 'my notes' is not a record file header; it was left untouched",
        ),
        (prompts, ["--prompts", str(prompts)], "is the --prompts file .*one.txt' itself; pass another --out"),
        (distilled, [], "its header says `eagletree distill`"),
        (legacy, [], "its first line is a JSON record, not a header .* it was left untouched: pass another --out"),
    ):
        before = out.read_bytes()
        line = _refused([*tiny_cli, *argv, "--out", str(out)], capsys)
        assert re.search(message, line), line
        assert out.read_bytes() == before


def test_a_rerun_with_other_settings_is_refused_naming_each_setting(tiny_cli, tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    assert cli_main([*tiny_cli, "--out", str(out)]) == 0
    capsys.readouterr()
    assert len(records_of(out)) == 3 and json.loads(out.read_text().splitlines()[0])["settings"]["max_new_tokens"] == 8
    with open(out, "a") as f:
        f.write('{"index": 2, "pro')  # a torn last line: mended only once every check passed
    before = out.read_bytes()
    line = _refused([*tiny_cli, "--out", str(out), "--max-new-tokens", "64", "--temperature", "0.9"], capsys)
    assert (
        "holds records made with other settings: max_new_tokens 8 there, 64 here; temperature 0.0 there, 0.9 " in line
    )
    assert line.endswith("rerun with the settings it was made with to continue it, or pass another --out")
    assert out.read_bytes() == before
    with pytest.warns(UserWarning, match="removed a cut-off last line"):
        assert cli_main([*tiny_cli, "--out", str(out)]) == 0  # the same settings: continued
    assert len(records_of(out)) == 3


def test_a_second_writer_is_refused_at_once_naming_the_first(tiny_cli, tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    fmt = RecordFormat("generate --prompts", key_of=lambda line, where: json.loads(line)["index"])
    with RecordStore(out, fmt, {"any": 1}):  # (a lock per open file: a second open in this process is refused too)
        line = _refused([*tiny_cli, "--out", str(out)], capsys)
        assert f"is being written by process {os.getpid()} (it holds the file's lock)" in line
        with pytest.raises(RecordFileError, match="is being written by process"):
            RecordStore(out, fmt, {"any": 1})
    with RecordStore(out, fmt, {"any": 1}) as again:  # released when the first closed
        assert again.keys == set()


def test_a_lock_held_by_another_process_names_it(tmp_path):
    out = tmp_path / "a.jsonl"
    out.write_text(json.dumps(header("distill", {})) + "\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        model, tok = tiny_model("llama"), tiny_tokenizer()
        with pytest.raises(DistillError, match=f"is being written by process {holder.pid} "):
            distill(model, tok, tiny_conversations(2), out, max_new_tokens=4, progress=False)
    finally:
        holder.communicate("")


@contextlib.contextmanager
def _unwritable(path: Path):
    """`path` made unwritable: immutable (chattr +i, as root), else read-only for a user who is not root."""
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    if not made:
        if os.geteuid() == 0:
            pytest.skip("chattr +i is not available here, and root writes read-only files")
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True) if made else path.chmod(0o755)


def test_output_paths_are_checked_before_the_model_loads(tiny_cli, tmp_path, capsys):
    frozen, folder = tmp_path / "frozen.jsonl", tmp_path / "frozen_dir"
    frozen.write_text("")
    folder.mkdir()
    (tmp_path / "file").write_text("x")
    for out, message in (
        (tmp_path, "is a folder; expected a file path"),
        ("/dev/null", "'/dev/null' is a character device, not a regular file; expected a file path"),
        ("/dev/full", "'/dev/full' is a character device, not a regular file"),
        ("/dev/stdout", "'/dev/stdout' is this command's standard output; leave --out out to print the records"),
        (tmp_path / "file" / "a.jsonl", f"{str(tmp_path / 'file')!r} is a file, so nothing can be written under it"),
    ):
        assert message in _refused([*tiny_cli, "--out", str(out)], capsys), out
    with _unwritable(frozen):
        assert "frozen.jsonl' cannot be written (" in _refused([*tiny_cli, "--out", str(frozen)], capsys)
    with _unwritable(folder):
        line = _refused([*tiny_cli, "--out", str(folder / "sub" / "a.jsonl")], capsys)
        assert f"cannot be made: the folder {str(folder)!r} is not writable" in line
    assert not (folder / "sub").exists()


@pytest.mark.parametrize("out", ["/dev/stdout", "fifo"])
def test_a_pipe_or_fifo_as_out_is_refused_without_reading_it(tmp_path, out):
    """Before, --out /dev/stdout into a pipe (or a FIFO) read the pipe: it waited forever."""
    (tmp_path / "p.txt").write_text("hello\n")
    if out == "fifo":
        out = str(tmp_path / "fifo")
        os.mkfifo(out)
    argv = ["generate", "--target", "tiny", "--prompts", str(tmp_path / "p.txt"), "--out", out]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "eagletree.cli", *argv]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert ("standard output" if out == "/dev/stdout" else "is a FIFO (named pipe), not a regular file") in run.stderr


def test_prompts_from_standard_input(tiny_cli, tmp_path, capsys, monkeypatch):
    outs = []
    for name in ("-", "/dev/stdin"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello how are you\ntell me a joke\n")))
        outs.append(tmp_path / f"{len(outs)}.jsonl")
        argv = [*tiny_cli[:-1], name, "--out", str(outs[-1])]
        assert cli_main(argv) == 0
        assert "[2 of 2 prompts answered" in capsys.readouterr().out
    assert [r["prompt"] for r in records_of(outs[0])] == ["hello how are you", "tell me a joke"]
    assert records_of(outs[0]) == records_of(outs[1])
    # JSON lines piped in would each become one prompt holding the JSON: refused, saying how to pass them
    monkeypatch.setattr(
        sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"messages": [{"role": "user", "content": "hi"}]}\n'))
    )
    assert cli_main([*tiny_cli[:-1], "-", "--out", str(tmp_path / "json.jsonl")]) == 2
    assert "standard input looks like JSON lines" in capsys.readouterr().err


def test_prompt_lines_end_at_newlines_only(tiny_cli, tmp_path, capsys):
    text = tmp_path / "odd.txt"
    text.write_text("one\u2028two\r\nthree\x0cfour\nfive\x1dsix\x1c\x85seven\n", newline="")
    expected = ["one\u2028two", "three\x0cfour", "five\x1dsix\x1c\x85seven"]
    assert [p[0]["content"] for p in read_prompt_file(text)] == expected
    lines = tmp_path / "odd.jsonl"  # inside a JSON string, U+2028 is text too
    lines.write_text(json.dumps("a\u2028b", ensure_ascii=False) + "\n" + json.dumps("c") + "\n")
    assert [p[0]["content"] for p in read_prompt_file(lines)] == ["a\u2028b", "c"]
    out = tmp_path / "a.jsonl"
    assert cli_main([*tiny_cli[:-1], str(text), "--out", str(out)]) == 0
    assert [r["prompt"] for r in records_of(out)] == expected


def test_distill_refuses_a_file_that_is_not_its_own_untouched(tmp_path, capsys, monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    convs = tiny_conversations(3)
    notes = tmp_path / "notes.jsonl"
    notes.write_text("my notes")
    with pytest.raises(DistillError, match="notes.jsonl' is not a record file of `eagletree distill`"):
        distill(model, tok, convs, notes, max_new_tokens=4, progress=False)
    assert notes.read_text() == "my notes"
    # The command refuses it before it reads the dataset or loads the target.
    monkeypatch.setattr("eagletree.target.load_target", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.setattr("eagletree.train.distill.distill_prompts", lambda *a, **k: pytest.fail("dataset read"))
    for out, message in ((notes, "its first line 'my notes' is not a record file header"), ("/dev/null", "device")):
        assert cli_main(["distill", "--engine", "hf", "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert notes.read_text() == "my notes"


def test_a_distill_file_from_before_headers_is_continued_through_skip_answered(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    convs = tiny_conversations(4)
    new = tmp_path / "new.jsonl"
    distill(model, tok, convs[:2], new, max_new_tokens=4, progress=False)
    old = tmp_path / "old.jsonl"  # the same records, as distill wrote them before its files had a header
    old.write_text("".join(new.read_text().splitlines(keepends=True)[1:]))
    before = old.read_bytes()
    with pytest.raises(DistillError, match="pass another --out with this file as --skip-answered"):
        distill(model, tok, convs, old, max_new_tokens=4, progress=False)
    assert old.read_bytes() == before
    counts = distill(model, tok, convs, tmp_path / "rest.jsonl", max_new_tokens=4, skip_answered=old, progress=False)
    assert (counts["answered"], counts["skipped_answered_elsewhere"]) == (2, 2)
    assert answered_ids(tmp_path / "rest.jsonl") == {"t2", "t3"}
    # two record files joined with `cat` (as training reads them) skip the prompts both answer
    joined = tmp_path / "joined.jsonl"
    joined.write_text(new.read_text() + (tmp_path / "rest.jsonl").read_text())
    assert (
        distill(model, tok, convs, tmp_path / "none.jsonl", max_new_tokens=4, skip_answered=joined, progress=False)[
            "skipped_answered_elsewhere"
        ]
        == 4
    )


def test_readers_of_distill_files_skip_the_header(tmp_path):
    from eagletree.search.store import TokenStore
    from eagletree.train.data import load_dataset

    model, tok = tiny_model("llama"), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    distill(model, tok, tiny_conversations(3), out, max_new_tokens=4, progress=False)
    joined = tmp_path / "joined.jsonl"  # two files joined with cat: a header in the middle
    joined.write_text(out.read_text() * 2)
    assert [c.id for c in load_dataset(str(joined)).conversations] == ["t0", "t1", "t2"] * 2
    assert len(TokenStore.from_chat_file(out, tok)) > 0


def test_a_run_that_fails_before_its_first_record_leaves_no_file(tiny_cli, tmp_path, capsys):
    out = tmp_path / "sub" / "new.jsonl"
    assert cli_main([*tiny_cli, "--out", str(out), "--head", str(tmp_path / "nohead")]) == 2
    assert "error: " in capsys.readouterr().err and not out.exists()


def test_a_finished_run_keeps_its_file_and_a_foreign_one_is_refused_from_its_first_line(tmp_path, monkeypatch):
    """A run that answered nothing but ended well keeps its file (a later `dataset=...` names it); a foreign file is
    refused before the rest of it is read (a huge file, or one that is not text, never reaches memory)."""
    from eagletree import records

    fmt = RecordFormat("generate --prompts", key_of=lambda line, where: json.loads(line)["index"])
    with RecordStore(tmp_path / "empty.jsonl", fmt, {"any": 1}):
        pass
    assert [json.loads(line)["format"] for line in (tmp_path / "empty.jsonl").read_text().splitlines()] == [
        "eagletree-records"
    ]
    with pytest.raises(KeyError), RecordStore(tmp_path / "failed.jsonl", fmt, {"any": 1}):
        raise KeyError("a run that failed before its first record")
    assert not (tmp_path / "failed.jsonl").exists()
    big = tmp_path / "big.jsonl"
    big.write_bytes(b'{"id": 1}\n' + b"x" * 4096)
    monkeypatch.setattr(records, "_read_all", lambda fd: pytest.fail("the whole foreign file was read"))
    with pytest.raises(RecordFileError, match="its first line is a JSON record, not a header"):
        RecordStore(big, fmt, {"any": 1})
    assert big.read_bytes() == b'{"id": 1}\n' + b"x" * 4096


def test_generate_records_the_precision_its_target_runs_in(tiny_cli, tmp_path, capsys):
    """A run resumed on a machine whose default precision differs (bf16 on CUDA) must not add answers of another
    precision: the header names the device and dtype the defaults resolve to."""
    out = tmp_path / "a.jsonl"
    assert cli_main([*tiny_cli, "--out", str(out)]) == 0
    settings = json.loads(out.read_text().splitlines()[0])["settings"]
    assert (settings["device"], settings["dtype"]) == (
        ("cuda", "bfloat16") if torch.cuda.is_available() else ("cpu", "float32")
    )
    capsys.readouterr()
    assert cli_main([*tiny_cli, "--out", str(out), "--dtype", "bfloat16"]) == 2
    assert 'dtype "float32" there, "bfloat16" here' in capsys.readouterr().err


def test_a_resumed_sampled_run_draws_what_the_whole_run_would(tiny_cli, tmp_path):
    """A prompt's seed is its index in the --prompts file, not its place among the prompts left to answer: decoding
    one at a time, the answers a resumed run adds are the ones an uninterrupted run gives (they were drawn with other
    seeds before). (In a batch a sequence's trees, and so its draws, depend on the others it shares passes with.)"""
    sampled = ["--temperature", "1.0", "--seed", "5", "--batch-size", "1"]
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    assert cli_main([*tiny_cli, *sampled, "--out", str(whole)]) == 0
    lines = whole.read_text().splitlines()
    first = next(line for line in lines[1:] if json.loads(line)["index"] == 0)
    resumed.write_text(lines[0] + "\n" + first + "\n")  # as if stopped after answering prompt 0
    assert cli_main([*tiny_cli, *sampled, "--out", str(resumed)]) == 0
    by_index = lambda path: {r["index"]: r["text"] for r in records_of(path)}  # noqa: E731
    assert by_index(resumed) == by_index(whole)

"""`eagletree generate` / `chat` and list prompts on a tiny random model (the real model runs in the README's
command)."""

import io
import json
import re

import pytest
import torch

from eagletree.cli import main as cli_main
from eagletree.decode import generate
from eagletree.draft import EagleHead

from helpers import records_of, tiny_model, tiny_tokenizer


@pytest.fixture
def tiny_cli(tmp_path, monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    EagleHead.for_target(model.config).save_pretrained(tmp_path / "head")
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    return model, tok, ["--target", "tiny", "--head", str(tmp_path / "head")]


def test_generate_json_and_compare_plain(tiny_cli, capsys):
    _, _, args = tiny_cli
    assert (
        cli_main(
            [
                "generate",
                *args,
                "--prompt",
                "hello how are you",
                "--max-new-tokens",
                "12",
                "--json",
                "--compare-plain",
                "--budget",
                "6",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {
        "text",
        "new_tokens",
        "passes",
        "tokens_per_pass",
        "tokens_per_s",
        "plain_tokens_per_s",
        "speedup",
        "identical_to_plain",
    } <= set(result)
    assert result["new_tokens"] == 12 and result["identical_to_plain"] is True and result["text"]
    # Like for like: vs plain decoding with the same kernels, vs stock HF generate, and the kernels' own gain.
    assert {"hf_tokens_per_s", "speedup_vs_hf", "kernels_gain", "kernels"} <= set(result)
    assert result["speedup_vs_hf"] == pytest.approx(result["tokens_per_s"] / result["hf_tokens_per_s"], abs=2e-3)
    choice = result["kernels"]["choice"]  # --pack auto measured both kernels here
    assert result["kernels"]["kernels"] in ("stock", "packed", "mixed") and len(choice["stock_s"]) == len(
        choice["sizes"]
    )
    # the drafter's kernels: the target's choice, or one measured in the head's own precision (bf16 drafting)
    assert result["draft_kernels"]["kernels"] in ("stock", "packed", "mixed")
    if result["draft_kernels"]["choice"] is not None:
        assert result["draft_kernels"]["choice"]["sizes"] == choice["sizes"]
    assert result["tokens_per_pass"] == pytest.approx(result["new_tokens"] / result["passes"], abs=1e-3)
    assert result["speedup_basis"] == "end to end" and "decode_tokens_per_s" not in result
    assert result["first_run_tokens_per_s"] > 0  # the speculative run is timed again, warm, like the plain runs
    assert cli_main(["generate", *args, "--prompt", "   "]) == 2
    assert "error: --prompt is empty" in capsys.readouterr().err


def test_compare_plain_when_sampling_compares_rates_after_the_first_pass(tiny_cli, capsys, monkeypatch):
    # Sampled, each run draws its own answer: one that stops early has more of its time in the prefill, so the
    # speedups compare the rates after each run's first pass (as bench does), and say so. (A fixed tree: `auto`'s
    # choice follows the machine's timing, and with it the sampled answer, which may then stop in its first pass.)
    import eagletree.bench.compare as compare
    from eagletree.bench.runners import Run

    _, _, args = tiny_cli
    plain = Run(list(range(20)), seconds=3.0, first_seconds=1.0, accepted_lengths=[1] + [1] * 19)  # 19 tokens in 2 s
    monkeypatch.setattr(compare, "run_hf", lambda *a, **kw: plain)
    assert (
        cli_main(
            [
                "generate",
                *args,
                "--prompt",
                "hello how are you",
                "--max-new-tokens",
                "12",
                "--json",
                "--compare-plain",
                "--budget",
                "6",
                "--tree",
                "eagle2",
                "--temperature",
                "1",
                "--seed",
                "3",
                "--pack",
                "off",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["speedup_basis"] == "after the first pass" and "identical_to_plain" not in result
    assert result["plain_tokens_per_s"] == 9.5 and result["hf_tokens_per_s"] == 9.5  # stock kernels: one run
    assert result["speedup"] == pytest.approx(result["decode_tokens_per_s"] / 9.5, abs=2e-3)
    assert result["decode_tokens_per_s"] != result["tokens_per_s"]
    assert (
        cli_main(
            [
                "generate",
                *args,
                "--prompt",
                "hello how are you",
                "--max-new-tokens",
                "12",
                "--compare-plain",
                "--budget",
                "6",
                "--tree",
                "eagle2",
                "--temperature",
                "1",
                "--seed",
                "3",
                "--pack",
                "off",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.search(
        r"\| rates after the first pass from here on \(sampled answers differ in length\): [\d.]+ "
        r"tokens/s \| plain decoding, same kernels \(stock\): 9.5 tokens/s \| speedup [\d.]+x",
        line,
    )
    # a run without tokens after its first pass has no such rate: end to end, as greedy
    plain = Run([5], seconds=1.0, first_seconds=1.0, accepted_lengths=[1])
    assert (
        cli_main(
            [
                "generate",
                *args,
                "--prompt",
                "hello how are you",
                "--max-new-tokens",
                "12",
                "--json",
                "--compare-plain",
                "--budget",
                "6",
                "--tree",
                "eagle2",
                "--temperature",
                "1",
                "--seed",
                "3",
                "--pack",
                "off",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["speedup_basis"] == "end to end" and result["plain_tokens_per_s"] == 1.0


def test_generate_streams_then_prints_stats(tiny_cli, capsys):
    _, _, args = tiny_cli
    assert cli_main(["generate", *args, "--prompt", "hello", "--max-new-tokens", "8", "--tree", "sequoia"]) == 0
    out = capsys.readouterr().out
    assert "[sequoia: " in out and "tokens/pass" in out


def test_chat_keeps_the_conversation_and_reports_tokens_per_pass(tiny_cli, capsys, monkeypatch):
    _, _, args = tiny_cli
    seen = []
    import eagletree.cli.generate as cli

    real_answer = cli._answer

    def spy(decoder, messages, stream_to=None):
        seen.append([m["role"] for m in messages])
        return real_answer(decoder, messages, stream_to=stream_to)

    monkeypatch.setattr(cli, "_answer", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nwhat is two plus four\n\n"))
    assert cli_main(["chat", *args, "--max-new-tokens", "6"]) == 0
    assert seen == [["user"], ["user", "assistant", "user"]]
    assert capsys.readouterr().err.count("tokens/pass") == 2


def test_chat_refuses_a_message_that_overflows_the_context_and_goes_on(tiny_cli, capsys, monkeypatch):
    model, _, args = tiny_cli
    import eagletree.cli.generate as cli

    seen, real_answer = [], cli._answer

    def spy(decoder, messages, stream_to=None):
        seen.append(len(messages))
        return real_answer(decoder, messages, stream_to=stream_to)

    monkeypatch.setattr(cli, "_answer", spy)
    long = "word " * (4 * model.config.max_position_embeddings)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"hello\n{long}\nagain\n\n"))
    assert cli_main(["chat", *args, "--max-new-tokens", "4"]) == 0
    assert seen == [1, 3, 3]  # the long message was refused and dropped: "again" follows the first answer
    err = capsys.readouterr().err
    assert "exceeds the model's context" in err and "that message was not sent" in err and err.count("tokens/pass") == 2


def test_ctrl_c_stops_a_chat_answer_and_the_conversation_goes_on(tiny_cli, capsys, monkeypatch):
    _, _, args = tiny_cli
    import eagletree.cli.generate as cli

    seen, real_answer = [], cli._answer

    def interrupted_once(decoder, messages, stream_to=None):
        seen.append(len(messages))
        if len(seen) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second answer
        return real_answer(decoder, messages, stream_to=stream_to)

    monkeypatch.setattr(cli, "_answer", interrupted_once)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nstop this\nagain\n\n"))
    assert cli_main(["chat", *args, "--max-new-tokens", "4"]) == 0  # (was a KeyboardInterrupt traceback)
    assert seen == [1, 3, 3]  # the stopped turn was dropped: "again" follows the first answer
    assert "answer stopped" in capsys.readouterr().err

    def interrupted_generate(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_answer", interrupted_generate)
    assert cli_main(["generate", *args, "--prompt", "hi", "--max-new-tokens", "4"]) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted")


def test_output_paths_and_fixed_shapes_are_refused_before_any_work(tiny_cli, capsys, tmp_path):
    _, _, args = tiny_cli
    (tmp_path / "a.txt").write_text("x")
    for argv, message in (
        (["bench", *args, "--quick", "-o", str(tmp_path / "a.txt")], "-o/--out '.*a.txt' is a file; expected a folder"),
        (["viz", *args, "--prompt", "hi", "-o", str(tmp_path)], "-o/--output '.*' is a folder; expected a file"),
        (["viz", *args, "--prompt", "hi", "-o", str(tmp_path / "a.txt" / "t.html")], "'.*a.txt' is a file"),
        (
            ["generate", *args, "--prompt", "hi", "--tree", "chain", "--copy", "on"],
            "--copy on needs a searched tree .*--tree chain is a fixed shape",
        ),
        (["calibrate-copy", *args, "--max-new-tokens", "1"], "--max-new-tokens must be >= 2 for calibrate-copy"),
    ):
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.search(message, err), (argv, err)
        assert "loaded" not in err  # refused before the target was loaded


def test_a_list_of_prompts_gives_one_result_each():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    prompts = ["hello how are you", [{"role": "user", "content": "tell me a joke"}], torch.tensor([5, 6, 7])]
    results = generate(model, tok, head, prompts, tree="eagle2", budget=60, max_new_tokens=8)
    assert len(results) == 3
    for p, r in zip(prompts, results):
        assert r.token_ids == generate(model, tok, head, p, tree="eagle2", budget=60, max_new_tokens=8).token_ids


def test_copy_option_and_calibrate_copy(tiny_cli, capsys, tmp_path):
    from eagletree.search.copy import CopyCalibration

    _, _, args = tiny_cli
    prompt = "one two three four one two three four one two"
    runs = {}
    for copy in ("on", "off"):
        assert (
            cli_main(
                [
                    "generate",
                    *args,
                    "--prompt",
                    prompt,
                    "--max-new-tokens",
                    "24",
                    "--json",
                    "--copy",
                    copy,
                    "--budget",
                    "12",
                    "--tree",
                    "eagle2",
                ]
            )
            == 0
        )
        runs[copy] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["on"]["method"] == "eagle2+copy" and runs["off"]["method"] == "eagle2"
    assert runs["off"]["copied_tokens"] == 0 and runs["on"]["text"] == runs["off"]["text"]
    assert (
        cli_main(
            ["generate", "--target", "tiny", "--head", "none", "--prompt", prompt, "--max-new-tokens", "8", "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["method"] == "plain"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(prompt) + "\n" + json.dumps("five six five six five six") + "\n")
    out = tmp_path / "copy.json"
    assert (
        cli_main(
            [
                "calibrate-copy",
                *args,
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "24",
                "--budget",
                "12",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"wrote {out}: ") and "accepted on 2 prompts" in line
    saved = json.loads(out.read_text())
    assert sum(map(sum, saved["tried"])) > 0 and CopyCalibration.load(out).max_len == 16
    assert cli_main(["calibrate-copy", "--target", "tiny", "--head", "none", "--prompts", str(prompts)]) == 2
    assert "pass a head folder" in capsys.readouterr().err


def test_copy_tables_are_kept_per_draft_vocabulary(tiny_cli, capsys, tmp_path, monkeypatch):
    """A table measured drafting over the full vocabulary (a GPU's auto) never replaces the head's own one."""
    from eagletree.decode.resources import head_copy_calibration
    from eagletree.draft import load_head
    from eagletree.search.copy import COPY_CALIBRATION, COPY_CALIBRATION_FULL_VOCAB, CopyCalibration

    model, _, _ = tiny_cli
    head_dir = tmp_path / "vocab-head"
    head = EagleHead.for_target(model.config)
    head.set_draft_vocab(torch.arange(40))
    head.save_pretrained(head_dir)
    own = CopyCalibration(prior=torch.full((5, 16), 0.3), draft_vocab_size=40)
    own.save(head_dir / COPY_CALIBRATION)
    before = (head_dir / COPY_CALIBRATION).read_text()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps("one two three four one two three four one two") + "\n")
    assert (
        cli_main(
            [
                "calibrate-copy",
                "--target",
                "tiny",
                "--head",
                str(head_dir),
                "--draft-vocab",
                "full",
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                "16",
                "--budget",
                "8",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    vocab = model.config.vocab_size
    assert (
        line.startswith(f"wrote {head_dir / COPY_CALIBRATION_FULL_VOCAB}: ") and f"drafting over {vocab} tokens" in line
    )
    assert (head_dir / COPY_CALIBRATION).read_text() == before
    assert CopyCalibration.load(head_dir / COPY_CALIBRATION_FULL_VOCAB).draft_vocab_size == vocab
    # a run that tried no copied span leaves the table as it was
    import eagletree.train.evaluate as evaluate

    # a table already there is replaced only with --overwrite, refused before measuring
    monkeypatch.setattr(evaluate, "measure_copy_calibration", lambda *a, **k: pytest.fail("measured"))
    assert cli_main(["calibrate-copy", "--target", "tiny", "--head", str(head_dir), "--prompts", str(prompts)]) == 2
    assert f"{head_dir / COPY_CALIBRATION} holds a copy table already; pass --overwrite" in capsys.readouterr().err
    monkeypatch.setattr(
        evaluate, "measure_copy_calibration", lambda *a, **k: (CopyCalibration(), {"tokens_per_pass": 1.0})
    )
    assert (
        cli_main(
            ["calibrate-copy", "--target", "tiny", "--head", str(head_dir), "--prompts", str(prompts), "--overwrite"]
        )
        == 2
    )
    assert "no copied span was tried on these 1 prompts" in capsys.readouterr().err
    assert (head_dir / COPY_CALIBRATION).read_text() == before

    # Each drafting reads its own table, and the other one when its own is missing.
    narrow, wide = load_head(head_dir), load_head(head_dir).widen_vocab()
    assert head_copy_calibration(narrow).draft_vocab_size == 40
    assert head_copy_calibration(wide).draft_vocab_size == vocab
    (head_dir / COPY_CALIBRATION_FULL_VOCAB).unlink()
    assert head_copy_calibration(wide).draft_vocab_size == 40
    (head_dir / COPY_CALIBRATION).unlink()
    assert head_copy_calibration(wide).draft_vocab_size is None and head_copy_calibration(wide).rate()[0, 0] == 0.5
    with pytest.raises(ValueError, match=r"draft_vocab_size must be a token count >= 1 or None.*got 0"):
        CopyCalibration(draft_vocab_size=0)
    bad = json.loads(before)
    bad["draft_vocab_size"] = "8192"
    (head_dir / COPY_CALIBRATION).write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"copy_calibration.json: copy calibration draft_vocab_size must be .*'8192'"):
        head_copy_calibration(narrow)


PROMPT_LINES = ["hello how are you", "tell me a joke", "what is two plus four", "why is the sky blue"]
FAST = ["--max-new-tokens", "8", "--tree", "eagle2", "--budget", "6", "--pack", "off"]


def _records(path):
    return records_of(path)


def test_generate_prompts_writes_one_line_per_prompt_with_the_single_prompt_answers(tiny_cli, tmp_path, capsys):
    _, _, args = tiny_cli
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPT_LINES[0] + "\n\n" + "\n".join(PROMPT_LINES[1:]) + "\n")  # a blank line is skipped
    out = tmp_path / "answers" / "out.jsonl"
    argv = ["generate", *args, *FAST, "--prompts", str(prompts), "--batch-size", "3"]
    assert cli_main([*argv, "--out", str(out)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"\[4 of 4 prompts answered: \d+ new tokens in [\d.]+s = [\d.]+ tokens/s\]", summary)
    records = sorted(_records(out), key=lambda r: r["index"])
    assert [r["index"] for r in records] == [0, 1, 2, 3] and [r["prompt"] for r in records] == PROMPT_LINES
    for r in records:
        assert set(r) == {"index", "prompt", "text", "new_tokens", "tokens_per_pass"} and r["new_tokens"] >= 1
        # lossless: the batched answer is the one `generate --prompt` gives alone
        assert cli_main(["generate", *args, *FAST, "--prompt", r["prompt"], "--json"]) == 0
        alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (r["text"], r["new_tokens"]) == (alone["text"], alone["new_tokens"]), r["index"]
    # Without --out: each text (with its index) as it finishes, or each record's JSON line with --json.
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert sorted(printed[:-1]) == sorted(f"[{r['index']}] {r['text']}" for r in records)
    assert printed[-1].startswith("[4 of 4 prompts answered")
    assert cli_main([*argv, "--json"]) == 0
    assert sorted(map(json.loads, capsys.readouterr().out.strip().splitlines()), key=lambda r: r["index"]) == records
    # .jsonl prompts (strings or chat messages): a lone user turn is recorded as its text, others as messages
    chat = [{"role": "system", "content": "fine thanks"}, {"role": "user", "content": "tell me a joke"}]
    (tmp_path / "p.jsonl").write_text(json.dumps(PROMPT_LINES[0]) + "\n" + json.dumps({"messages": chat}) + "\n")
    assert cli_main([*argv, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "j.jsonl")]) == 0
    got = sorted(_records(tmp_path / "j.jsonl"), key=lambda r: r["index"])
    assert [r["prompt"] for r in got] == [PROMPT_LINES[0], chat] and got[0]["text"] == records[0]["text"]


def test_generate_prompts_resumes_an_interrupted_run_without_duplicates(tiny_cli, tmp_path, monkeypatch, capsys):
    from eagletree.decode import Decoder

    _, _, args = tiny_cli
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPT_LINES) + "\n")
    argv = ["generate", *args, *FAST, "--prompts", str(prompts), "--batch-size", "2"]
    straight, out = tmp_path / "straight.jsonl", tmp_path / "out.jsonl"
    assert cli_main([*argv, "--out", str(straight)]) == 0
    real = Decoder.results

    def interrupted(self, prompts, batch_size=8, keys=None):
        for n, item in enumerate(real(self, prompts, batch_size, keys)):
            if n == 2:
                raise KeyboardInterrupt  # Ctrl-C after two answers were written
            yield item

    monkeypatch.setattr(Decoder, "results", interrupted)
    assert cli_main([*argv, "--out", str(out)]) == 130
    assert len(_records(out)) == 2
    monkeypatch.setattr(Decoder, "results", real)
    missing = sorted({0, 1, 2, 3} - {r["index"] for r in _records(out)})
    with open(out, "a") as f:  # a kill in the middle of a write: a torn last line
        f.write(json.dumps({"index": missing[0], "prompt": PROMPT_LINES[missing[0]], "text": "cut"})[:30])
    capsys.readouterr()
    with pytest.warns(UserWarning, match="removed a cut-off last line"):
        assert cli_main([*argv, "--out", str(out)]) == 0
    assert "[2 of 4 prompts answered (2 already answered in --out): " in capsys.readouterr().out
    assert sorted(out.read_text().splitlines()) == sorted(straight.read_text().splitlines())  # no duplicates
    # Done: nothing is loaded or decoded; a whole last record without its newline counts.
    out.write_text(out.read_text().rstrip("\n"))
    assert cli_main([*argv, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "[0 of 4 prompts answered (4 already answered in --out)" in captured.out and "loaded" not in captured.err
    assert out.read_text().endswith("\n") and len(_records(out)) == 4


def test_generate_prompts_errors_name_the_flag_or_file(tiny_cli, tmp_path, capsys):
    model, _, args = tiny_cli
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('"hello"\n{"prompt": \n')
    (tmp_path / "p.txt").write_text("hello\nsky blue\n")
    (tmp_path / "bye.txt").write_text("bye\n")
    other = tmp_path / "other.jsonl"
    assert cli_main(["generate", *args, *FAST, "--prompts", str(tmp_path / "bye.txt"), "--out", str(other)]) == 0
    capsys.readouterr()
    p = ["--prompts", str(tmp_path / "p.txt")]
    for argv, message in (
        (["--prompts", str(tmp_path / "missing.txt")], r"--prompts '.*missing.txt': no such file"),
        (["--prompts", str(tmp_path / "blank.txt")], r"--prompts '.*blank.txt' holds no prompts"),
        (["--prompts", str(tmp_path / "bad.jsonl")], r"bad.jsonl line 2 is not JSON"),
        ([*p, "--out", str(other)], r"other.jsonl line 2: prompt 0 there is not prompt 0 of these prompts"),
        ([*p, "--out", str(tmp_path)], r"--out '.*' is a folder; expected a file path"),
        ([*p, "--compare-plain"], "--compare-plain times one prompt"),
        (["--prompt", "hi", "--out", str(tmp_path / "o.jsonl")], "--out goes with --prompts FILE"),
        (["--prompt", "hi", "--batch-size", "2"], "--batch-size goes with --prompts FILE"),
    ):
        assert cli_main(["generate", *args, *FAST, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert re.search(message, err), (argv, err)
        assert "loaded" not in err  # refused before the target was loaded
    for argv, message in (
        ([*p, "--batch-size", "0"], "--batch-size: must be an integer >= 1, got '0'"),
        ([*p, "--prompt", "hi"], "argument --prompt: not allowed with argument --prompts"),
        ([], "one of the arguments --prompt --prompts is required"),
    ):
        with pytest.raises(SystemExit) as e:
            cli_main(["generate", *args, *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    # A prompt that does not fit the context is named by its index in the file, also when resuming.
    long = "hello " * model.config.max_position_embeddings
    (tmp_path / "long.txt").write_text(f"hello\nsky blue\n{long}\n")
    out = tmp_path / "long.jsonl"
    assert cli_main(["generate", *args, *FAST, *p, "--out", str(out)]) == 0  # prompts 0 and 1 of long.txt too
    assert cli_main(["generate", *args, *FAST, "--prompts", str(tmp_path / "long.txt"), "--out", str(out)]) == 2
    assert re.search(
        r"--prompts .*long.txt: prompt 2: prompt \(\d+ tokens\) \+ max_new_tokens", capsys.readouterr().err
    )
    assert len(_records(out)) == 2  # every prompt is checked before decoding: nothing was written

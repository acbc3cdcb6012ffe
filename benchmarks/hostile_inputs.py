"""eagletree used as a hostile or careless user would: each case's outcome, and the counts of what went wrong.

    .venv/bin/python benchmarks/hostile_inputs.py [--only NAME,...] [--timeout 120]

Every case runs the real command line (`python -m eagletree.cli`, the real SmolLM2 target and the shipped head)
or the Python API (`eagletree.Decoder`, the same target loaded once), in a new temporary folder, and is judged:

- fine: the input was refused with a one-line message (exit status 2 for the command line, an EagletreeError from
  the API) or handled as its case expects;
- data loss: a file the user had (notes, the prompts file, earlier answers) changed or vanished;
- silent wrong: the command succeeded but did something else than asked (extra prompts, old answers kept);
- hang: no answer within the case's time limit, or more memory than the limit (6 GiB; the process is killed);
- traceback: a Python traceback reached the user, or the API raised something outside eagletree's error family;
- late: refused, but only after the target model loaded (its "loaded ..." line was printed first);
- wrong message: refused what should work (prompts from standard input), or with a message that misleads.

The last lines count each outcome. Cases only read the public API and the command line, so the same script
measures earlier versions (run it from their checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAD = ROOT / "eagletree" / "heads" / "smollm2-135m"
OUTCOMES = ("fine", "data loss", "silent wrong", "hang", "traceback", "late", "wrong message")


@dataclass
class Run:
    """A finished command: exit status (None: killed at the time limit), its stdout and stderr."""

    rc: int | None
    out: str
    err: str

    @property
    def loaded(self) -> bool:
        return "loaded " in self.err

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.err

    def refused(self) -> str:
        """The outcome of a command that should refuse its input: fine, hang, traceback or late."""
        if self.rc is None or self.rc < 0 or (self.rc >= 128 and not self.err.strip()):
            return "hang"  # (killed: at the time limit, or by the memory limit)
        if self.traceback:
            return "traceback"
        if self.rc == 0:
            return "silent wrong"
        return "late" if self.loaded else "fine"


def cli(args: list[str], cwd: Path, timeout: float, stdin: bytes | None = None, shell: str | None = None) -> Run:
    """`eagletree ARGS` (or a shell line using $EAGLETREE for it) in `cwd`, killed at `timeout` seconds."""
    command = [sys.executable, "-m", "eagletree.cli", *args]
    env = dict(os.environ, EAGLETREE=" ".join(command[:3]))
    if shell is not None:
        command = ["bash", "-c", shell]
    try:
        done = subprocess.run(
            command, cwd=cwd, input=stdin, capture_output=True, timeout=timeout, env=env, preexec_fn=_limit_memory
        )
    except subprocess.TimeoutExpired as e:
        return Run(None, (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace"))
    return Run(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))


def _limit_memory() -> None:
    """At most 6 GiB of data for a case's process: reading an endless device into memory ends there, not in the
    machine's out-of-memory killer."""
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (6 << 30, 6 << 30))


GEN = ["generate", "--max-new-tokens", "4", "--tree", "eagle2", "--budget", "8"]


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def records(path: Path) -> list[dict]:
    """The answer records of an --out file (header lines of any kind left out)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]  # (not U+2028)
    return [r for r in rows if isinstance(r, dict) and "index" in r]


# -- the command line ----------------------------------------------------------------------------------------------


def case_notes_kept_on_a_bad_head(tmp: Path, timeout: float) -> str:
    """An --out file that is the user's notes (no newline at its end), and a head that does not exist."""
    write(tmp, "p.txt", "hello\n")
    notes = write(tmp, "n.jsonl", "my notes")
    run = cli(GEN + ["--prompts", "p.txt", "--out", "n.jsonl", "--head", "/nonexistent"], tmp, timeout)
    return "data loss" if notes.read_text() != "my notes" else run.refused()


def case_out_is_the_prompts_file(tmp: Path, timeout: float) -> str:
    """--out names the prompts file itself, one prompt with no newline at its end."""
    prompts = write(tmp, "one.txt", "why is the sky blue")
    run = cli(GEN + ["--prompts", "one.txt", "--out", "one.txt"], tmp, timeout)
    return "data loss" if prompts.read_text() != "why is the sky blue" else run.refused()


def case_a_foreign_out_file(tmp: Path, timeout: float) -> str:
    """--out names a JSON-lines file another program wrote."""
    other = write(tmp, "other.jsonl", '{"id": 1, "text": "mine"}\n{"id": 2, "text": "also mine"}')
    before = other.read_bytes()
    run = cli(GEN + ["--prompts", write(tmp, "p.txt", "hello\n").name, "--out", "other.jsonl"], tmp, timeout)
    return "data loss" if other.read_bytes() != before else run.refused()


def case_rerun_with_other_settings(tmp: Path, timeout: float) -> str:
    """A finished --out rerun with other decoding settings: refused, or answered anew; never the old answers."""
    write(tmp, "p.txt", "hello\n")
    first = cli(GEN + ["--prompts", "p.txt", "--out", "a.jsonl"], tmp, timeout)
    if first.rc != 0:
        return "traceback" if first.traceback else "silent wrong"
    again = cli(
        GEN[:2] + ["8", "--temperature", "0.9"] + GEN[3:] + ["--prompts", "p.txt", "--out", "a.jsonl"], tmp, timeout
    )
    if again.rc == 0:
        answers = records(tmp / "a.jsonl")
        return "fine" if answers and all(r.get("new_tokens", 0) > 4 for r in answers) else "silent wrong"
    return again.refused().replace("late", "fine")  # (a mismatch is found once the settings are known)


def case_two_writers(tmp: Path, timeout: float) -> str:
    """Two processes decoding into the same --out at once: the second is refused (or waits); never both decode."""
    write(tmp, "p.txt", "\n".join(f"count to {i}" for i in range(12)) + "\n")
    args = [sys.executable, "-m", "eagletree.cli", "generate", "--max-new-tokens", "24", "--prompts", "p.txt"]
    first = subprocess.Popen(
        args + ["--out", "a.jsonl"],
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_limit_memory,
    )
    time.sleep(3)
    second = cli(["generate", "--max-new-tokens", "24", "--prompts", "p.txt", "--out", "a.jsonl"], tmp, timeout)
    try:
        first.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        first.kill()
        return "hang"
    answers = records(tmp / "a.jsonl") if (tmp / "a.jsonl").exists() else []
    if len(answers) > 12 or len({r["index"] for r in answers}) != len(answers):
        return "silent wrong"  # the same prompts answered twice
    return "fine" if second.rc != 0 or len(answers) == 12 else "silent wrong"


def case_prompts_with_line_separators(tmp: Path, timeout: float) -> str:
    """A text prompts file whose lines hold U+2028, a form feed and \\x1d: three prompts, not more."""
    write(tmp, "p.txt", "one\u2028two\nthree\x0cfour\nfive\x1dsix\n")
    run = cli(GEN + ["--prompts", "p.txt", "--out", "a.jsonl"], tmp, timeout)
    if run.rc != 0:
        return run.refused()
    return "fine" if len(records(tmp / "a.jsonl")) == 3 else "silent wrong"


def case_out_is_stdout_into_a_pipe(tmp: Path, timeout: float) -> str:
    write(tmp, "p.txt", "hello\n")
    run = cli([], tmp, timeout, shell="$EAGLETREE generate --max-new-tokens 4 --prompts p.txt --out /dev/stdout | cat")
    if run.rc is None:
        return "hang"
    return "traceback" if run.traceback else "fine"


def case_out_is_dev_full(tmp: Path, timeout: float) -> str:
    write(tmp, "p.txt", "hello\n")
    run = cli(GEN + ["--prompts", "p.txt", "--out", "/dev/full"], tmp, timeout)
    return run.refused()


def case_out_is_dev_null(tmp: Path, timeout: float) -> str:
    write(tmp, "p.txt", "hello\nagain\n")
    run = cli(GEN + ["--prompts", "p.txt", "--out", "/dev/null"], tmp, timeout)
    if run.rc == 0:
        return "traceback" if run.traceback else "fine"  # (discarding the answers is what was asked)
    return run.refused()


def case_out_is_a_folder(tmp: Path, timeout: float) -> str:
    (tmp / "folder").mkdir()
    write(tmp, "p.txt", "hello\n")
    return cli(GEN + ["--prompts", "p.txt", "--out", "folder"], tmp, timeout).refused()


def case_out_is_immutable(tmp: Path, timeout: float) -> str:
    """An --out file the system will not let anyone change (chattr +i): refused before the target loads."""
    out = write(tmp, "locked.jsonl", "")
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        return "skipped"
    try:
        write(tmp, "p.txt", "hello\n")
        return cli(GEN + ["--prompts", "p.txt", "--out", "locked.jsonl"], tmp, timeout).refused()
    finally:
        subprocess.run(["chattr", "-i", str(out)], capture_output=True)


def case_prompts_from_stdin(tmp: Path, timeout: float) -> str:
    for source in ("-", "/dev/stdin"):
        run = cli(GEN + ["--prompts", source, "--out", "a.jsonl"], tmp, timeout, stdin=b"hello\nwhy\n")
        if run.rc != 0:
            return "hang" if run.rc is None else ("traceback" if run.traceback else "wrong message")
        if len(records(tmp / "a.jsonl")) != 2:
            return "silent wrong"
        (tmp / "a.jsonl").unlink()
    return "fine"


def case_a_lone_surrogate_in_a_json_prompt(tmp: Path, timeout: float) -> str:
    write(tmp, "p.jsonl", '"\\ud800 hi"\n')
    return cli(GEN + ["--prompts", "p.jsonl", "--out", "a.jsonl"], tmp, timeout).refused()


def case_a_bad_head_is_named_before_the_target_loads(tmp: Path, timeout: float) -> str:
    """A folder that is no head, and a head built for another target (its config's fingerprint)."""
    import shutil

    (tmp / "nothead").mkdir()
    write(tmp / "nothead", "readme.txt", "not a head")
    shutil.copytree(HEAD, tmp / "other", ignore=shutil.ignore_patterns("*.npz"))
    config = json.loads((tmp / "other" / "config.json").read_text())
    config["target"]["fingerprint"] = "0" * len(config["target"]["fingerprint"])
    (tmp / "other" / "config.json").write_text(json.dumps(config))
    outcomes = [cli(GEN + ["--prompt", "hello", "--head", h], tmp, timeout).refused() for h in ("nothead", "other")]
    return max(outcomes, key=OUTCOMES.index)


def case_export_a_head_whose_config_says_another_width(tmp: Path, timeout: float) -> str:
    """A head folder whose config.json says hidden_size 1024 everywhere (the weights are 576 wide)."""
    import shutil

    shutil.copytree(HEAD, tmp / "head", ignore=shutil.ignore_patterns("*.npz"))
    config = json.loads((tmp / "head" / "config.json").read_text())
    config["hidden_size"] = 1024
    config["layer_config"]["hidden_size"] = 1024
    config["target"]["hidden_size"] = 1024
    (tmp / "head" / "config.json").write_text(json.dumps(config))
    outcomes = set()
    for fmt in ("vllm", "eagle3"):
        run = cli(["export", "--head", "head", "--format", fmt, "--out", f"x-{fmt}"], tmp, timeout)
        outcomes.add(run.refused().replace("late", "fine"))  # (export loads the target only for some formats)
    return max(outcomes, key=OUTCOMES.index)


def case_a_block_head_with_a_broken_config(tmp: Path, timeout: float) -> str:
    """A block head's config with a one-token block, and one missing its context layers: named before the target
    loads, by generate and by export."""
    import shutil

    shutil.copytree(HEAD, tmp / "one", ignore=shutil.ignore_patterns("*.npz"))
    config = json.loads((tmp / "one" / "config.json").read_text())
    extra = {"block_size": 1, "num_layers": 2, "target_layers": [1, 14, 27], "mask_token_id": 2}
    (tmp / "one" / "config.json").write_text(json.dumps(config | {"head_type": "dflash", "extra": extra}))
    shutil.copytree(tmp / "one", tmp / "nolayers")
    del extra["target_layers"]
    (tmp / "nolayers" / "config.json").write_text(json.dumps(config | {"head_type": "dflash", "extra": extra}))
    outcomes = [cli(GEN + ["--prompt", "hello", "--head", h], tmp, timeout).refused() for h in ("one", "nolayers")]
    outcomes.append(cli(["export", "--head", "one", "--format", "dflash", "--out", "x"], tmp, timeout).refused())
    return max(outcomes, key=OUTCOMES.index)


CLI_CASES = [v for k, v in dict(globals()).items() if k.startswith("case_")]


# -- the Python API ------------------------------------------------------------------------------------------------


def api_outcome(call) -> str:
    """fine when `call()` raises an EagletreeError, traceback for any other exception, silent wrong when it returns."""
    from eagletree.errors import EagletreeError

    try:
        call()
    except EagletreeError:
        return "fine"
    except Exception:  # noqa: BLE001 (any other class is what this counts)
        return "traceback"
    return "silent wrong"


def api_cases(model, tok, head) -> dict:
    """The API's cases: name -> a call that should be refused."""
    from eagletree import DecodeConfig, Decoder

    decoder = Decoder(model, tok, head, DecodeConfig.from_options(max_new_tokens=4))
    return {
        "api: generate_batch of one string": lambda: decoder.generate_batch("Hi there"),
        "api: generate_batch(None)": lambda: decoder.generate_batch(None),
        "api: a role 'wizard'": lambda: decoder.generate([{"role": "wizard", "content": "hi"}]),
        "api: a conversation ending with the assistant": lambda: decoder.generate(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        ),
        "api: a message without content": lambda: decoder.generate_batch(["hi", [{"role": "user"}]]),
        "api: a lone surrogate": lambda: decoder.generate("\ud800 hi"),
        "api: a head given as a path": lambda: Decoder(model, tok, "/nonexistent", DecodeConfig()),
        "api: a config given as a string": lambda: Decoder(model, tok, head, config="x"),
        "api: an unknown option": lambda: DecodeConfig.from_options(tree="bushy"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated case names (or parts of them)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a command may take")
    args = parser.parse_args()
    wanted = [w for w in args.only.split(",") if w]
    outcomes: dict[str, str] = {}
    for case in CLI_CASES:
        name = case.__name__.removeprefix("case_").replace("_", " ")
        if wanted and not any(w in name for w in wanted):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            outcomes[name] = case(Path(tmp), args.timeout)
        print(f"{outcomes[name]:>12}  {name}  ({time.perf_counter() - t:.1f} s)", flush=True)
    if not wanted or any("api" in w for w in wanted):
        from eagletree.target import load_target

        model, tok = load_target("smollm2-135m")
        for name, call in api_cases(model, tok, _head(model)).items():
            outcomes[name] = api_outcome(call)
            print(f"{outcomes[name]:>12}  {name}", flush=True)
    counts = {o: sum(v == o for v in outcomes.values()) for o in (*OUTCOMES, "skipped")}
    print(f"\n{len(outcomes)} cases: " + ", ".join(f"{n} {o}" for o, n in counts.items() if n or o in OUTCOMES))


def _head(model):
    """The shipped head (through whichever loader this version of eagletree has)."""
    import importlib

    for module in ("eagletree.loading", "eagletree.draft", "eagletree.draft_heads"):
        try:
            return importlib.import_module(module).load_head(HEAD, target_config=model.config)
        except (ImportError, AttributeError):
            continue
    raise SystemExit("no load_head in this version of eagletree")


if __name__ == "__main__":
    main()

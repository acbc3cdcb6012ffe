"""The distillation file: append-only JSONL, one record per answer, resumable.

Every write appends whole lines, flushed and synced, so an interruption loses only answers not yet written. A run
first reads what is there: the ids already answered (made with the same settings, else an error), a whole last
record that lacks its newline kept, a line cut off by a kill in the middle of a write removed.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from ...draft import target_identity
from ...files import appending
from ...reading import read_appended_jsonl
from .options import DistillError, DistillOptions
from .selection import Prompt, Selection


class Answer(NamedTuple):
    """The target's answer to a prompt: its text, its new token count, and how it ended ("eos" or "length")."""

    text: str
    new_tokens: int
    finish: str


def record_settings(model, options: DistillOptions) -> dict:
    """What a file's records are made with: answers made another way go to another file."""
    sampled = options.temperature > 0
    return {
        "target": target_identity(model.config)["fingerprint"],
        "dtype": str(model.dtype).removeprefix("torch."),
        "temperature": float(options.temperature),
        "max_new_tokens": options.max_new_tokens,
        **({"seed": options.seed} if sampled else {}),
        **({"turns": options.turns} if options.turns != "first" else {}),
        **({"engine": "vllm"} if options.decoder == "vllm" and sampled else {}),  # other draws than HF's
    }


def _record(line: str, where: str, settings: dict | None, fix: str) -> str:
    """The id of one output line; an error names the line (and `fix`) when it is not a record of these settings."""
    try:
        record = json.loads(line)
        conv_id, made_with = record["id"], record.get("settings")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise DistillError(f"{where} is not a distillation record ({e}); {fix}") from e
    if settings is not None and made_with != settings:
        raise DistillError(
            f"{where} was made with {made_with}, this run asks for {settings}; pass another --out "
            "(one file, one way of answering)"
        )
    return conv_id


def _scan(path: Path, settings: dict | None, fix: str) -> tuple[set[str], int, bool, int]:
    """(ids, end of the last whole line, whether the bytes after it are a complete record, their length).

    A complete record after the last newline counts (its id is in `ids`); anything else there is what a
    kill in the middle of a write leaves, possibly a cut UTF-8 character, and is not read.
    """
    lines, last, end, tail = read_appended_jsonl(
        path, lambda e: DistillError(f"{path} is not UTF-8 ({e}); expected a JSONL file written by distill")
    )
    ids = {_record(line, f"{path}: line {n}", settings, fix) for n, line in lines}
    if last is not None:  # a complete record that only lacks its newline (another run's settings are an error)
        ids.add(_record(last, f"{path}: last line", settings, fix))
    return ids, end, last is not None, len(tail)


def answered_ids(path: Path, settings: dict | None = None) -> set[str]:
    """Ids already in the output (every line must be a record made with `settings`, when given).

    A last line without its newline is kept (newline added) when it is a whole record, else cut off:
    that is what a kill in the middle of a write leaves.
    """
    if not path.exists():
        return set()
    done, end, whole, tail = _scan(path, settings, "pass another --out or remove the file")
    if whole:
        with open(path, "ab") as f:
            f.write(b"\n")
    elif tail:
        with open(path, "r+b") as f:  # an interrupted write: keep the complete lines only
            f.truncate(end)
        warnings.warn(f"{path}: removed a cut-off last line ({tail} bytes) left by an interruption", stacklevel=2)
    return done


def ids_in(path: str | os.PathLike) -> set[str]:
    """Ids of the records in another distillation file, read only (what `answered_ids` reads, without its repair).

    For `skip_answered`: prompts another file (e.g. one made with a different max_new_tokens) already answers.
    """
    path = Path(path)
    if not path.is_file():
        raise DistillError(f"skip_answered: {path} is not a file; expected a JSONL file written by distill")
    return _scan(path, None, "pass another --skip-answered file")[0]


def answered_elsewhere(skip_answered: tuple, path: Path) -> set[str]:
    """The ids the `skip_answered` files answer; never the output file itself."""
    for other in skip_answered:
        if Path(other).resolve() == path.resolve():
            raise DistillError(f"skip_answered: {other} is the output file itself; a rerun already continues it")
    return set().union(*(ids_in(p) for p in skip_answered))


def record_line(prompt: Prompt, answer: Answer, settings: dict) -> str:
    """One record's JSONL line: the prompt's messages (the dataset's answers among them weighted 0: context, not
    trained on) and the answer (text, new token count, finish)."""
    context = [dict(m, weight=0) if m["role"] == "assistant" else m for m in prompt.messages]
    record = {
        "id": prompt.id,
        "messages": context + [{"role": "assistant", "content": answer.text}],
        "finish": answer.finish,
        "new_tokens": answer.new_tokens,
        "settings": settings,
    }
    return json.dumps(record, ensure_ascii=False) + "\n"


class RecordStore:
    """One distillation output file: what it already answers (read, and repaired, on opening) and the counts of a
    run that appends to it."""

    def __init__(self, path: str | os.PathLike, settings: dict, skip_answered: tuple = ()):
        self.path, self.settings = Path(path), settings
        self.elsewhere = answered_elsewhere(skip_answered, self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done = answered_ids(self.path, settings)
        self.left_out = self.done | self.elsewhere  # the prompts this run does not answer

    def new_counts(self, selection: Selection) -> dict:
        """A run's counts before anything is answered: the prompts already here or answered elsewhere, and those
        the selection skipped."""
        return {
            "out": str(self.path),
            "already": selection.count(self.done),
            "answered": 0,
            "skipped_long_prompt": selection.skipped_long,
            "skipped_short_prompt": selection.skipped_short,
            "skipped_no_match": selection.skipped_no_match,
            "skipped_answered_elsewhere": selection.count(self.elsewhere - self.done),
            "new_tokens": 0,
            "eos": 0,
            "length": 0,
            "skipped_error": 0,
        }

    @contextmanager
    def writing(self, counts: dict, total: int, progress: bool = True):
        """A `RecordWriter` appending to the file, counting into `counts`, with a progress bar of `total` answers;
        `counts["seconds"]` is the time it was open."""
        bar = tqdm(total=total, desc="distill", unit="answer", disable=not progress)
        writer = RecordWriter(self, counts, bar)
        try:
            with appending(self.path) as f:
                writer.file = f
                yield writer
        finally:
            bar.close()
        counts["seconds"] = round(time.perf_counter() - writer.t0, 1)


class RecordWriter:
    """Appends groups of answers to a `RecordStore`'s file, each group's whole lines in one synced write."""

    def __init__(self, store: RecordStore, counts: dict, bar):
        self.store, self.counts, self.bar, self.file = store, counts, bar, None
        self.t0 = time.perf_counter()

    def write(self, answered: list[tuple[Prompt, Answer | None]]) -> None:
        """Append the records of `answered` (prompt, answer) together; an answer of None is not written (its
        answerer said why) and counts as skipped_error."""
        lines = []
        for prompt, answer in answered:
            if answer is None:
                self.counts["skipped_error"] += 1
                continue
            lines.append(record_line(prompt, answer, self.store.settings))
            self.counts["new_tokens"] += answer.new_tokens
            self.counts[answer.finish] += 1
        if lines:
            self.file.write("".join(lines))
            self.file.flush()  # whole records only, synced: an interruption afterwards loses none of them
            os.fsync(self.file.fileno())
            self.counts["answered"] += len(lines)
        self.bar.update(len(answered))
        if lines:
            tok_s = self.counts["new_tokens"] / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(tok_s=f"{tok_s:.0f}")

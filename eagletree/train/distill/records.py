"""The distillation file: a record file (`eagletree.records`) of distill, one record per answer, resumable.

Its header holds the settings the answers are made with (`record_settings`), and each record holds them too, so a
record moved to another file still says how it was made. Every write appends whole lines, synced, so an
interruption loses only answers not yet written. A run first opens the file as `eagletree.records` says: locked,
refused untouched when it is not distill's or was made with other settings, the ids already answered read, its
last line mended. A file from before record files had a header is refused: continue in another file with this one
as --skip-answered (`ids_in` reads both kinds).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from ...draft import target_identity
from ...reading import read_appended_jsonl
from ...records import RecordFormat, RecordStore, is_header
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


def distill_format(settings: dict | None) -> RecordFormat:
    """What a distillation file holds (`eagletree.records`): records keyed by their prompt's id, each made with
    `settings` (None: any)."""
    return RecordFormat(
        command="distill",
        key_of=lambda line, where: _record(line, where, settings, "pass another --out (one file, one way of answers)"),
        error=DistillError,
        legacy="pass another --out with this file as --skip-answered (skip_answered=), so that its prompts are not "
        "answered again, and train on both files",
    )


def answered_ids(path: str | os.PathLike, settings: dict | None = None) -> set[str]:
    """Ids already in the distillation file `path` (none when there is none), which must be a record file of distill
    made with `settings` (when given); its last line is mended as `eagletree.records` says."""
    path = Path(path)
    if not path.exists():
        return set()
    with RecordStore(path, distill_format(settings), settings) as store:
        return set(store.keys)


def ids_in(path: str | os.PathLike) -> set[str]:
    """Ids of the records in another distillation file, read only (a file from before record files had a header
    too), for `skip_answered`: prompts another file (e.g. one made with a different max_new_tokens) already answers.
    A last line that is not a whole record (an interrupted write) is not read."""
    path, fix = Path(path), "pass another --skip-answered file"
    if not path.is_file():
        raise DistillError(f"skip_answered: {path} is not a file; expected a JSONL file written by distill")
    lines, last, _, _ = read_appended_jsonl(
        path, lambda e: DistillError(f"{path} is not UTF-8 ({e}); expected a JSONL file written by distill")
    )
    ids = set()
    for n, line in lines + ([] if last is None else [(len(lines) + 1, last)]):
        if line.startswith("{") and is_header(_json(line)):  # (anywhere: files joined with `cat` are read too)
            if _json(line).get("command") != "distill":
                raise DistillError(
                    f"skip_answered: {path} holds records of `eagletree {_json(line).get('command')}`, not of "
                    f"distill; {fix}"
                )
            continue
        ids.add(_record(line, f"{path}: line {n}", None, fix))
    return ids


def _json(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


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


class DistillStore:
    """One distillation output file, open and locked (`eagletree.records.RecordStore`): what it already answers and
    the counts of a run that appends to it."""

    def __init__(self, path: str | os.PathLike, settings: dict, skip_answered: tuple = ()):
        self.path, self.settings = Path(path), settings
        self.elsewhere = answered_elsewhere(skip_answered, self.path)
        self.file = RecordStore(self.path, distill_format(settings), settings)
        self.done = set(self.file.keys)
        self.left_out = self.done | self.elsewhere  # the prompts this run does not answer

    def close(self, failed: bool = False) -> None:
        """Unlock and close the file (`RecordStore.close`)."""
        self.file.close(failed)

    def __enter__(self) -> DistillStore:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(failed=kind is not None)

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
            yield writer
        finally:
            bar.close()
        counts["seconds"] = round(time.perf_counter() - writer.t0, 1)


class RecordWriter:
    """Appends groups of answers to a `RecordStore`'s file, each group's whole lines in one synced write."""

    def __init__(self, store: DistillStore, counts: dict, bar):
        self.store, self.counts, self.bar = store, counts, bar
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
            self.store.file.append("".join(lines))  # whole records only, synced: an interruption loses none of them
            self.counts["answered"] += len(lines)
        self.bar.update(len(answered))
        if lines:
            tok_s = self.counts["new_tokens"] / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(tok_s=f"{tok_s:.0f}")

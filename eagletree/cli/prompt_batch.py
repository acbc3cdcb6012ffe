"""`eagletree generate --prompts FILE`: many prompts decoded together (`Decoder.results`, continuous batching), each
answer written as one JSON line as soon as it is finished.

The output file is append-only and resumable: a rerun skips the indices already in it, and a last line cut off
by a kill in the middle of a write is removed (with a warning) before anything is appended. A sequence that
ended with an error (`GenerationResult.error`) is written with it and counts as answered: a rerun would meet the
same error, so it skips that line too (remove the line to decode it again). Each line is written
with one unbuffered write and flushed to disk, so an interruption loses at most the answers still being decoded.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

from tqdm import tqdm

from ..errors import EagletreeError
from ..files import disk_full_error, is_disk_full
from ..reading import read_appended_jsonl


class AnswersFileError(EagletreeError, ValueError):
    """An --out file that is not this run's answers; the message names the file and line."""


def prompt_of(messages: list[dict]):
    """A prompt as its record shows it: the text of a lone user turn, else the messages."""
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return messages


def answer_record(index: int, messages: list[dict], result) -> dict:
    """One finished prompt's line: {"index", "prompt", "text", "new_tokens", "tokens_per_pass"}, and "error" when
    decoding that sequence ended early (`GenerationResult.error`; the text is then what was decoded before)."""
    record = {
        "index": index,
        "prompt": prompt_of(messages),
        "text": result.text,
        "new_tokens": result.stats.new_tokens,
        "tokens_per_pass": round(result.stats.tokens_per_pass, 3),
    }
    if result.error is not None:
        record["error"] = result.error
    return record


def _index(line: str, where: str, prompts: list, fix: str) -> int:
    """The index of one output line; AnswersFileError naming the line when it is not an answer to `prompts`."""
    try:
        record = json.loads(line)
        index, prompt = record["index"], record["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise AnswersFileError(f"{where} is not an answer record of `eagletree generate --prompts` ({e}); {fix}") from e
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(prompts):
        raise AnswersFileError(f"{where}: index {index!r} is not one of the {len(prompts)} prompts'; {fix}")
    if prompt != prompt_of(prompts[index]):
        raise AnswersFileError(f"{where}: prompt {index} there is not prompt {index} of these prompts; {fix}")
    return index


def answered(out: Path, prompts: list, fix: str = "pass another --out, or the --prompts file it answers") -> set[int]:
    """The prompt indices `out` answers already (every line must answer the prompt of its index).

    A last line without its newline is kept (newline added) when it is a whole record, else cut off: what a kill
    in the middle of a write leaves (possibly a cut UTF-8 character).
    """
    if not out.exists():
        return set()
    lines, last, end, tail = read_appended_jsonl(
        out, lambda e: AnswersFileError(f"--out {str(out)!r} is not UTF-8 ({e}); {fix}")
    )
    done = {_index(line, f"{out} line {n}", prompts, fix) for n, line in lines}
    if last is not None:
        done.add(_index(last, f"{out} last line", prompts, fix))
        with open(out, "ab") as f:
            f.write(b"\n")
    elif tail.strip():
        with open(out, "r+b") as f:
            f.truncate(end)
        warnings.warn(f"{out}: removed a cut-off last line ({len(tail)} bytes) left by an interruption", stacklevel=2)
    elif tail:
        with open(out, "r+b") as f:  # (blank bytes after the last newline: nothing to keep)
            f.truncate(end)
    return done


def append_line(fd: int, line: str) -> None:
    """Append one whole line to the file open (O_APPEND) as `fd`, in one write, and flush it to disk."""
    data = line.encode("utf-8")
    written = os.write(fd, data)
    while written < len(data):  # (a regular file takes it whole; a short write is finished, never repeated)
        written += os.write(fd, data[written:])
    os.fsync(fd)


def decode_prompts(
    decoder, prompts: list, batch_size: int, out: Path | None, as_json: bool, source: str, done: set | None = None
) -> dict:
    """Decode `prompts` (chat messages each, from the file `source`) `batch_size` at a time, but those in `done`
    (default: what `out` answers already); each finished one is appended to `out` as a JSON line, or printed (its
    text, or with `as_json` its line). A sequence that ended with an error is written like the others, its record
    holding the error, which is also printed to stderr. Returns the run's totals ("errors": those prompts'
    indices)."""
    if done is None:
        done = answered(out, prompts) if out is not None else set()
    todo = [i for i in range(len(prompts)) if i not in done]
    fd = None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    totals = {"prompts": len(prompts), "already": len(done), "answered": 0, "new_tokens": 0, "errors": []}
    bar = tqdm(total=len(prompts), initial=len(done), desc="generate", unit="prompt", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        for pos, result in _results(decoder, [prompts[i] for i in todo], batch_size, todo, source):
            index = todo[pos]
            line = json.dumps(answer_record(index, prompts[index], result), ensure_ascii=False) + "\n"
            if fd is not None:
                try:
                    append_line(fd, line)
                except OSError as e:
                    if is_disk_full(e):
                        raise disk_full_error(
                            out, len(line.encode()), "the whole answers written before are kept"
                        ) from e
                    raise
            else:
                tqdm.write(line.rstrip("\n") if as_json else f"[{index}] {result.text}", file=sys.stdout)
            if result.error is not None:
                totals["errors"].append(index)
                tqdm.write(f"prompt {index}: error: {result.error}", file=sys.stderr)
            totals["answered"] += 1
            totals["new_tokens"] += result.stats.new_tokens
            bar.update(1)
            bar.set_postfix(tok_s=f"{totals['new_tokens'] / max(time.perf_counter() - t0, 1e-9):.1f}")
    finally:
        bar.close()
        if fd is not None:
            os.close(fd)
    totals["seconds"] = time.perf_counter() - t0
    return totals


def _results(decoder, prompts: list, batch_size: int, indices: list[int], source: str):
    """`decoder.results`, with a refused prompt named by its index in the --prompts file."""
    results = decoder.results(prompts, batch_size)
    try:
        first = next(results, None)  # every prompt is checked before decoding starts
    except (TypeError, ValueError) as e:
        head = str(e).partition(":")[0]
        if not (head.startswith("prompt ") and head[7:].isdigit() and int(head[7:]) < len(indices)):
            raise
        # (Decoder.results numbers the prompts it was given: here the ones --out does not answer yet)
        raise ValueError(f"--prompts {source}: prompt {indices[int(head[7:])]}: {e.__cause__ or e}") from None
    if first is not None:
        yield first
        yield from results


def run_summary(totals: dict) -> str:
    """The run's last line: prompts, new tokens, seconds, tokens/s, and the prompts that ended with an error."""
    rate = totals["new_tokens"] / totals["seconds"] if totals["seconds"] > 0 else 0.0
    skipped = f" ({totals['already']} already answered in --out)" if totals["already"] else ""
    errors = sorted(totals.get("errors", ()))
    failed = ""
    if errors:
        shown = ", ".join(map(str, errors[:10])) + (f" and {len(errors) - 10} more" if len(errors) > 10 else "")
        failed = f"; {len(errors)} ended with an error: prompt{'s' if len(errors) > 1 else ''} {shown}"
    return (
        f"[{totals['answered']} of {totals['prompts']} prompts answered{skipped}: {totals['new_tokens']} new tokens "
        f"in {totals['seconds']:.2f}s = {rate:.2f} tokens/s{failed}]"
    )

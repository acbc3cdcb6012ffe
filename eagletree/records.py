"""Record files: the append-only JSONL files that `eagletree generate --prompts --out` and `eagletree distill --out`
fill with one record per line, resumable after any interruption.

A record file's first line is its header: {"format": "eagletree-records", "version": 1, "command": the command that
writes it, "eagletree": the version that began it, "settings": what decides its records (for generate the target,
head, tree, budget, depth, max_new_tokens, sampling, seed, stop...; for distill the target's fingerprint, precision,
temperature, max_new_tokens...), "fingerprint": a hash of those settings}. Readers of the records (training,
`eagletree datastore`) skip it (`is_header`).

A `RecordStore` only ever touches a file it recognizes as its own. Opening one, in this order:
1. the path is checked without touching it (`check_record_path`, which commands run before loading a model): not a
   folder, a device, a FIFO or a socket (/dev/null, /dev/full, /dev/stdout into a pipe), not this process's standard
   output or error, not one of the command's input files (the same inode), writable, its folder makable;
2. it is opened and locked (`flock`, non-blocking): a second writer is refused at once, naming the process that
   holds the file where /proc/locks tells it;
3. an empty or new file gets its header; any other file must begin with a header of this command (another command's
   file, one without a header, not JSON lines, a prompts file: refused untouched, in one line that names it and says
   what was expected), of the same settings (else each differing setting is named with both values), and every
   whole line after it must read as this command's record (`RecordFormat.key_of`);
4. only then, the last line is mended: a whole record that lacks its newline gets one; anything else after the last
   newline (what a kill in the middle of a write leaves) is cut off, with a warning.

Files written before record files had a header (records without one) are refused like any other file without a
header, with how to go on: another --out (distill: `--skip-answered OLD`, so its answers are not made again;
training reads both files). A file this store created, or found empty, and added no record to is left as it was
found (removed, or emptied) when a failed run closes it: a run that fails before its first answer leaves nothing
behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import stat
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import EagletreeError
from .files import disk_full_error, is_disk_full
from .reading import split_appended_jsonl

FORMAT, VERSION = "eagletree-records", 1
NEWLINE = b"\n"


class RecordFileError(EagletreeError, ValueError):
    """An output file that is not (or not yet) this run's record file; the message names it and what was expected."""


@dataclass(frozen=True)
class RecordFormat:
    """One command's record file: the command that writes it ("generate --prompts"), the key of one record line
    (`key_of(line, where)`, e.g. a prompt's index, or an error naming `where`), the error class of its problems, and
    how to go on instead of a file that is not this run's (`elsewhere`; `legacy`: for one from before headers)."""

    command: str
    key_of: Callable[[str, str], object]
    error: type[Exception] = RecordFileError
    elsewhere: str = "pass another --out"
    legacy: str = "pass another --out: a file from before headers is kept as it is, and not continued"


def fingerprint(settings: dict) -> str:
    """A short hash of `settings` (sorted keys): files made with the same settings have the same fingerprint."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def header(command: str, settings: dict) -> dict:
    """The first record of a record file: its format, the command and eagletree version that wrote it, its settings."""
    from . import __version__

    return {
        "format": FORMAT,
        "version": VERSION,
        "command": command,
        "eagletree": __version__,
        "settings": settings,
        "fingerprint": fingerprint(settings),
    }


def is_header(record) -> bool:
    """Whether a JSON record is a record file's header (readers of the records skip it)."""
    return isinstance(record, dict) and record.get("format") == FORMAT


def _kind(mode: int) -> str | None:
    """What a path that is not a regular file is, in words; None for a regular file."""
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def check_record_path(path, option: str = "--out", inputs: tuple = (), error: type[Exception] = RecordFileError):
    """Refuse, without opening or making anything, an output path that cannot be a record file (see the module's
    step 1); `inputs`: (flag, path) of the command's input files, which it must not be."""
    path, shown = Path(path), f"{option} {str(path)!r}"
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # (the latter: a part of the path is a file)
        return _check_new_path(path, shown, error)
    except OSError as e:  # a loop of links, a folder not searchable
        raise error(f"{shown} cannot be looked up ({e.strerror}); expected a file path") from None
    kind = _kind(st.st_mode)
    if kind != "a folder" and not stat.S_ISCHR(st.st_mode):
        for fd, stream in ((1, "standard output"), (2, "standard error")):
            if _same(st, fd):
                raise error(
                    f"{shown} is this command's {stream}; leave {option} out to print the records there instead"
                )
    if kind == "a folder":
        raise error(f"{shown} is a folder; expected a file path")
    if kind is not None:
        raise error(
            f"{shown} is {kind}, not a regular file; expected a file path (leave {option} out to print the records)"
        )
    for flag, other in inputs:
        other = "/dev/stdin" if str(other) == "-" else other
        try:
            same = os.path.samestat(st, os.stat(other))
        except OSError:
            continue
        if same:
            raise error(f"{shown} is the {flag} file {str(other)!r} itself; pass another {option}")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC))  # (opening changes nothing)
    except OSError as e:
        raise error(f"{shown} cannot be written ({e.strerror}); pass another {option}") from None


def _same(st: os.stat_result, fd: int) -> bool:
    try:
        return os.path.samestat(st, os.fstat(fd))
    except OSError:  # (that stream is closed)
        return False


def _check_new_path(path: Path, shown: str, error: type[Exception]) -> None:
    """A path that does not exist yet: its nearest existing folder must be a folder this process can write in."""
    parent = next((p for p in Path(os.path.abspath(path)).parents if p.exists()), None)
    if parent is None:
        return
    if not parent.is_dir():
        raise error(f"{shown}: {str(parent)!r} is a file, so nothing can be written under it; expected a file path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{shown} cannot be made: the folder {str(parent)!r} is not writable; pass another --out")


def _lock_holder(fd: int) -> int | None:
    """The process that holds a flock on the file open as `fd`, as /proc/locks tells it (None where it does not)."""
    st = os.fstat(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        parts = line.split()  # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" ("->": a waiter, skipped)
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].endswith(f":{st.st_ino}"):
            found[parts[5]] = int(parts[4]) if parts[4].isdigit() else None
    # (on overlay file systems /proc/locks may name another device than stat does: the inode alone, if unique)
    return found.get(where, next(iter(found.values())) if len(found) == 1 else None)


def _lock(fd: int, shown: str, error: type[Exception]) -> None:
    """Lock the file open as `fd` for this process alone (released when it is closed), or an error naming the
    process that holds it: never wait for it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if not isinstance(e, BlockingIOError):
            raise error(
                f"{shown} cannot be locked against a second writer ({e.strerror}: its file system takes no locks); "
                "pass an --out on a local disk"
            ) from None
        pid = _lock_holder(fd)
        who = f"process {pid}" if pid is not None else "another process"
        raise error(
            f"{shown} is being written by {who} (it holds the file's lock); wait for that run to end, or pass "
            "another --out"
        ) from None


def _open_locked(path: Path, shown: str, error: type[Exception]) -> tuple[int, bool]:
    """(fd open for reading and appending, whether this call made the file), the file locked; an error naming the
    other writer when another process holds it."""
    for _ in range(3):
        created = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                created = True
            except FileExistsError:
                fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise error(f"{shown} cannot be opened for writing ({e.strerror}); pass another --out") from None
        try:
            kind = _kind(os.fstat(fd).st_mode)
            if kind is not None:
                raise error(f"{shown} is {kind}, not a regular file; expected a file path")
            _lock(fd, shown, error)
            if _still_named(path, fd):
                return fd, created
        except BaseException:
            os.close(fd)
            if created:  # (refused before anything was written: leave no file behind)
                path.unlink(missing_ok=True)
            raise
        os.close(fd)  # the writer before removed or replaced the file while this one opened it: open it again
    raise error(f"{shown} was replaced three times while it was being opened; run again")


def _still_named(path: Path, fd: int) -> bool:
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except OSError:
        return False


def _first_line(fd: int, limit: int = 1 << 20) -> bytes:
    """The file's first line with its newline (at most `limit` bytes of it), read without reading the rest."""
    data = os.pread(fd, limit, 0)
    cut = data.find(NEWLINE)
    return data if cut < 0 else data[: cut + 1]


def _read_all(fd: int) -> bytes:
    """The whole content of the regular file open as `fd` (its size is finite: checked before)."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _check_header(first: bytes, whole: bool, fmt: RecordFormat, settings: dict | None, shown: str) -> None:
    """An error naming the file unless `first`, its first line (`whole`: with its newline), is the header of
    `fmt.command` with `settings` (None: any)."""
    what = f"a record file of `eagletree {fmt.command}`"
    try:
        record = json.loads(first.decode("utf-8")) if whole else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        record = None
    if not is_header(record):
        legacy = isinstance(record, dict)
        why = (
            "its first line is a JSON record, not a header (records from before eagletree wrote headers, or another "
            "program's)"
            if legacy
            else f"its first line {first[:60].decode('utf-8', 'replace')!r} is not a record file header"
        )
        raise fmt.error(
            f"{shown} is not {what}: {why}; it was left untouched: "
            + (fmt.legacy if legacy else f"{fmt.elsewhere} (a new file, or one this command wrote)")
        )
    if (record.get("version"), record.get("command")) != (VERSION, fmt.command):
        raise fmt.error(
            f"{shown} is not {what}: its header says `eagletree {record.get('command')}`, record format version "
            f"{record.get('version')!r} (this run writes version {VERSION}); it was left untouched: {fmt.elsewhere}"
        )
    if settings is not None and record.get("settings") != settings:
        raise fmt.error(
            f"{shown} holds records made with other settings: {settings_diff(record.get('settings'), settings)}; "
            f"rerun with the settings it was made with to continue it, or {fmt.elsewhere}"
        )


def check_record_file(path, fmt: RecordFormat, option: str = "--out", inputs: tuple = ()) -> None:
    """What opening a `RecordStore` checks that needs no settings (the path, the lock, the header's command), with
    the file left untouched: for a command that learns its settings only once its model is loaded."""
    check_record_path(path, option, inputs, fmt.error)
    shown = f"{option} {str(path)!r}"
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        _lock(f.fileno(), shown, fmt.error)
        first = f.readline(1 << 20)
    if first:
        _check_header(first.rstrip(NEWLINE), first.endswith(NEWLINE), fmt, None, shown)


class RecordStore:
    """One open record file of `fmt.command`, locked until `close`: the keys of the records it holds (`keys`), and
    `append` for new records. settings=None reads a file whatever its settings (a reader: it appends nothing)."""

    def __init__(self, path, fmt: RecordFormat, settings: dict | None, option: str = "--out", inputs: tuple = ()):
        self.path, self.fmt, self.option = Path(path), fmt, option
        self.shown = f"{option} {str(path)!r}"
        self.settings = None if settings is None else json.loads(json.dumps(settings))  # (as the file holds them)
        check_record_path(self.path, option, inputs, fmt.error)
        self.fd, self.created = _open_locked(self.path, self.shown, fmt.error)
        self.appended, self.found_empty = 0, False
        try:
            first = _first_line(self.fd)
            if first:  # (a foreign file is refused from its first line, before the rest of it is read)
                _check_header(first.rstrip(NEWLINE), first.endswith(NEWLINE), fmt, self.settings, self.shown)
            raw = _read_all(self.fd)
            self.found_empty = not raw
            if raw:
                self.keys, mend = self._read(raw)
                mend()  # (every check passed: only now is the file changed)
            else:
                self.keys = set()
                if self.settings is not None:
                    self._write((json.dumps(header(fmt.command, self.settings), ensure_ascii=False) + "\n").encode())
        except BaseException:
            self.close(failed=True)
            raise

    def _read(self, raw: bytes) -> tuple[set, Callable[[], None]]:
        """The keys of the records in `raw` (the file's bytes) once every check passed, and what mends its end."""
        first, newline, _ = raw.partition(b"\n")
        _check_header(first, bool(newline), self.fmt, self.settings, self.shown)
        lines, last, end, tail = split_appended_jsonl(
            raw, lambda e: self.fmt.error(f"{self.shown} is not UTF-8 ({e}); {self.fmt.elsewhere}")
        )
        where = f"{self.path} line"
        keys = {self.fmt.key_of(line, f"{where} {n}") for n, line in lines if n > 1}
        if last is not None:  # a whole record that only lacks its newline
            keys.add(self.fmt.key_of(last, f"{where} {raw.count(NEWLINE, 0, end) + 1}"))
            return keys, lambda: self._write(NEWLINE)
        if tail.strip():
            return keys, lambda: self._cut(end, tail)
        return keys, (lambda: os.ftruncate(self.fd, end)) if tail else (lambda: None)

    def _cut(self, end: int, tail: bytes) -> None:
        os.ftruncate(self.fd, end)
        warnings.warn(f"{self.path}: removed a cut-off last line ({len(tail)} bytes) left by an interruption")

    def _write(self, data: bytes) -> None:
        """Append `data` (whole lines) in one write, synced to disk; a full disk is a WriteError naming the file."""
        try:
            written = os.write(self.fd, data)
            while written < len(data):  # (a regular file takes it whole; a short write is finished, never repeated)
                written += os.write(self.fd, data[written:])
            os.fsync(self.fd)
        except OSError as e:
            if is_disk_full(e):
                raise disk_full_error(self.path, len(data), "the whole records written before are kept") from e
            raise

    def append(self, lines: str) -> None:
        """Append one or more whole record lines (each ending with a newline) together, synced to disk."""
        if self.settings is None:
            raise RecordFileError(f"{self.shown} was opened to be read (settings=None); it takes no records")
        self._write(lines.encode("utf-8"))
        self.appended += lines.count("\n")

    def close(self, failed: bool = False) -> None:
        """Unlock and close the file. After a run that `failed`, a file this store made, or found empty, and added no
        record to is left as found (a finished run keeps its file, if only its header: the file of an empty run)."""
        if self.fd is None:
            return
        try:
            if failed and self.appended == 0 and self.found_empty and self.settings is not None:
                if self.created and _still_named(self.path, self.fd):
                    self.path.unlink()
                else:
                    os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RecordStore:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(failed=kind is not None)


def settings_diff(there, here: dict) -> str:
    """Each setting that differs, with the file's value and this run's ("max_new_tokens 16 there, 64 here")."""
    there = there if isinstance(there, dict) else {}
    absent = object()
    parts = []
    for name in sorted(set(there) | set(here)):
        a, b = there.get(name, absent), here.get(name, absent)
        if a != b:
            shown = ["absent" if v is absent else json.dumps(v, ensure_ascii=False) for v in (a, b)]
            parts.append(f"{name} {shown[0]} there, {shown[1]} here")
    return "; ".join(parts) or "its header's settings are not an object"

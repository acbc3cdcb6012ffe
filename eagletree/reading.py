"""Reading back the files eagletree writes, as a damaged disk, another program or an interrupted writer may leave
them: .npz archives with a JSON header, and append-only JSONL files."""

from __future__ import annotations

import json
from pathlib import Path


def read_npz(
    path,
    names=(),
    *,
    what: str,
    remedy: str,
    kind: str | None = None,
    version=None,
    error: type[Exception] = ValueError,
) -> tuple[dict, dict]:
    """(header, arrays) of an .npz archive eagletree wrote: its JSON `header` member and the arrays `names`.

    Whatever is wrong with the file (missing, not an archive, a single .npy array, damaged, no header, or with
    `kind`/`version` another format's header, which is checked before any array is read) is an `error` that names
    the file and `what` it should be (e.g. "datastore"); `remedy` says how to make a good one.
    """
    damaged = _damaged()
    z = _open_npz(path, what, remedy, error)
    with z:
        header = _npz_header(z, path, what, remedy, error)
        if kind is not None and (header.get("format"), header.get("version")) != (kind, version):
            raise error(
                f"{path}: format {header.get('format')!r} version {header.get('version')!r}, expected "
                f"{kind!r} version {version}; {remedy}"
            )
        try:
            arrays = {name: z[name] for name in names}
        except damaged as e:
            raise error(f"{path}: unreadable {what} arrays ({e}); {remedy}") from (
                e if isinstance(e, OSError) else None
            )
    return header, arrays


def _damaged() -> tuple[type[BaseException], ...]:
    """What reading a damaged archive raises.

    An OSError is chained as the error's __cause__: the file may be fine and the error pass (e.g. too many open
    files), so a caller that remembers bad files can tell. RuntimeError and NotImplementedError: an encrypted member
    or an unknown compression."""
    import zipfile
    import zlib

    return (
        KeyError,
        ValueError,
        OSError,
        EOFError,
        zipfile.BadZipFile,
        zlib.error,
        RuntimeError,
        NotImplementedError,
    )


def _open_npz(path, what: str, remedy: str, error: type[Exception]):
    """The open .npz archive at `path`; `error` for a missing or damaged file, or a single array."""
    import numpy as np

    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise error(f"{what} {str(path)!r} does not exist") from None
    except OSError as e:
        raise error(f"{path}: cannot read the {what} file ({e})") from e
    except _damaged() as e:
        raise error(f"{path}: not a {what} file ({e}); {remedy}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise error(f"{path}: not a {what} file (a single array, not an .npz archive); {remedy}")
    return z


def _npz_header(z, path, what: str, remedy: str, error: type[Exception]) -> dict:
    """The archive's JSON `header` member, which must be a JSON object."""
    try:
        header = json.loads(str(z["header"][()]))
    except _damaged() as e:
        raise error(f"{path}: not a {what} file (no readable header: {e}); {remedy}") from (
            e if isinstance(e, OSError) else None
        )
    if not isinstance(header, dict):
        raise error(f"{path}: not a {what} file (its header is {json.dumps(header)[:40]}, not a JSON object); {remedy}")
    return header


def read_appended_jsonl(path: Path, not_utf8) -> tuple[list[tuple[int, str]], str | None, int, bytes]:
    """The lines of an append-only JSONL file as an interrupted writer may leave it: `split_appended_jsonl` of its
    bytes."""
    return split_appended_jsonl(path.read_bytes(), not_utf8)


def split_appended_jsonl(raw: bytes, not_utf8) -> tuple[list[tuple[int, str]], str | None, int, bytes]:
    """The lines of an append-only JSONL file's bytes `raw`: ((line number, text) of each non-blank whole line; the
    text after the last newline when it is a complete JSON object, else None; the byte offset where the whole lines
    end; the bytes that follow). Anything else after the last newline is what a kill in the middle of a write leaves,
    possibly a cut UTF-8 character. Lines end at newlines only (U+2028 and the like are text inside a JSON string).
    `not_utf8(error)` is the exception to raise when the whole lines are not UTF-8."""
    end = raw.rfind(b"\n") + 1
    try:
        lines = raw[:end].decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise not_utf8(e) from e
    tail = raw[end:]
    try:
        last = tail.decode("utf-8")
        last = last if isinstance(json.loads(last), dict) else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        last = None
    return [(n, line) for n, line in enumerate(lines, start=1) if line.strip()], last, end, tail

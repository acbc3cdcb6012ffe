"""Folders and files written so that nothing is lost: built under a temporary name, published by rename.

A folder is built in `.NAME.partial-HOST-PID-RANDOM` next to its final name (HOST: a tag of this machine,
PID: the writing process), so a later run can tell a partial folder whose writer was killed (same machine,
no such process) from one another live process is still writing, and removes only the former. Everything
written follows the umask, as files made with open() do (temporary folders and safetensors files would
otherwise be private to their owner).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
from pathlib import Path

from .errors import EagletreeError

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_PARTIAL = re.compile(r"^\..+\.partial-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]+$")


class WriteError(EagletreeError, OSError):
    """An output folder that may not be written (the source, a file, a non-empty folder without overwrite)."""


def umask() -> int:
    """This process's umask (read without changing it where /proc tells it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """chmod `path` (and, for a folder, everything under it) as open()/mkdir() would have created it."""
    mask = umask()
    path = Path(path)
    paths = [path] + (sorted(path.rglob("*")) if path.is_dir() else [])
    for p in paths:
        if p.is_symlink():
            continue
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_partials(parent: Path) -> list[Path]:
    """Partial folders in `parent` whose writer, a process of this machine, no longer runs."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = []
    for p in parent.iterdir():
        m = _PARTIAL.match(p.name)
        if m and m["host"] == _HOST and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            found.append(p)
    return sorted(found)


def remove_stale_partials(parent: Path) -> list[Path]:
    """Remove what killed writers left in `parent` (never what a live process is writing); returns them."""
    removed = stale_partials(parent)
    for p in removed:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
    return removed


def is_partial(path: Path) -> bool:
    """Whether `path` is a writer's temporary file or folder (see partial_path)."""
    return bool(_PARTIAL.match(Path(path).name))


def partial_path(final: Path) -> Path:
    """A fresh name next to `final` for building it: .NAME.partial-HOST-PID-RANDOM."""
    final = Path(os.path.abspath(final))  # "." and "..": the folder's own name
    return final.with_name(f".{final.name}.partial-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def building(final: Path):
    """Yield a new empty folder next to `final` (stale partial folders there are removed first); it is removed
    if the block fails or is interrupted, else left for the caller to publish (see publish). A full disk is a
    WriteError naming `final` and the space (`disk_full_error`)."""
    final = Path(os.path.realpath(final))  # (a symlinked output is written where it points)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(final.parent)
        tmp = partial_path(final)
        tmp.mkdir()
    except OSError as e:
        _raise_write_error(final, 0, e)
        raise
    try:
        yield tmp
    except BaseException as e:
        written = _size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_write_error(final, written, e)
        raise


def _raise_write_error(path: Path, written: int, error: BaseException) -> None:
    """Raise the one-line WriteError of a failed write to `path` (`written` bytes in) when `error` is a full disk
    or a refused write into the cache folder; return for any other error (the caller re-raises it)."""
    refused = disk_full_error(path, written) if is_disk_full(error) else cache_write_error(path, error)
    if refused is not None:
        raise refused from error


def cache_dir() -> Path:
    """Root of eagletree's on-disk cache: $EAGLETREE_CACHE, else $XDG_CACHE_HOME/eagletree."""
    if os.environ.get("EAGLETREE_CACHE"):
        return Path(os.environ["EAGLETREE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "eagletree"


def cache_write_error(path: Path, error: BaseException) -> WriteError | None:
    """For a write into eagletree's cache folder that the filesystem refused (read-only, no permission), the error
    that names the folder and the variable that sets it; None for other errors or paths."""
    if not (isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES, errno.EPERM)):
        return None
    cache = Path(os.path.abspath(cache_dir()))
    if cache != Path(os.path.abspath(path)) and cache not in Path(os.path.abspath(path)).parents:
        return None
    return WriteError(
        f"cannot write {str(path)!r} in eagletree's cache folder {str(cache)!r} ({error.strerror or error}): set "
        "EAGLETREE_CACHE to a folder you can write (the cache holds the de-quantized model, measured kernels and "
        "latency profiles)"
    )


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` says the disk (or the user's quota) is full: an OSError ENOSPC/EDQUOT, or a library's own
    error wrapping one (safetensors says "No space left on device")."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(text in str(error) for text in ("No space left on device", "Disk quota exceeded", "os error 28"))


def disk_full_error(path: Path, written: int, kept: str = "what was there before is unchanged") -> WriteError:
    """The one-line error of a write to `path` that filled the disk after `written` bytes."""
    parent = Path(os.path.abspath(path))
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    return WriteError(
        f"the disk holding {str(path)!r} is full ({_mib(free)} free) after {_mib(written)} of this write: free "
        f"more than {_mib(written)} there (or write elsewhere) and run again; {kept}"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _size(path: Path) -> int:
    """Bytes in a file, or in the files under a folder (0 for what cannot be read)."""
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0


@contextlib.contextmanager
def appending(path: Path, encoding: str = "utf-8"):
    """open(path, "a") for append-only files (distill's answers, a run's history): a full disk is a WriteError
    naming the file (the whole records before it stay; a cut last line is dropped by the next reader)."""
    path = Path(path)
    start = path.stat().st_size if path.exists() else 0
    try:
        with open(path, "a", encoding=encoding) as f:
            yield f
    except OSError as e:
        if is_disk_full(e):
            grown = (path.stat().st_size if path.exists() else 0) - start
            raise disk_full_error(path, grown, "the whole records written before are kept") from e
        raise


def check_output_dir(out: Path, overwrite: bool, sources=(), option: str = "--out") -> None:
    """Raise WriteError unless `out` may receive a new folder: absent, empty, or (with `overwrite`) a folder;
    never a file or one of `sources` (or a folder inside one, or one holding one)."""
    out = Path(out)
    for source in sources:
        src = Path(source).resolve()
        res = out.resolve()
        if res == src or src in res.parents or res in src.parents:
            raise WriteError(
                f"{option} {str(out)!r} is the source {str(source)!r} (or contains or lies in it); "
                "write the output to another folder"
            )
    if out.exists() and not out.is_dir():
        raise WriteError(f"{option} {str(out)!r} is a file; expected a folder (absent, empty, or with --overwrite)")
    _check_not_under_a_file(out, option)
    here, res = Path.cwd().resolve(), out.resolve()
    if res == here or res in here.parents:  # the folder is replaced as a whole: the shell would sit in the old one
        raise WriteError(
            f"{option} {str(out)!r} is the current folder or holds it; the output folder is replaced as "
            "a whole, so name another folder (or change to another folder first)"
        )
    if out.is_dir() and not overwrite:
        entries = sorted(p.name for p in out.iterdir())
        if entries:
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise WriteError(
                f"{option} {str(out)!r} is not empty (it holds {shown}); pass --overwrite to replace "
                "the files this command writes there (the others are kept)"
            )


def check_output_file(out, option: str = "--out") -> None:
    """Raise WriteError unless `out` can be written as a file: not a folder, and its parent not a file. Commands
    call it before their work, so a wrong path costs nothing."""
    out = Path(out)
    if out.is_dir():
        raise WriteError(f"{option} {str(out)!r} is a folder; expected a file path")
    _check_not_under_a_file(out, option)


def check_output_folder(out, option: str = "--out") -> None:
    """Raise WriteError unless `out` can be a folder that receives files: not a file, nor under one."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise WriteError(f"{option} {str(out)!r} is a file; expected a folder")
    _check_not_under_a_file(out, option)


def _check_not_under_a_file(out: Path, option: str) -> None:
    """WriteError when the nearest existing folder above `out` is a file (nothing can be made under it)."""
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise WriteError(f"{option} {str(out)!r}: {str(parent)!r} is a file, so nothing can be written under it")


def publish(tmp: Path, final: Path, keep_others: bool = True, replace: bool = True, drop=()) -> Path:
    """Move the finished folder `tmp` to `final` at once, following the umask.

    An existing `final` is replaced as a whole; with `keep_others` its entries that `tmp` does not hold are
    carried over (hard links, so no copy), i.e. only the files written in `tmp` are replaced, except those named
    in `drop` (gone with the old folder). `final` is
    never missing or half-written: `tmp`'s files are flushed to disk first, then the two folders are swapped
    atomically where the kernel can (Linux renameat2), else by two renames in a row. replace=False (a command
    without --overwrite): `final` must still be absent or empty, checked by the rename itself, so of two runs
    publishing to one new folder exactly one wins and the other gets a WriteError.
    """
    tmp, final = Path(tmp), Path(os.path.realpath(final))  # (a symlinked output is written where it points)
    try:
        follow_umask(tmp)
        if final.is_dir():  # a replaced folder keeps its own mode (a 0750 folder stays 0750)
            tmp.chmod(stat.S_IMODE(final.stat().st_mode))
        sync_tree(tmp)
        if not replace:
            return _publish_new(tmp, final)
        if not final.exists():
            os.replace(tmp, final)
            return final
        if not final.is_dir():
            raise WriteError(f"{str(final)!r} is a file; expected a folder")
        if keep_others:
            for entry in final.iterdir():
                if not (tmp / entry.name).exists() and not is_partial(entry) and entry.name not in drop:
                    _link_copy(entry, tmp / entry.name)
        if not any(final.iterdir()):
            os.replace(tmp, final)  # rename onto an empty folder
            return final
        if _exchange(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # now the old folder
            return final
        old = final.with_name(f".{final.name}.old-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        return final
    except BaseException as e:
        written = _size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_write_error(final, written, e)
        raise


def _publish_new(tmp: Path, final: Path) -> Path:
    """Rename `tmp` to `final` only if `final` is absent or an empty folder (a rename refuses a folder with
    entries, so no other run's files are ever replaced)."""
    try:
        os.replace(tmp, final)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise WriteError(
            f"{str(final)!r} was filled by another run while this one worked (it was empty or absent when this "
            "run started); nothing of it was replaced: pass --overwrite to replace it, or write elsewhere"
        ) from None
    return final


def sync_tree(folder: Path) -> None:
    """Flush every file under `folder`, and the folders themselves, to disk: before a rename publishes it, so
    that a power loss cannot leave a published folder with files the disk never received."""
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _link_copy(src: Path, dst: Path) -> None:
    """dst as a copy of src made of hard links (a plain copy across file systems or for links)."""
    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(src, dst)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where that is not available."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0


@contextlib.contextmanager
def writing(path: Path, replace: bool = True):
    """Yield a temporary file name next to `path` to write (with open(), save_file, ...); when the block ends
    without error the file is flushed to disk and renamed over `path`, else removed. Parent folders are made;
    the file follows the umask, as open() makes it. replace=False (a command without --overwrite): `path` must
    still be absent when the file is published (a hard link, which refuses an existing name, so of two runs
    writing one new file exactly one wins and the other gets a WriteError)."""
    path = Path(path)
    tmp = partial_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        follow_umask(tmp)  # safetensors' save_file makes its files 0600
        if replace:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    except BaseException as e:
        written = _size(tmp)
        tmp.unlink(missing_ok=True)
        _raise_write_error(path, written, e)
        raise


def _link_new(tmp: Path, path: Path) -> None:
    """Publish `tmp` as `path` only if no `path` exists (then drop `tmp`)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise WriteError(
            f"{str(path)!r} was written by another run while this one worked (it was absent when this run started);"
            " it was not replaced: pass --overwrite to replace it, or write elsewhere"
        ) from None
    except OSError as e:  # a filesystem without hard links: check, then rename (not atomic there)
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        if path.exists():
            raise WriteError(f"{str(path)!r} was written by another run while this one worked; not replaced") from None
        os.replace(tmp, path)
    tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text file under a temporary name and rename it over `path` (following the umask)."""
    with writing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: Path, data, indent: int = 2) -> None:
    """`data` as JSON, written under a temporary name and renamed over `path` (following the umask)."""
    write_text_atomic(path, json.dumps(data, indent=indent))

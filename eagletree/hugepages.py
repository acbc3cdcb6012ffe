"""Huge pages for the command line's memory: the `eagletree` command starts itself again with glibc's
`glibc.malloc.hugetlb=1` tunable where that helps.

On a VM each first touch of a 4 KiB page costs the host a fault. A decoding pass allocates its activations
afresh, and a pass of a shape not seen before (a batch's trees change size every step) touches memory
the process has not used yet. glibc's tunable asks for transparent huge pages (2 MiB) for what malloc
maps, so those passes fault 512 times less often. It is read when a process starts, so the command line
sets it and starts again before anything is loaded; the library itself changes nothing in the process
that imports it.

It applies on Linux with glibc 2.35 or later (the tunable's first release) and transparent huge pages
enabled ("always" or "madvise"), unless GLIBC_TUNABLES already sets it or EAGLETREE_HUGEPAGES=0.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OFF_VARIABLE = "EAGLETREE_HUGEPAGES"
TUNABLE = "glibc.malloc.hugetlb"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library this process runs on when it is glibc, else None."""
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):  # (no confstr, or no such name, on this platform)
        return None
    parts = name.split()
    if len(parts) != 2 or parts[0] != "glibc":
        return None
    numbers = parts[1].split(".")
    try:
        return int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else 0
    except ValueError:
        return None


def thp_mode(setting: Path = THP_SETTING) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where it is not readable."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def relaunch_environment(environ, platform: str, glibc: tuple[int, int] | None, thp: str | None) -> dict | None:
    """The environment to start the command again with, or None where it should run as it is."""
    if environ.get(OFF_VARIABLE, "1") == "0" or platform != "linux":
        return None
    if glibc is None or glibc < (2, 35) or thp not in ("always", "madvise"):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables:  # (set already: by the user, or by this relaunch)
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"
    return env


def relaunch_with_huge_pages() -> None:
    """Run this process's command line again in its place with the tunable set, where it applies
    (`relaunch_environment`); return without doing anything otherwise, or where the relaunch fails to start."""
    if sys.platform != "linux":
        return
    env = relaunch_environment(os.environ, sys.platform, glibc_version(), thp_mode())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # the same interpreter, flags, script and arguments (its path search as the first start had it)
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:  # (an interpreter that cannot be started again: an embedded or frozen one)
        return

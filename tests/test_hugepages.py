"""The `eagletree` command's huge pages (eagletree/hugepages.py): it starts itself again with glibc's
`glibc.malloc.hugetlb=1` where that applies, once, and never where it does not."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagletree import hugepages
from eagletree.hugepages import relaunch_environment

GLIBC = (2, 36)


def test_the_tunable_is_set_once_where_glibc_and_the_kernel_take_it():
    env = relaunch_environment({"PATH": "/bin"}, "linux", GLIBC, "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert relaunch_environment(env, "linux", GLIBC, "madvise") is None  # (the relaunched process goes on)
    mixed = relaunch_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "linux", GLIBC, "always")
    assert mixed["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"  # the user's kept
    assert relaunch_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "linux", GLIBC, "always") is None


@pytest.mark.parametrize(
    "environ, platform, glibc, thp",
    [
        ({"EAGLETREE_HUGEPAGES": "0"}, "linux", GLIBC, "madvise"),  # turned off
        ({}, "darwin", None, None),
        ({}, "linux", None, "madvise"),  # another C library (musl)
        ({}, "linux", (2, 34), "madvise"),  # before the tunable existed
        ({}, "linux", GLIBC, "never"),
        ({}, "linux", GLIBC, None),  # no THP setting to read
    ],
)
def test_nothing_changes_where_the_tunable_does_not_apply(environ, platform, glibc, thp):
    assert relaunch_environment(environ, platform, glibc, thp) is None


def test_the_kernels_mode_and_the_c_librarys_version_are_read(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(setting) == "madvise"
    assert hugepages.thp_mode(tmp_path / "absent") is None
    version = hugepages.glibc_version()
    assert version is None or (len(version) == 2 and version >= (2, 0))


def test_the_relaunch_runs_the_same_command_line_again(monkeypatch):
    calls, real_glibc_version = [], hugepages.glibc_version
    monkeypatch.setattr(hugepages, "glibc_version", lambda: GLIBC)
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(hugepages.sys, "platform", "linux")
    monkeypatch.setattr(hugepages.sys, "orig_argv", ["/venv/bin/python", "-X", "utf8", "/venv/bin/eagletree", "a b"])
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("EAGLETREE_HUGEPAGES", raising=False)
    monkeypatch.setattr(hugepages.os, "execve", lambda path, args, env: calls.append((path, args, env)))
    hugepages.relaunch_with_huge_pages()
    [(path, args, env)] = calls
    assert path == sys.executable and args == ["/venv/bin/python", "-X", "utf8", "/venv/bin/eagletree", "a b"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.setenv("EAGLETREE_HUGEPAGES", "0")
    hugepages.relaunch_with_huge_pages()
    assert len(calls) == 1

    def cannot(path, args, env):
        raise OSError("exec format error")

    monkeypatch.delenv("EAGLETREE_HUGEPAGES")
    monkeypatch.setattr(hugepages.os, "execve", cannot)
    hugepages.relaunch_with_huge_pages()  # (runs on in place)
    monkeypatch.setattr(hugepages.sys, "platform", "win32")
    monkeypatch.delattr(hugepages.os, "confstr")
    assert real_glibc_version() is None
    hugepages.relaunch_with_huge_pages()


@pytest.mark.skipif(
    hugepages.relaunch_environment(os.environ, sys.platform, hugepages.glibc_version(), hugepages.thp_mode()) is None,
    reason="huge pages do not apply on this machine (or are set or turned off already)",
)
def test_the_command_starts_again_with_the_tunable_and_runs_in_place_when_off(tmp_path):
    """The real relaunch on this machine: the same command line runs again, now with the tunable in its
    environment and its arguments as given (the command's exit status is the process's); turned off, it runs in
    place."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import os, sys\n"
        "from eagletree import cli\n"
        "cli.main = lambda argv=None: print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:]) or 3\n"
        "cli.run()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    done = subprocess.run([sys.executable, str(script), "generate", "--x"], capture_output=True, text=True, env=env)
    assert done.returncode == 3 and done.stdout.strip() == "glibc.malloc.hugetlb=1 ['generate', '--x']"
    off = subprocess.run(
        [sys.executable, str(script), "generate", "--x"],
        capture_output=True,
        text=True,
        env=dict(env, EAGLETREE_HUGEPAGES="0"),
    )
    assert off.returncode == 3 and off.stdout.strip() == "None ['generate', '--x']"

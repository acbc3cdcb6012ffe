"""The code is formatted and linted as pyproject.toml's [tool.ruff] says (CI runs this with the suite)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_passes(command):
    assert RUFF is not None, (
        "ruff is missing: it comes with the test extras (pip install -e '.[test]', scripts/setup.sh)"
    )
    run = subprocess.run([RUFF, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"ruff {' '.join(command)} found:\n{run.stdout}{run.stderr}"


def test_no_function_is_longer_than_80_lines():
    import ast

    too_long = []
    for path in sorted(
        [
            *ROOT.glob("eagletree/**/*.py"),
            *ROOT.glob("benchmarks/*.py"),
            *ROOT.glob("scripts/**/*.py"),
            ROOT / "train.py",
        ]
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                too_long.append(
                    f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
                )
    assert not too_long, "split these (a function does one thing):\n" + "\n".join(too_long)


ARGPARSE = {"add_argument", "add_parser", "add_argument_group", "add_mutually_exclusive_group", "set_defaults"}


def _is_argparse_table(node) -> bool:
    """A function that only builds argparse parsers: one parser call per 8 lines at least."""
    calls = [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ARGPARSE
    ]
    return len(calls) * 8 >= node.end_lineno - node.lineno + 1


def _parameters(node) -> int:
    a = node.args
    count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    first = (a.posonlyargs + a.args)[:1]
    return count - (1 if first and first[0].arg in ("self", "cls") else 0)


def test_the_package_keeps_its_size_limits():
    """In eagletree/: no module over 500 lines, no function over 60 lines (argparse tables aside) or with more than
    10 parameters (an options object instead)."""
    over = []
    for path in sorted(ROOT.glob("eagletree/**/*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.count("\n") > 500:
            over.append(f"{name}: {text.count(chr(10))} lines (module > 500)")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > 60 and not _is_argparse_table(node):
                over.append(f"{name}:{node.lineno} {node.name}: {lines} lines (> 60)")
            if _parameters(node) > 10:
                over.append(f"{name}:{node.lineno} {node.name}: {_parameters(node)} parameters (> 10)")
    assert not over, "split these:\n" + "\n".join(over)

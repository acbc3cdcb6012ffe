"""The code is formatted and linted as pyproject.toml's [tool.ruff] says (CI runs this with the suite)."""

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

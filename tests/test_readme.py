import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    commands = [c for c in re.findall(r"```bash\n(.*?)\n```", readme, re.S) if "setup.sh" in c]
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, f"CI does not run the README's test command {commands[1]!r}"
    assert "eagletree generate" in commands[0]


@pytest.mark.real
def test_readme_python_example_runs_and_prints_what_it_says(capsys):
    readme = (ROOT / "README.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)\n```", readme, re.S) if "verify_step" in c)
    exec(compile(code, "README.md", "exec"), {})
    claimed = re.search(r"print\(step.*?# (.*?) \(", code).group(1)
    assert capsys.readouterr().out.strip() == claimed

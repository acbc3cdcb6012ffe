import argparse
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a fenced code block: fences at the start of a line (indented in a list), so ``` inside a command is text
FENCED = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    commands = [c for c in re.findall(r"```bash\n(.*?)\n```", readme, re.S) if "setup.sh" in c]
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, f"CI does not run the README's test command {commands[1]!r}"
    assert "eagletree generate" in commands[0]


def test_readme_is_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move details to docs/ (usage, design, results)"


def test_readme_quotes_no_commit_hashes():
    """Measurements and their history live in docs/results.md, dated, with the machine named; the README
    keeps one results table and no per-commit runs."""
    readme = (ROOT / "README.md").read_text()
    hashes = re.findall(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", readme)
    assert not hashes, f"README.md quotes commit hashes {hashes}; measurements go to docs/results.md"


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces as '-')."""
    anchors, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} (.*)", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    text = re.sub(r"`[^`]*`", "", re.sub(FENCED, "", doc.read_text()))
    for link in re.findall(r"\]\(([^)\s]*[./#][^)\s]*)\)", text):  # a path or an anchor, not E[x](N)
        if re.match(r"[a-z]+:", link):  # a URL
            continue
        file, _, anchor = link.partition("#")
        target = (doc.parent / file) if file else doc
        assert target.exists(), f"{doc.name} links to {link!r}: {target} does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in heading_anchors(target), f"{doc.name} links to {link!r}: no such heading in {target.name}"


def cli_options() -> dict[str, set[str]]:
    """Each `eagletree` subcommand's option strings, from the CLI's own parser."""
    from eagletree.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def command_lines(text: str):
    """Shell commands written in Markdown: lines of bash code blocks, lines of plain code blocks that start
    with a command (indented lines continue the line above, as in a wrapped synopsis), inline code spans."""
    for lang, block in FENCED.findall(text):
        lines = re.sub(r"\\?\n[ \t]+", " ", textwrap.dedent(block)).splitlines()
        if lang == "bash":
            yield from lines
        elif lang == "":
            yield from (line for line in lines if re.match(r"(\$ |\.venv/bin/|python |eagletree )", line))
    yield from re.findall(r"`([^`]+)`", re.sub(FENCED, "", text))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_eagletree_commands_and_flags_exist(doc):
    options = cli_options()
    for line in command_lines(doc.read_text()):
        line = re.sub(r"\s#.*", "", line)  # a shell comment
        for m in re.finditer(r"(?<!from )(?:^|(?<=[\s/]))eagletree ([a-z][\w-]*)(.*?)(?=$|\beagletree )", line):
            command, rest = m.group(1), m.group(2)
            assert command in options, f"{doc.name}: `eagletree {command}` is not a command ({sorted(options)})"
            for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest):
                assert flag in options[command], f"{doc.name}: `eagletree {command}` has no {flag}: {line!r}"


@pytest.mark.real
def test_design_python_example_runs_and_prints_what_it_says(capsys):
    design = (ROOT / "docs" / "design.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)\n```", design, re.S) if "verify_step" in c)
    exec(compile(code, "docs/design.md", "exec"), {})
    claimed = re.search(r"print\(step.*?# (.*?) \(", code).group(1)
    assert capsys.readouterr().out.strip() == claimed

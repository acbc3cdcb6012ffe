import json

import pytest

from eagletree import bench
from eagletree.prompts import MTBENCH_CATEGORIES, humaneval_prompts, mtbench_questions, mtbench_subset


def test_mtbench_ships_80_questions_in_8_categories_of_10():
    questions = mtbench_questions()
    assert [q.question_id for q in questions] == list(range(81, 161))
    counts = {c: sum(q.category == c for q in questions) for c in MTBENCH_CATEGORIES}
    assert counts == dict.fromkeys(MTBENCH_CATEGORIES, 10)
    assert all(len(q.turns) == 2 and all(t.strip() for t in q.turns) for q in questions)


def test_mtbench_subset_spreads_over_categories_and_bench_reads_it():
    half = mtbench_subset(40)
    assert [q.question_id for q in half] == list(range(81, 161, 2))  # every second question: 5 per category
    assert {c: sum(q.category == c for q in half) for c in MTBENCH_CATEGORIES} == dict.fromkeys(MTBENCH_CATEGORIES, 5)
    assert len(mtbench_subset(None)) == len(mtbench_subset(500)) == 80
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        mtbench_subset(0)
    assert bench.load_prompts("mtbench:40") == [q.messages() for q in half]
    assert bench.load_prompts("mtbench")[0] == [{"role": "user", "content": mtbench_questions()[0].turns[0]}]


def test_a_malformed_question_file_names_the_line(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["a", "b"]}) + '\n{"turns": []}\n')
    with pytest.raises(ValueError, match="line 2: expected an MT-bench question"):
        mtbench_questions(path)


def test_humaneval_prompts_ask_to_complete_each_function():
    prompts = humaneval_prompts()
    assert len(prompts) == 164
    first = prompts[0][0]["content"]
    assert first.startswith("Complete the following Python function.") and "def has_close_elements(" in first
    assert humaneval_prompts(2, offset=1) == prompts[1:3] == bench.load_prompts("humaneval:3")[1:]
    assert bench.load_prompts("humaneval:2-3") == prompts[1:3]
    assert bench.load_prompts("humaneval:164-164") == prompts[163:]
    assert bench.load_prompts("humaneval:200") == prompts  # as mtbench:200 gives all 80 questions
    for spec in ("humaneval:x", "humaneval:0", "humaneval:3-2", "humaneval:0-2", "humaneval:1-", "humaneval:-4"):
        with pytest.raises(ValueError, match=f"'{spec}': expected humaneval, humaneval:N .N >= 1. or humaneval:A-B"):
            bench.load_prompts(spec)
    with pytest.raises(ValueError, match="HumanEval has 164 problems; problems 160 to 170 asked for"):
        bench.load_prompts("humaneval:160-170")


def test_tokens_per_pass_by_category_is_total_tokens_over_total_passes():
    from eagletree.prompts import by_category

    table = by_category(["math", "coding", "math"], [30, 40, 10], [10, 10, 10])
    assert table == {"math": 40 / 20, "coding": 4.0, "mean": 80 / 30}
    with pytest.raises(ValueError, match="one category, token count and pass count per prompt, got 2, 1 and 1"):
        by_category(["math", "coding"], [3], [1])

import json
import subprocess
import sys
import warnings

import pytest

from eagletree.train.data import (
    DataError,
    DataWarning,
    base_id,
    from_hf_dataset,
    is_heldout,
    load_dataset,
    read_json_file,
    split,
    stats,
)

RECORDS = [
    {
        "id": f"c{i}_{i % 2}",
        "flag": i % 2 == 0,
        "none": None,
        "conversations": [
            {"from": "human", "value": f'question {i} with ünïcode ✓ and "quotes" ]}}'},
            {"from": "gpt", "value": f"answer {i}"},
        ],
    }
    for i in range(12)
]


def write_json(path, records):
    path.write_text(json.dumps(records, indent=2, ensure_ascii=False), encoding="utf-8")
    return path


def test_complete_array_is_not_truncated(tmp_path):
    data = read_json_file(write_json(tmp_path / "d.json", RECORDS))
    assert not data.truncated and len(data.conversations) == 12
    assert data.conversations[0].messages == [
        {"role": "user", "content": RECORDS[0]["conversations"][0]["value"]},
        {"role": "assistant", "content": "answer 0"},
    ]


@pytest.mark.parametrize("ascii_only", [False, True])
def test_every_cut_recovers_every_complete_record(tmp_path, ascii_only):
    """Cut the file at every byte: all records that end before the cut come back, nothing else."""
    raw = json.dumps(RECORDS[:4], indent=1, ensure_ascii=ascii_only).encode("utf-8")
    ends = []  # byte offset just after each record's closing brace
    for r in RECORDS[:4]:
        piece = json.dumps(r, indent=1, ensure_ascii=ascii_only).replace("\n", "\n ").encode("utf-8")
        start = raw.index(piece, ends[-1] if ends else 0)
        ends.append(start + len(piece))
    path = tmp_path / "cut.json"
    for cut in range(2, len(raw) - 1):
        path.write_bytes(raw[:cut])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = read_json_file(path)
        expected = sum(1 for e in ends if e <= cut)
        assert data.truncated
        assert len(data.conversations) == expected, f"cut at byte {cut}"
        notes = [str(w.message) for w in caught if issubclass(w.category, DataWarning)]
        assert len(notes) == 1 and f"byte {cut:,}" in notes[0] and f"recovered {expected:,}" in notes[0]


def test_damage_inside_the_file_is_an_error(tmp_path):
    text = json.dumps(RECORDS, indent=1)
    broken = text.replace('"answer 3"', '"answer 3" oops', 1)
    path = tmp_path / "broken.json"
    path.write_text(broken)
    with pytest.raises(DataError, match=r"broken.json: record 3 is not valid JSON"):
        read_json_file(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ('[{"id": 1, "conversations": []}{"id": 2, "conversations": []}]', "expected ',' or ']' after record 0"),
        ('[{"id": 1, "conversations": []}}', "expected ',' or ']' after record 0"),
        ('[{"id": 1, "conversations": [}]', "record 0 is not valid JSON"),
        ("[3, 4]", "record 0 should start with '{'"),
    ],
)
def test_damaged_arrays_are_errors_not_truncations(tmp_path, text, message):
    path = tmp_path / "d.json"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        read_json_file(path)


@pytest.mark.parametrize("name", ["d.json", "d.jsonl"])
def test_a_pretty_printed_object_is_named_as_one_not_as_bad_json(tmp_path, name):
    path = tmp_path / name
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}, indent=1) + "\n")
    with pytest.raises(
        DataError, match=f"{name} is one JSON object spread over 8 lines, not records: expected a JSON array of records"
    ):  # (was "line 1 is not valid JSON")
        read_json_file(path)


def test_bom_line_separators_and_bad_utf8(tmp_path):
    record = {"id": "a", "messages": [{"role": "user", "content": "x\u2028y\u0085z"}]}
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(record, ensure_ascii=False).encode() + b"\n")
    assert read_json_file(path).conversations[0].messages[0]["content"] == "x\u2028y\u0085z"
    path = tmp_path / "d.json"
    path.write_bytes(b'[{"id": "a", "conversations": [{"from": "human", "value": "\xff"}]}]')
    with pytest.raises(DataError, match="invalid UTF-8 at byte 59"):
        read_json_file(path)


def test_jsonl_and_openai_messages(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        json.dumps(
            {
                "id": "a",
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                ],
            }
        ),
        json.dumps(RECORDS[1]),
    ]
    path.write_text("\n".join(lines) + "\n")
    data = read_json_file(path)
    assert [c.id for c in data.conversations] == ["a", "c1_1"]
    assert [m["role"] for m in data.conversations[0].messages] == ["system", "user", "assistant"]
    path.write_text("\n".join(lines) + "\n" + lines[0][:20])
    with pytest.warns(DataWarning, match="last line is cut off"):
        assert len(read_json_file(path).conversations) == 2


def test_hf_dataset():
    import datasets

    ds = datasets.Dataset.from_list(
        [{"id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    )
    data = load_dataset(ds)
    assert data.conversations[0].messages[1] == {"role": "assistant", "content": "a"}
    with pytest.raises(DataError, match=r"needs a 'conversations' or 'messages' column, has \['text'\]"):
        from_hf_dataset(datasets.Dataset.from_list([{"text": "t"}]))


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("", "is empty"),
        ("   \n", "is empty"),
        ('[{"id": "a", "text": "hi"}]', r"record 0: record has no 'conversations'"),
        (
            '[{"id": "a", "conversations": [{"from": "robot", "value": "x"}]}]',
            r"record 0, turn 0: unknown role 'robot'",
        ),
        ('[{"id": "a", "conversations": "hi"}]', "the turns must be a list"),
        ('[{"id": "a", "conversations": [{"from": "human"}]}]', "expected an object with 'from' and 'value'"),
        ('{"a": 1}', r"line 1: record has no 'conversations'"),
        (
            '[{"id": "a", "messages": [{"role": "assistant", "content": "a", "weight": 0.5}]}]',
            r"turn 0: 'weight' must be 0 \(not trained on\) or 1, got 0.5",
        ),
    ],
)
def test_bad_data_errors_name_file_and_record(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message) as e:
        read_json_file(path)
    assert "bad.json" in str(e.value)


def test_records_without_ids_keep_their_split_when_the_file_is_renamed_or_reordered(tmp_path):
    from eagletree.train.data import split

    records = [
        {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(300)
    ]
    sides = []
    for name, recs in (("train.json", records), ("copy.json", records[::-1])):
        train, heldout = split(read_json_file(write_json(tmp_path / name, recs)), 0.05)
        sides.append(
            (sorted(c.messages[0]["content"] for c in train), sorted(c.messages[0]["content"] for c in heldout))
        )
    assert sides[0] == sides[1] and 0 < len(sides[0][1]) < 40  # (the file's name and record index moved them)


def test_the_data_command_counts_a_file_and_names_bad_input(tmp_path, capsys):
    import warnings

    from eagletree.cli import main

    path = write_json(tmp_path / "d.json", RECORDS[:3])
    shown = warnings.formatwarning
    assert main(["data", "--dataset", str(path)]) == 0  # (printed nothing without --stats)
    assert warnings.formatwarning is shown  # the one-line format is the command's only, not the caller's
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: 3 conversations (3 for training, 0 held out at 0.04)") and "--stats" in out
    assert main(["data", "--dataset", str(path), "--heldout-fraction", "1.5"]) == 2
    assert "--heldout-fraction must be in (0, 1), got 1.5" in capsys.readouterr().err
    assert main(["data", "--dataset", str(tmp_path)]) == 2
    assert "is a folder; expected a .json or .jsonl file" in capsys.readouterr().err


def _chat(conv_id, answer):
    return json.dumps(
        {
            "id": conv_id,
            "messages": [{"role": "user", "content": f"q {conv_id}"}, {"role": "assistant", "content": answer}],
        }
    )


def test_several_files_are_one_dataset_a_repeated_id_taken_from_the_later_file(tmp_path, capsys):
    from eagletree.cli import main

    first, second = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    first.write_text("\n".join([_chat("a", "a1"), _chat("b", "b1"), _chat("c", "c1")]) + "\n")
    # c twice in one file stays twice; b is answered again: the later file's b replaces it, at its own place
    second.write_text("\n".join([_chat("d", "d2"), _chat("b", "b2"), _chat("e", "e2"), _chat("e", "e2 again")]) + "\n")
    with pytest.warns(
        DataWarning,
        match=rf"1 conversations replaced by a later source's with the same id "
        rf"\({second} replaced 1\)",
    ):
        data = load_dataset(f"{first},{second}")
    assert [(c.id, c.messages[-1]["content"]) for c in data.conversations] == [
        ("a", "a1"),
        ("c", "c1"),
        ("d", "d2"),
        ("b", "b2"),
        ("e", "e2"),
        ("e", "e2 again"),
    ]
    assert data.replaced == 1 and data.source == f"{first},{second}"
    assert data.file_bytes == first.stat().st_size + second.stat().st_size
    assert stats(data)["replaced"] == 1
    # the other way round, the first file's b wins; spaces around the commas are allowed
    with pytest.warns(DataWarning, match=rf"\({first} replaced 1\)"):
        assert [
            c.messages[-1]["content"] for c in load_dataset(f"{second} , {first}").conversations if c.id == "b"
        ] == ["b1"]
    with pytest.warns(DataWarning):
        assert main(["data", "--dataset", f"{first},{second}"]) == 0
    out = capsys.readouterr().out
    assert "6 conversations" in out and "1 replaced by a later file's with the same id" in out


def test_a_list_of_sources_names_its_bad_entries(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(_chat("a", "x") + "\n")
    with pytest.raises(DataError, match="has an empty entry"):
        load_dataset(f"{one},")
    with pytest.raises(DataError, match=f"names '{one}': the same source more than once"):
        load_dataset(f"{one},{one}")
    with pytest.raises(DataError, match="the same source more than once"):  # one file, however it is written
        load_dataset(f"{one},{tmp_path}/./one.jsonl")
    with pytest.raises(DataError, match="missing.jsonl' does not exist"):
        load_dataset(f"{one},{tmp_path / 'missing.jsonl'}")
    odd = tmp_path / "a,b.jsonl"  # a file whose name has a comma is one source
    odd.write_text(_chat("z", "y") + "\n")
    assert [c.id for c in load_dataset(str(odd)).conversations] == ["z"]


@pytest.mark.real  # reads the real ShareGPT file
def test_sharegpt_among_several_sources_is_read_for_training_without_its_known_cut_warned(tmp_path):
    from eagletree.train.data import load_training_data

    mine = tmp_path / "mine.jsonl"
    mine.write_text(_chat("m0", "x") + "\n" + _chat("m1", "y")[:30])  # cut: this one is warned about
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = load_training_data(f"sharegpt,{mine}")
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "mine.jsonl: the last line is cut off" in said[0]
    assert (
        data.conversations[-1].id == "m0" and len(data.conversations) == len(load_dataset("sharegpt").conversations) + 1
    )


def test_an_assistant_turn_of_weight_0_is_context(tmp_path):
    # OpenAI's fine-tuning convention, in both formats: weight 0 is kept (not trained on), weight 1 is the default
    path = write_json(
        tmp_path / "w.json",
        [
            {
                "id": "a",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "weight": 0},
                    {"role": "user", "content": "r"},
                    {"role": "assistant", "content": "b", "weight": 1},
                ],
            },
            {"id": "b", "conversations": [{"from": "gpt", "value": "c", "weight": 0}]},
        ],
    )
    data = read_json_file(path)
    assert data.conversations[0].messages[1] == {"role": "assistant", "content": "a", "weight": 0}
    assert data.conversations[0].messages[3] == {"role": "assistant", "content": "b"}
    assert data.conversations[1].messages == [{"role": "assistant", "content": "c", "weight": 0}]
    # a weight on a user turn means nothing (never trained on); a file without ids whose text holds an escaped lone
    # surrogate (scraped chats) gets an id too (its hash failed to encode)
    path = tmp_path / "s.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "q \\ud83d", "weight": 0}, {"role": "assistant", "content": "a"}]}\n'
    )
    conv = read_json_file(path).conversations[0]
    assert conv.messages[0] == {"role": "user", "content": "q \ud83d"} and conv.id.startswith("text-")


def test_empty_conversations_are_counted_skips(tmp_path):
    path = write_json(tmp_path / "d.json", RECORDS[:3] + [{"id": "e", "conversations": []}])
    with pytest.warns(DataWarning, match="skipped 1 records"):
        data = read_json_file(path)
    assert len(data.conversations) == 3 and data.skipped_empty == 1


def test_heldout_split_is_deterministic_and_keeps_parts_together():
    ids = [f"conv{i}_{part}" for i in range(3000) for part in range(2)]
    held = {i for i in ids if is_heldout(i)}
    assert held == {i for i in reversed(ids) if is_heldout(i)}
    assert all(is_heldout(f"{base_id(i)}_0") == is_heldout(f"{base_id(i)}_1") for i in ids)
    assert 0.02 < len(held) / len(ids) < 0.06


@pytest.mark.real
def test_real_sharegpt_is_recovered_and_split():
    data = load_dataset("sharegpt")
    s = stats(data)
    assert s["truncated"] is True
    assert s["conversations"] >= 17_000
    assert s["heldout"] >= 500 and s["train"] + s["heldout"] == s["conversations"]
    assert s["recovered_until_byte"] < s["file_bytes"]
    train, heldout = split(data)
    assert not {base_id(c.id) for c in train} & {base_id(c.id) for c in heldout}


@pytest.mark.real
def test_data_stats_cli():
    out = subprocess.run(
        [sys.executable, "-m", "eagletree.cli", "data", "--dataset", "sharegpt", "--stats"],
        capture_output=True,
        text=True,
        check=True,
    )
    s = json.loads(out.stdout)
    assert s["conversations"] >= 17_000 and s["truncated"] is True
    assert {"conversations", "train", "heldout", "truncated", "turns"} <= set(s)
    assert "cut off" in out.stderr  # the warning reaches the user

"""Self-distillation data (`eagletree distill`) and fine-tuning a head from it (`init_head`, `eval_dataset`)."""

import json

import pytest
import torch

from eagletree.train.data import Conversation, is_heldout, load_dataset
from eagletree.train.distill import DistillError, answered_ids, distill, first_turns, user_turns
from eagletree.train.loop import TrainConfig, TrainingError, train

from helpers import records_of, tiny_conversations, tiny_model, tiny_tokenizer


def greedy_alone(model, tok, messages, max_new_tokens):
    """The argmax of the model's logits token by token, one prompt, no cache: what a distilled answer must equal."""
    from eagletree.decode import encode_prompt, stop_token_ids

    ids, stops, out = encode_prompt(tok, messages), stop_token_ids(model, tok), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(torch.cat([ids, torch.tensor(out, dtype=torch.long)])[None]).logits[0, -1].argmax())
            if nxt in stops:
                break
            out.append(nxt)
    return tok.decode(out, skip_special_tokens=True)


def mixed_length_conversations():
    convs = tiny_conversations(7)
    convs[2].messages[0]["content"] += " one two three four five six seven eight"  # a longer prompt in the batch
    convs.append(Conversation("starts-with-assistant", [{"role": "assistant", "content": "hi"}]))
    convs.append(
        Conversation(
            "with-system", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "red green"}]
        )
    )
    return convs


def test_first_turns_take_the_prompt_up_to_the_first_user_turn():
    items = dict(first_turns(mixed_length_conversations()))
    assert "starts-with-assistant" not in items
    assert [m["role"] for m in items["with-system"]] == ["system", "user"]
    assert [m["role"] for m in items["t0"]] == ["user"]


def multi_turn_conversations():
    return [
        Conversation(
            "c_0",
            [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "two"},
                {"role": "user", "content": "three"},
                {"role": "assistant", "content": "four"},
                {"role": "user", "content": " "},
                {"role": "assistant", "content": "five"},
                {"role": "user", "content": "six"},
            ],
        ),
        Conversation("d", [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}]),
    ]


def test_later_turns_are_the_conversation_so_far_with_ids_the_split_reads_as_the_same_chat():
    convs = multi_turn_conversations()
    later = dict(user_turns(convs, "later"))
    assert list(later) == ["c_0@turn2", "c_0@turn4"]  # turn 3 is empty; "d" has one turn
    assert [m["content"] for m in later["c_0@turn2"]] == ["one", "two", "three"]
    assert [m["content"] for m in later["c_0@turn4"]][-1] == "six" and len(later["c_0@turn4"]) == 7
    assert [i for i, _ in user_turns(convs, "all")] == ["c_0", "c_0@turn2", "c_0@turn4", "d"]
    assert user_turns(convs, "first") == first_turns(convs)
    with pytest.raises(DistillError, match="turns must be one of first, later, all, got 'second'"):
        user_turns(convs, "second")
    # Every part and turn of a chat lands on the same side of the held-out split as the chat itself.
    ids = [f"conv{i}" for i in range(400)]
    assert all(is_heldout(f"{i}_3@turn5", 0.3) == is_heldout(i, 0.3) == is_heldout(f"{i}@turn2", 0.3) for i in ids)
    assert any(is_heldout(i, 0.3) for i in ids) and not all(is_heldout(i, 0.3) for i in ids)


def test_later_turns_are_answered_greedily_and_refuse_a_file_of_first_turns(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    out = tmp_path / "later.jsonl"
    counts = distill(
        model,
        tok,
        multi_turn_conversations(),
        out,
        max_new_tokens=5,
        batch_size=2,
        progress=False,
        turns="later",
        max_prompt_tokens=10_000,
    )
    records = records_of(out)
    assert counts["answered"] == 2 and [r["id"] for r in records] == ["c_0@turn2", "c_0@turn4"]
    for r in records:
        assert r["messages"][-1]["content"] == greedy_alone(model, tok, r["messages"][:-1], 5)
        # the dataset's earlier answers are context (weight 0): training learns the target's answer only
        assert [m.get("weight") for m in r["messages"] if m["role"] == "assistant"] == [0] * (
            sum(m["role"] == "assistant" for m in r["messages"]) - 1
        ) + [None]
    from eagletree.train.render import render

    convs = load_dataset(str(out)).conversations
    trained = render(tok, convs[1].messages)
    assert tok.decode(trained.input_ids[trained.loss_mask]) == f"{records[1]['messages'][-1]['content']} <|end|>"
    with pytest.raises(DistillError, match='other settings: turns "later" there, absent here'):
        distill(model, tok, multi_turn_conversations(), out, max_new_tokens=5, progress=False)


def test_batched_answers_equal_the_unbatched_greedy_answers(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    counts = distill(model, tok, mixed_length_conversations(), out, max_new_tokens=10, batch_size=3, progress=False)
    records = records_of(out)
    assert counts["answered"] == len(records) == 8 and counts["eos"] + counts["length"] == 8
    for r in records:
        prompt, answer = r["messages"][:-1], r["messages"][-1]
        assert answer["role"] == "assistant" and r["finish"] in ("eos", "length")
        assert answer["content"] == greedy_alone(model, tok, prompt, 10), r["id"]
    # The file is training data as it stands.
    data = load_dataset(str(out))
    assert [c.messages[-1]["role"] for c in data.conversations] == ["assistant"] * 8


def test_an_interrupted_run_resumes_to_the_same_file_as_a_straight_run(tmp_path, monkeypatch):
    from eagletree.train.distill import answer_hf as mod

    model, tok = tiny_model("llama"), tiny_tokenizer()
    convs = tiny_conversations(10)
    options = dict(max_new_tokens=6, batch_size=2, temperature=1.0, seed=3, progress=False)
    distill(model, tok, convs, tmp_path / "straight.jsonl", **options)
    out = tmp_path / "resumed.jsonl"
    real, calls = mod._answer_batch, {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "_answer_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(model, tok, convs, out, **options)
    assert len(records_of(out)) == 4
    monkeypatch.setattr(mod, "_answer_batch", real)
    counts = distill(model, tok, convs, out, **options)
    assert counts["already"] == 4 and counts["answered"] == 6

    def by_id(path):
        return sorted(path.read_text().split("\n"))

    assert by_id(out) == by_id(tmp_path / "straight.jsonl")  # same records, sampled answers included
    # A kill in the middle of a write: the cut record is removed and answered again, nothing else.
    lines = out.read_text().split("\n")  # the header line, then the records
    out.write_text("\n".join(lines[:10]) + "\n" + lines[10][:25])  # the last of the 10 records cut
    with pytest.warns(UserWarning, match="removed a cut-off last line"):
        counts = distill(model, tok, convs, out, **options)
    assert counts["already"] == 9 and counts["answered"] == 1
    assert sorted(r["id"] for r in records_of(out)) == sorted(c.id for c in convs)
    assert distill(model, tok, convs, out, **options)["answered"] == 0  # nothing left to do
    with pytest.raises(
        DistillError,
        match=r"made with other settings: seed 3 there, absent here; temperature 1.0 there, 0.0 here; rerun with the "
        r"settings it was made with to continue it, or pass another --out",
    ):
        distill(model, tok, convs, out, max_new_tokens=6, progress=False)


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    out = tmp_path / "d.jsonl"
    distill(model, tok, tiny_conversations(3), out, max_new_tokens=4, progress=False)
    out.write_text(out.read_text().rstrip("\n"))
    assert len(answered_ids(out)) == 3 and out.read_text().endswith("\n")


def test_answers_stop_at_the_models_own_stop_tokens(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    convs = tiny_conversations(6)
    distill(model, tok, convs, tmp_path / "free.jsonl", max_new_tokens=8, progress=False)
    free = records_of(tmp_path / "free.jsonl")
    # A token the model writes in the middle of some answer becomes a stop token of its generation_config
    # (as Llama-3's <|eot_id|> or Gemma's <end_of_turn> are): answers must end right before it.
    longest = max((r["messages"][-1]["content"].split() for r in free), key=len)
    assert len(longest) >= 3
    word = longest[len(longest) // 2]
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(word)]
    counts = distill(model, tok, convs, tmp_path / "stopped.jsonl", max_new_tokens=8, progress=False)
    stopped = records_of(tmp_path / "stopped.jsonl")
    assert counts["eos"] >= 1
    for a, b in zip(free, stopped):
        full, cut = a["messages"][-1]["content"].split(), b["messages"][-1]["content"].split()
        assert word not in cut and full[: len(cut)] == cut
        assert (b["finish"] == "eos") == (word in full) and (len(cut) < len(full)) == (word in full)


def test_limits_long_prompts_and_bad_values(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    convs = mixed_length_conversations()
    counts = distill(
        model, tok, convs, tmp_path / "a.jsonl", max_new_tokens=4, limit=4, max_prompt_tokens=9, progress=False
    )  # t0..t3, of which t2's prompt has 16 tokens
    assert (counts["answered"], counts["skipped_long_prompt"]) == (3, 1)
    assert "t2" not in answered_ids(tmp_path / "a.jsonl")
    # The long prompts alone (what a file made with a lower max_prompt_tokens left out): t2 only.
    counts = distill(
        model,
        tok,
        convs,
        tmp_path / "long.jsonl",
        max_new_tokens=4,
        limit=4,
        min_prompt_tokens=10,
        max_prompt_tokens=64,
        progress=False,
    )
    assert (counts["answered"], counts["skipped_short_prompt"], counts["skipped_long_prompt"]) == (1, 3, 0)
    assert answered_ids(tmp_path / "long.jsonl") == {"t2"}
    # Only the prompts a regular expression finds something in (e.g. code questions for a datastore); counted, and
    # --limit takes the first N of those.
    counts = distill(
        model, tok, convs, tmp_path / "m.jsonl", max_new_tokens=4, match="(?i)SEVEN EIGHT$|^red green$", progress=False
    )
    assert answered_ids(tmp_path / "m.jsonl") == {"t2", "with-system"}
    assert (counts["answered"], counts["skipped_no_match"]) == (2, len(user_turns(convs)) - 2)
    counts = distill(
        model,
        tok,
        convs,
        tmp_path / "m1.jsonl",
        max_new_tokens=4,
        match="seven eight$|^red green$",
        limit=1,
        progress=False,
    )
    assert answered_ids(tmp_path / "m1.jsonl") == {"t2"}
    for kw, message in (
        (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
        (dict(match="(unclosed"), r"match must be a regular expression, got '\(unclosed' \(missing \)"),
        (
            dict(min_prompt_tokens=300, max_prompt_tokens=256),
            r"min_prompt_tokens \(300\) must not exceed max_prompt_tokens \(256\)",
        ),
        (dict(min_prompt_tokens=-1), "min_prompt_tokens must be an integer >= 0, got -1"),
        (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 1, got -1"),
        (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
    ):
        with pytest.raises(DistillError, match=message):
            distill(model, tok, convs, tmp_path / "b.jsonl", progress=False, **kw)
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"something": "else"}\n')
    with pytest.raises(DistillError, match="c.jsonl' is not a record file of `eagletree distill`: its first line is"):
        answered_ids(bad)


def test_skip_answered_leaves_out_prompts_another_file_answers(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    convs = tiny_conversations(6)
    long = tmp_path / "long.jsonl"
    distill(model, tok, convs, long, max_new_tokens=8, limit=3, progress=False)  # t0..t2, another max_new_tokens
    with open(long, "ab") as f:
        f.write(b'{"id": "t3", "mess')  # a cut-off line in the other file: ignored, and the file is not touched
    before = long.read_bytes()
    short = tmp_path / "short.jsonl"
    counts = distill(model, tok, convs, short, max_new_tokens=4, skip_answered=(long,), progress=False)
    assert (counts["answered"], counts["skipped_answered_elsewhere"]) == (3, 3)
    assert answered_ids(short) == {"t3", "t4", "t5"} and long.read_bytes() == before
    for r in records_of(short):  # the same answers as a run without the other file
        assert r["messages"][-1]["content"] == greedy_alone(model, tok, r["messages"][:-1], 4), r["id"]
    # A complete last record without its newline counts; a path may be given alone.
    three = tmp_path / "three.jsonl"
    three.write_bytes(short.read_bytes().rstrip(b"\n"))
    counts = distill(model, tok, convs, tmp_path / "rest.jsonl", max_new_tokens=4, skip_answered=three, progress=False)
    assert (counts["answered"], counts["skipped_answered_elsewhere"]) == (3, 3)
    assert answered_ids(tmp_path / "rest.jsonl") == {"t0", "t1", "t2"}
    for others, message in (
        ((tmp_path / "missing.jsonl",), "skip_answered: .*missing.jsonl is not a file; expected a JSONL file"),
        ((short,), "skip_answered: .*short.jsonl is the output file itself"),
        (
            (tmp_path / "bad.jsonl",),
            "bad.jsonl: line 1 is not a distillation record .*; pass another --skip-answered file",
        ),
    ):
        (tmp_path / "bad.jsonl").write_text('{"something": "else"}\n')
        with pytest.raises(DistillError, match=message):
            distill(model, tok, convs, short, max_new_tokens=4, skip_answered=others, progress=False)


def test_sampled_answers_follow_the_seed(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    convs = tiny_conversations(4)
    texts = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        distill(
            model, tok, convs, tmp_path / f"{name}.jsonl", max_new_tokens=8, temperature=1.0, seed=seed, progress=False
        )
        texts.append((tmp_path / f"{name}.jsonl").read_text())
    assert texts[0] == texts[1] != texts[2]


def test_the_eagletree_decoder_writes_the_records_hf_writes(tmp_path, monkeypatch):
    from eagletree.draft import EagleHead

    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))  # auto's latency profile lands here
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval()
    convs = mixed_length_conversations()
    options = dict(max_new_tokens=8, batch_size=3, progress=False)
    distill(model, tok, convs, tmp_path / "free.jsonl", **options)
    # a word the model writes mid-answer becomes a stop token, so some answers end with "eos", others at the length
    longest = max((r["messages"][-1]["content"].split() for r in records_of(tmp_path / "free.jsonl")), key=len)
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(longest[len(longest) // 2])]
    hf = distill(model, tok, convs, tmp_path / "hf.jsonl", **options)
    assert hf["eos"] >= 1 and hf["length"] >= 1
    for name, drafter in (("eagletree", head), ("plain", None)):  # with the head, and batched plain decoding
        out = tmp_path / f"{name}.jsonl"
        counts = distill(model, tok, convs, out, decoder="eagletree", head=drafter, **options)
        assert {k: v for k, v in counts.items() if k not in ("out", "seconds")} == {
            k: v for k, v in hf.items() if k not in ("out", "seconds")
        }
        assert sorted(out.read_text().splitlines()) == sorted((tmp_path / "hf.jsonl").read_text().splitlines())
    # The same records: a file begun with one decoder is continued with the other.
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join((tmp_path / "hf.jsonl").read_text().splitlines(keepends=True)[:4]))  # header, 3 records
    counts = distill(model, tok, convs, mixed, decoder="eagletree", head=head, **options)
    assert (counts["already"], counts["answered"]) == (3, 5)
    assert sorted(mixed.read_text().splitlines()) == sorted((tmp_path / "hf.jsonl").read_text().splitlines())
    for kw, message in (
        (dict(decoder="eagletree", temperature=1.0), "decoder='eagletree' answers greedily"),
        (dict(decoder="sglang"), "decoder must be one of hf, eagletree, vllm, got 'sglang'"),
        (
            dict(decoder="eagletree", max_new_tokens=600),
            r"t\d: its prompt \(\d+ tokens\) \+ max_new_tokens \(600\) exceeds",
        ),
    ):
        with pytest.raises(DistillError, match=message):
            distill(model, tok, convs, tmp_path / "e.jsonl", progress=False, head=head, **kw)


def test_distill_decoder_flags_are_checked_before_loading(tmp_path, capsys, monkeypatch):
    from eagletree.cli import main

    monkeypatch.setattr("eagletree.target.load_target", lambda *a, **k: pytest.fail("loaded"))
    out = ["distill", "--out", str(tmp_path / "d.jsonl")]
    for argv, message in (
        (["--decoder", "eagletree", "--temperature", "1"], "--engine eagletree answers greedily; --temperature 1"),
        (["--decoder", "hf", "--head", str(tmp_path)], "--head goes with --engine eagletree"),
    ):
        assert main([*out, *argv]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*out, "--decoder", "sglang"])
    assert "argument --engine/--decoder: invalid choice: 'sglang'" in capsys.readouterr().err


def _cfg(tmp_path, **kw):
    base = dict(
        out_dir=str(tmp_path),
        report_to="none",
        steps=2,
        grad_accum=2,
        save_every=2,
        warmup_steps=1,
        max_len=40,
        lr=1e-3,
        device="cpu",
    )
    return TrainConfig(**(base | kw))


def _train(cfg):
    return train(
        cfg,
        model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
        conversations=tiny_conversations(8),
        progress=False,
    )


def test_init_head_starts_from_the_saved_weights(tmp_path):
    first, _ = _train(_cfg(tmp_path / "a", draft_vocab=30))
    # lr 0: the fine-tuning run's head is the saved head exactly (draft vocabulary included).
    again, _ = _train(_cfg(tmp_path / "b", init_head=str(tmp_path / "a" / "head"), lr=0.0))
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    tuned, _ = _train(_cfg(tmp_path / "c", init_head=str(tmp_path / "a" / "head"), steps=3))
    assert torch.equal(tuned.d2t, first.d2t) and not torch.equal(tuned.fc.weight, first.fc.weight)


def test_widen_vocab_fine_tunes_a_draft_vocabulary_head_over_the_full_vocabulary(tmp_path):
    from eagletree.train.config import TrainConfig

    first, _ = _train(_cfg(tmp_path / "a", draft_vocab=30))
    head = str(tmp_path / "a" / "head")
    same, _ = _train(_cfg(tmp_path / "b", init_head=head, widen_vocab=True, lr=0.0))
    assert same.config.draft_vocab_size is None and torch.equal(same.d2t, torch.arange(97))
    for (name, a), (_, b) in zip(first.state_dict().items(), same.state_dict().items()):
        assert name == "d2t" or torch.equal(a, b), name  # the weights carry over; only the vocabulary widens
    tuned, _ = _train(_cfg(tmp_path / "c", init_head=head, widen_vocab=True, steps=3))
    assert tuned.config.draft_vocab_size is None and not torch.equal(tuned.fc.weight, first.fc.weight)
    with pytest.raises(TrainingError, match="widen_vocab widens the draft vocabulary of init_head's head"):
        TrainConfig.from_sources(None, ["widen_vocab=true"])
    with pytest.raises(TrainingError, match="a 'eagle3' head scores tokens with its own lm_head"):
        TrainConfig.from_sources(None, [f"init_head={head}", "widen_vocab=true", "head_type=eagle3"])
    with pytest.raises(TrainingError, match="draft_vocab is 30: set draft_vocab=0"):
        TrainConfig.from_sources(None, [f"init_head={head}", "widen_vocab=true", "draft_vocab=30"])


def test_a_checkpoint_takes_precedence_over_init_head_on_resume(tmp_path):
    _train(_cfg(tmp_path / "a", draft_vocab=30))
    cfg = _cfg(tmp_path / "b", init_head=str(tmp_path / "a" / "head"), steps=4)
    straight, _ = _train(cfg)
    _train(_cfg(tmp_path / "c", init_head=str(tmp_path / "a" / "head"), steps=4, stop_after=2))
    resumed, _ = train(
        _cfg(tmp_path / "c", init_head=str(tmp_path / "a" / "head"), steps=4),
        resume=True,
        model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
        conversations=tiny_conversations(8),
        progress=False,
    )
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert (a - b).abs().max() <= 1e-6, name


def test_init_head_errors_name_the_problem(tmp_path):
    _train(_cfg(tmp_path / "a", draft_vocab=30))
    head = str(tmp_path / "a" / "head")
    with pytest.raises(TrainingError, match="is not a saved head"):
        _train(_cfg(tmp_path / "b", init_head=str(tmp_path / "nowhere")))
    with pytest.raises(TrainingError, match="holds a 'eagle' head but the config asks for head_type 'medusa'"):
        _train(_cfg(tmp_path / "b", init_head=head, head_type="medusa"))
    with pytest.raises(TrainingError, match="drafts over 30 tokens but the config asks for draft_vocab=20"):
        _train(_cfg(tmp_path / "b", init_head=head, draft_vocab=20))


def test_eval_dataset_gives_held_out_prompts_to_a_distilled_run(tmp_path, monkeypatch):
    from eagletree import target
    from eagletree.draft import EagleHead
    from eagletree.train.data import is_heldout
    from eagletree.train.evaluate import evaluate_run

    model, tok = tiny_model("llama"), tiny_tokenizer()
    devices = []
    monkeypatch.setattr(target, "load_target", lambda *a, **k: devices.append(k.get("device")) or (model, tok))
    convs = tiny_conversations(40)
    heldout = [c for c in convs if is_heldout(c.id, 0.3)]
    assert len(heldout) > 4

    def write(path, conversations):
        path.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in conversations))

    write(tmp_path / "distilled.jsonl", [c for c in convs if not is_heldout(c.id, 0.3)])
    write(tmp_path / "all.jsonl", convs)
    head = EagleHead.for_target(model.config).eval()
    cfg = _cfg(tmp_path, dataset=str(tmp_path / "distilled.jsonl"), heldout_fraction=0.3, eval_conversations=2)
    with pytest.raises(TrainingError, match=r"has 0 held-out conversations.*set eval_dataset"):
        evaluate_run(cfg, head, n_prompts=2, max_new_tokens=4)
    cfg = _cfg(
        tmp_path,
        dataset=str(tmp_path / "distilled.jsonl"),
        eval_dataset=str(tmp_path / "all.jsonl"),
        heldout_fraction=0.3,
        eval_conversations=2,
    )
    metrics = evaluate_run(cfg, head, n_prompts=2, max_new_tokens=4, mtbench=2)
    assert metrics["eagle2_60"]["prompts"] == 2 and metrics["agreement"]["chains"] > 0
    assert devices[-1] == cfg.device == "cpu"  # the run's device (it loaded the default device before)
    # MT-bench first turns (2 questions: one writing, one coding), per category, head alone and with copies.
    for row in ("eagle2_60", "eagle2_60_copy"):
        table = metrics["mtbench"][row]
        assert table["questions"] == 2 and table["max_new_tokens"] == 128
        assert list(table["tokens_per_pass"]) == ["writing", "coding", "mean"]
        assert all(v >= 1.0 for v in table["tokens_per_pass"].values())
    assert (
        metrics["agreement_own_answers"]["positions"] == metrics["eagle2_60"]["new_tokens"] - 2
    )  # last one has no next
    # The head alone, and with copied spans (same prompts, same lossless answers); the copy calibration is saved.
    assert metrics["eagle2_60_copy"]["new_tokens"] == metrics["eagle2_60"]["new_tokens"]
    (tmp_path / "run" / "head").mkdir(parents=True, exist_ok=True)
    cfg.out_dir = str(tmp_path / "run")
    evaluate_run(cfg, head, n_prompts=2, max_new_tokens=12)
    from eagletree.search.copy import CopyCalibration

    saved = json.loads((tmp_path / "run" / "head" / "copy_calibration.json").read_text())
    assert CopyCalibration.load(tmp_path / "run" / "head" / "copy_calibration.json").max_len == 16
    assert sum(map(sum, saved["tried"])) >= sum(map(sum, saved["accepted"]))


def test_evaluation_decodes_prompt_lists_in_batches():
    from eagletree.draft import EagleHead
    from eagletree.train.evaluate import (
        heldout_prompts,
        main,
        measure_copy_calibration,
        mtbench_tokens_per_pass,
        tokens_per_pass,
    )

    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval()
    prompts = heldout_prompts(tiny_conversations(5), 5)
    options = dict(max_new_tokens=10, budget=8, depth=3, top_k_draft=2)
    one, three = [], []
    alone = tokens_per_pass(head, model, tok, prompts, answers=one, **options)
    batched = tokens_per_pass(head, model, tok, prompts, answers=three, batch_size=3, **options)
    # the same lossless answers, in the prompts' order; tokens/pass now measures batched decoding
    assert [a.tolist() for _, a in three] == [a.tolist() for _, a in one] and len(three) == 5
    assert [p.tolist() for p, _ in three] == [p.tolist() for p, _ in one]
    assert batched["new_tokens"] == alone["new_tokens"] and batched["prompts"] == 5
    assert batched["tokens_per_pass"] >= 1.0 and batched["predicted"] >= 1.0
    with pytest.raises(ValueError, match="steps are recorded one prompt at a time"):
        tokens_per_pass(head, model, tok, prompts, steps=[], batch_size=2, **options)
    calibration, result = measure_copy_calibration(head, model, tok, prompts, 10, budget=8, batch_size=3)
    assert result["new_tokens"] == alone["new_tokens"] and calibration.tried.sum() >= calibration.accepted.sum()
    table = mtbench_tokens_per_pass(head, model, tok, 2, max_new_tokens=6, depth=3, batch_size=2)
    assert table["batch_size"] == 2 and list(table["tokens_per_pass"]) == ["writing", "coding", "mean"]
    assert "batch_size" not in mtbench_tokens_per_pass(head, model, tok, 2, max_new_tokens=6, depth=3)
    assert main(["--config", "none.yaml", "--batch-size", "0"]) == 2


@pytest.mark.real
def test_distill_command_answers_training_prompts_with_the_real_target(tmp_path, capsys, smollm2, monkeypatch):
    from eagletree.cli import main
    from eagletree.train.data import is_heldout

    model, tok = smollm2
    loads = []  # the command's default target, handed the session's copy of it (not loaded again three times)
    monkeypatch.setattr(
        "eagletree.target.load_target",
        lambda spec, dtype=None, device=None: loads.append((str(spec), dtype)) or (model, tok),
    )
    out = tmp_path / "smol.jsonl"
    assert (
        main(
            [
                "distill",
                "--out",
                str(out),
                "--limit",
                "3",
                "--max-new-tokens",
                "12",
                "--batch-size",
                "2",
                "--pack",
                "off",
            ]
        )
        == 0
    )
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = records_of(out)
    assert len(records) == counts["answered"] == 3 - counts["skipped_long_prompt"] > 0
    assert loads == [("smollm2-135m", loads[0][1])] and loads[0][1] in (None, torch.float32)  # the default target
    for r in records:
        assert not is_heldout(r["id"])  # evaluation prompts are never answered
        assert r["messages"][-1]["content"] == greedy_alone(model, tok, r["messages"][:-1], 12)
    # A second file with shorter answers takes only the prompts the first one lacks.
    short = tmp_path / "short.jsonl"
    assert (
        main(
            [
                "distill",
                "--out",
                str(short),
                "--limit",
                "4",
                "--max-new-tokens",
                "6",
                "--batch-size",
                "2",
                "--pack",
                "off",
                "--skip-answered",
                str(out),
            ]
        )
        == 0
    )
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["skipped_answered_elsewhere"] == len(records)
    assert counts["answered"] == 4 - len(records) - counts["skipped_long_prompt"]
    assert not {r["id"] for r in records_of(short)} & {r["id"] for r in records}
    # --match: only prompts the regular expression finds something in (here the first about Python)
    code = tmp_path / "code.jsonl"
    assert (
        main(
            [
                "distill",
                "--out",
                str(code),
                "--limit",
                "1",
                "--max-new-tokens",
                "4",
                "--batch-size",
                "1",
                "--max-prompt-tokens",
                "2048",
                "--pack",
                "off",
                "--match",
                "(?i)python",
            ]
        )
        == 0
    )
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    [record] = records_of(code)
    assert counts["answered"] == 1 and counts["skipped_no_match"] > 1000
    assert "python" in record["messages"][-2]["content"].lower()
    assert main(["distill", "--out", str(tmp_path / "new.jsonl"), "--match", "(unclosed"]) == 2  # before loading
    assert "match must be a regular expression, got '(unclosed'" in capsys.readouterr().err


def test_distill_answers_named_humaneval_problems_with_their_task_ids(tmp_path):
    from eagletree.prompts import CODE_INSTRUCTION
    from eagletree.train.distill import distill_prompts

    convs = distill_prompts("humaneval:101-103", 0.02)  # problems 101-103 are HumanEval/100 .. HumanEval/102
    assert [c.id for c in convs] == ["HumanEval/100", "HumanEval/101", "HumanEval/102"]
    for conv in convs:
        [message] = conv.messages
        assert message["role"] == "user"
        assert message["content"].startswith(CODE_INSTRUCTION.split("{")[0]) and "def " in message["content"]
    assert distill_prompts("humaneval:101-103", 0.02)[1].messages != convs[0].messages  # distinct problems
    with pytest.raises(ValueError, match=r"--dataset 'humaneval:9-3': expected humaneval, humaneval:N"):
        distill_prompts("humaneval:9-3", 0.02)
    with pytest.raises(ValueError, match="HumanEval has 164 problems; problems 160 to 169 asked for"):
        distill_prompts("humaneval:160-169", 0.02)
    # The records train like any other distilled file: their ids are what a later run skips.
    model, tok = tiny_model("llama"), tiny_tokenizer()
    counts = distill(
        model, tok, convs[:1], tmp_path / "he.jsonl", max_new_tokens=3, max_prompt_tokens=4096, progress=False
    )
    assert counts["answered"] == 1 and answered_ids(tmp_path / "he.jsonl") == {"HumanEval/100"}

"""One bad sequence in a batch: refused by its index before decoding starts, or, when it is found only while
decoding (an answer that reaches a sliding-window target's window), ended with an error in its own result while
the others finish as they would alone; and batched runs (`generate --prompts`, `distill --decoder eagletree`)
interrupted and resumed.

The sequence-level failure used here is the one a target can actually hit mid-answer: eagletree verifies trees
over the full cache, so a sliding-window target (Mistral-style) cannot decode past its window. A prompt longer
than the window cannot give one token and is refused up front; one that fits but whose answer runs into the
window ends there, with the tokens decoded so far (HF's own for those positions).
"""

import json
import re

import pytest
import torch
from test_batch import (
    hf_greedy,  # (HF's sliding-window attention runs past the window)
    mimic_head,
)

from eagletree.cli import main as cli_main
from eagletree.decode import Decoder, decode_text, encode_prompt
from eagletree.decode.config import DecodeConfig
from eagletree.draft import EagleHead
from eagletree.target import TargetError
from eagletree.train.distill import DistillError, distill

from helpers import records_of, tiny_config, tiny_conversations, tiny_model, tiny_tokenizer

WINDOW = 16


def windowed(window: int = WINDOW, layers: int = 2):
    """A tiny random Mistral whose sliding window is `window` tokens (its context, 512, is longer)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("mistral")
    config.sliding_window, config.num_hidden_layers = window, layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    return model


def prompt_of(n: int, seed: int) -> list[int]:
    """n random token ids, none of them the tokenizer's stop token (id 1)."""
    return (torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(seed))).tolist()


@pytest.mark.parametrize("drafter", ["none", "random", "mimic"])
def test_a_sequence_that_reaches_the_window_ends_with_an_error_and_the_others_finish_as_alone(drafter):
    """Greedy: a finished answer is HF's; one that reached the window ends with the error and HF's first tokens
    (all those whose sequence fits the window). The mimic head's drafts are often accepted several at a time, so
    trees that would run past the window are cut to their root near it."""
    layers = 1 if drafter == "mimic" else 2
    model, reference, tok = windowed(layers=layers), windowed(layers=layers), tiny_tokenizer()
    torch.manual_seed(0)
    head = {"none": None, "random": EagleHead.for_target(model.config).eval(), "mimic": mimic_head(model)}[drafter]
    n = 10
    decoder = Decoder(model, tok, head, DecodeConfig(tree="eagle2", budget=8, depth=4, max_new_tokens=n))
    lengths = (3, 12, 2, 9, 4, 13, 11)
    prompts = [prompt_of(length, seed) for seed, length in enumerate(lengths)]
    results = decoder.generate_batch(prompts, batch_size=3)
    ended = 0
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        hf, fit = hf_greedy(reference, prompt, n, decoder.stops), WINDOW - len(prompt) + 1
        assert result.stats.new_tokens == len(result.token_ids) and result.text == decode_text(tok, result.token_ids)
        if len(hf) <= fit:  # finished: exactly the greedy answer, as alone
            assert result.error is None and result.token_ids == hf, i
            assert result.token_ids == decoder.generate(prompt).token_ids, i
            continue
        ended += 1
        assert result.token_ids == hf[:fit], i  # the tokens decoded before the window: kept
        assert re.fullmatch(
            rf"the answer reached the target's sliding window of {WINDOW} tokens \(prompt {len(prompt)} \+ "
            rf"{fit} new tokens\); .*",
            result.error,
        ), result.error
    assert 3 <= ended <= 4
    # One prompt alone: the error is raised, after the tokens that fit were yielded.
    got = []
    with pytest.raises(TargetError, match=f"sliding window of {WINDOW} tokens"):
        for step in decoder.steps(prompts[1]):
            got += step.tokens
    assert got == results[1].token_ids


def test_measurements_of_batched_decoding_refuse_an_answer_cut_by_the_window_by_its_prompt():
    """bench's batched runs, its throughput sweep and evaluate's batched tokens/pass need whole answers: one that
    ended at the window (its result's error) is a TargetError naming its prompt, as decoding it alone raises,
    not a short answer counted as the target's."""
    from eagletree.bench.inputs import Method
    from eagletree.bench.runners import RunSettings, run_tree_batch
    from eagletree.bench.throughput import throughput
    from eagletree.train.evaluate import tokens_per_pass

    model, tok = windowed(), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    prompts = [prompt_of(3, 0), prompt_of(12, 1)]  # the second one's 10 new tokens run past the window of 16
    fits = run_tree_batch(model, tok, head, prompts[:1], Method("eagle2", 6, 3, 3), RunSettings(10, 0.0, 0), 2)[1]
    assert len(fits[0]) == 10
    with pytest.raises(TargetError, match=rf"^prompt 1: the answer reached the target's sliding window of {WINDOW}"):
        run_tree_batch(model, tok, head, prompts, Method("eagle2", 6, 3, 3), RunSettings(10, 0.0, 0), 2)
    with pytest.raises(TargetError, match="^prompt 1: the answer reached"):
        tokens_per_pass(head, model, tok, prompts, max_new_tokens=10, batch_size=2, budget=6, depth=3)
    with pytest.raises(TargetError, match="^prompt 1: the answer reached"):
        throughput(model, tok, head, prompts, [2], DecodeConfig(tree="eagle2", budget=6, max_new_tokens=10), False)


def test_a_prompt_longer_than_the_window_is_refused_by_its_index_before_decoding():
    model, tok = windowed(), tiny_tokenizer()
    decoder = Decoder(model, tok, None, DecodeConfig(tree="eagle2", budget=6, max_new_tokens=4))
    prompts = [prompt_of(3, 0), prompt_of(WINDOW + 1, 1), prompt_of(WINDOW, 2)]
    results = decoder.results(prompts, 2)
    with pytest.raises(
        ValueError, match=rf"^prompt 1: prompt \({WINDOW + 1} tokens\) is longer than the target's sliding window"
    ):
        next(results)
    # A prompt of exactly the window gives one token, then ends with the error; truncate_prompt keeps the last
    # tokens that leave room for max_new_tokens inside the window.
    first, last = decoder.generate_batch([prompts[0], prompts[2]])
    assert first.error is None and len(first.token_ids) == 4
    assert len(last.token_ids) == 1 and "sliding window" in last.error
    cut = Decoder(model, tok, None, DecodeConfig(tree="eagle2", budget=6, max_new_tokens=4, truncate_prompt=True))
    assert cut.generate_batch([prompts[1]])[0].error is None
    assert cut.generate(prompts[1]).token_ids == decoder.generate(prompts[1][-(WINDOW - 4) :]).token_ids


@pytest.fixture
def windowed_cli(tmp_path, monkeypatch):
    model, tok = windowed(), tiny_tokenizer()
    torch.manual_seed(0)
    EagleHead.for_target(model.config).save_pretrained(tmp_path / "head")
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    return model, tok, ["--target", "tiny", "--head", str(tmp_path / "head")]


FAST = ["--max-new-tokens", "8", "--tree", "eagle2", "--budget", "6", "--pack", "off"]
SHORT = ["hello how are you", "tell me a joke", "why is the sky blue"]
LONG = "what is two plus four six the sky blue why because"  # 10 words: a 13-token prompt, 4 tokens fit


def _records(path):
    return records_of(path)


def test_generate_prompts_writes_a_sequence_error_in_its_record_and_exits_1(windowed_cli, tmp_path, capsys):
    model, tok, args = windowed_cli
    reference = windowed()
    prompts = tmp_path / "p.txt"
    lines = [SHORT[0], LONG, SHORT[1], SHORT[2]]
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", *args, *FAST, "--prompts", str(prompts), "--batch-size", "2"]
    assert cli_main([*argv, "--out", str(out)]) == 1
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("[4 of 4 prompts answered: ") and summary.endswith(
        "; 1 ended with an error: prompt 1]"
    ), summary
    records = sorted(_records(out), key=lambda r: r["index"])
    assert [r["prompt"] for r in records] == lines
    bad = records[1]
    assert set(bad) == {"index", "prompt", "text", "new_tokens", "tokens_per_pass", "error"}
    assert bad["error"].startswith(f"the answer reached the target's sliding window of {WINDOW} tokens")
    ids = encode_prompt(tok, [{"role": "user", "content": LONG}]).tolist()
    stops = [tok.eos_token_id]
    expected = hf_greedy(reference, ids, 8, stops)[: WINDOW - len(ids) + 1]
    assert bad["new_tokens"] == len(expected) and bad["text"] == tok.decode(expected, skip_special_tokens=True)
    for r in records[:1] + records[2:]:  # the others: as `generate --prompt` answers them alone
        assert "error" not in r
        assert cli_main(["generate", *args, *FAST, "--prompt", r["prompt"], "--json"]) == 0
        alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (r["text"], r["new_tokens"]) == (alone["text"], alone["new_tokens"]), r["index"]
    # A rerun keeps the record (the same error would come again) and has nothing to do.
    assert cli_main([*argv, "--out", str(out)]) == 0
    assert "[0 of 4 prompts answered (4 already answered in --out)" in capsys.readouterr().out
    # Without --out, the error goes to stderr next to the text printed for that prompt.
    assert cli_main(argv) == 1
    captured = capsys.readouterr()
    assert f"[1] {bad['text']}" in captured.out.splitlines()
    assert f"prompt 1: error: {bad['error']}" in captured.err.splitlines()


def test_distill_with_the_eagletree_decoder_skips_a_sequence_error_by_name(tmp_path, monkeypatch):
    # (a window of 256: distill decodes with tree "auto", whose latency probe verifies trees after 128 tokens)
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    model, tok = windowed(256), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval()
    convs = tiny_conversations(5)
    convs[2].messages[0]["content"] = " ".join((LONG.split() * 25)[:248])  # a 251-token prompt: 6 tokens fit
    options = dict(max_new_tokens=8, batch_size=2, progress=False)
    hf = distill(windowed(256), tok, convs, tmp_path / "hf.jsonl", **options)  # HF decodes past the window
    assert hf["answered"] == 5 and hf["skipped_error"] == 0
    out = tmp_path / "e.jsonl"
    with pytest.warns(UserWarning, match=rf"{convs[2].id}: not written: the answer reached the target's sliding"):
        counts = distill(model, tok, convs, out, decoder="eagletree", head=head, **options)
    assert counts["answered"] == 4 and counts["skipped_error"] == 1
    hf_lines = [line for line in (tmp_path / "hf.jsonl").read_text().splitlines() if convs[2].id not in line]
    assert sorted(out.read_text().splitlines()) == sorted(hf_lines)  # the others: HF's records
    # A prompt longer than the window gives no token: refused by its id before anything is decoded.
    convs[3].messages[0]["content"] = " ".join((LONG.split() * 30)[:260])
    with pytest.raises(DistillError, match=rf"^{convs[3].id}: its prompt \(263 tokens\) is longer than the target's"):
        distill(model, tok, convs, tmp_path / "long.jsonl", max_prompt_tokens=300, decoder="eagletree", **options)
    assert not (tmp_path / "long.jsonl").exists()


def test_an_interrupted_batched_eagletree_distill_resumes_to_the_straight_runs_records(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval()
    convs = tiny_conversations(8)
    options = dict(max_new_tokens=6, batch_size=3, progress=False, decoder="eagletree", head=head)
    straight = tmp_path / "straight.jsonl"
    distill(model, tok, convs, straight, **options)
    real = Decoder.results

    def interrupted(self, prompts, batch_size=8):
        for n, item in enumerate(real(self, prompts, batch_size)):
            if n == 3:
                raise KeyboardInterrupt  # Ctrl-C after three records were written
            yield item

    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(Decoder, "results", interrupted)
    with pytest.raises(KeyboardInterrupt):
        distill(model, tok, convs, out, **options)
    assert len(records_of(out)) == 3
    monkeypatch.setattr(Decoder, "results", real)
    done = {r["id"] for r in records_of(out)}
    torn = next(line for line in straight.read_text().splitlines()[1:] if json.loads(line)["id"] not in done)
    with open(out, "a") as f:  # a kill in the middle of a write: the record of a missing id, cut
        f.write(torn[: len(torn) // 2])
    with pytest.warns(UserWarning, match="removed a cut-off last line"):
        counts = distill(model, tok, convs, out, **options)
    assert (counts["already"], counts["answered"]) == (3, 5)
    ids = [r["id"] for r in records_of(out)]
    assert sorted(ids) == sorted(c.id for c in convs)  # every prompt once
    assert sorted(out.read_text().splitlines()) == sorted(straight.read_text().splitlines())  # the same answers
    assert distill(model, tok, convs, out, **options)["answered"] == 0

"""`eagletree plan --engine llamacpp`: the head's own greedy chains against what the decoder drafts and accepts,
llama.cpp's schedule replayed on them, the cost model's choice, its flags and the CLI's refusals."""

import json

import pytest
import torch

from eagletree import serve
from eagletree.decode import Decoder
from eagletree.decode.config import CopyOptions, DecodeConfig
from eagletree.draft import EagleHead
from eagletree.errors import InvalidValue
from eagletree.plan_llamacpp import Chain, LlamaCosts, choose, options, own_chains, plan_llamacpp, read_costs, simulate

from helpers import small_block_head, tiny_model, tiny_tokenizer

# one answer of 6 tokens; the chain at position t drafts token t on (position 0's comes from the prefill)
ANSWER = [
    Chain([0, 0, 0], [0.5, 0.5, 0.5], 0),
    Chain([0, 0, 0], [0.9, 0.6, 0.2], 2),
    Chain([0, 0, 0], [0.5, 0.5, 0.5], 0),
    Chain([0, 0, 0], [0.8, 0.3, 0.9], 3),
    Chain([0, 0, 0], [0.95, 0.9, 0.9], 1),
    Chain([0, 0, 0], [0.1, 0.1, 0.1], 0),
]


@pytest.mark.parametrize(
    "k, p_min, per_draft, n_predict, expected",
    [
        # t=1: 3 drafts, 2 accepted -> t=4: 3 drafts, 1 accepted -> t=6
        (3, 0.0, True, None, {"steps": 2, "sizes": [0, 0, 0, 0, 2], "drafts": 6, "calls": [0, 0, 0, 0, 6]}),
        # t=1: 0.2 < 0.5 ends the chain at 2 drafts (3 calls), both accepted -> t=4: 3 drafts, 1 accepted
        (3, 0.5, True, None, {"steps": 2, "sizes": [0, 0, 0, 1, 1], "drafts": 5, "calls": [0, 0, 0, 3, 3]}),
        # a block head: one call a step; t=1: 1 draft, accepted -> t=3: none (0.8) -> t=4: 2 drafts, 1 accepted
        (2, 0.85, False, None, {"steps": 3, "sizes": [0, 1, 1, 1], "drafts": 3, "calls": [0, 1, 1, 1]}),
        # llama-server drafts at most the tokens left less one: at t=4 one draft (one call, n_max reached)
        (3, 0.0, True, 6, {"steps": 2, "sizes": [0, 0, 1, 0, 1], "drafts": 4, "calls": [0, 0, 1, 0, 3]}),
        # t=1 -> 3 -> 5, one draft accepted each; at t=5 nothing may be drafted: a plain step, no call
        (1, 0.0, True, 6, {"steps": 3, "sizes": [0, 1, 2], "drafts": 2, "calls": [0, 0, 2]}),
    ],
)
def test_simulate_replays_llamacpps_schedule(k, p_min, per_draft, n_predict, expected):
    assert simulate([ANSWER], k, p_min, per_draft, n_predict) == {"tokens": 6, **expected}


@pytest.mark.parametrize("kind", ["eagle", "dflash"])
def test_own_chains_are_what_the_decoders_chain_drafts_and_accepts(kind):
    """At every position where eagletree's chain decoding starts a pass, the own chain's tokens are the pass's drafts
    and its matched count (capped at k) is what the pass accepts; probabilities are the drafts' top ones."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval() if kind == "eagle" else small_block_head(model, block_size=4)
    k = 3
    prompts = [torch.tensor([5, 9, 11, 3]), torch.tensor([7, 2, 40])]
    chains = own_chains(model, tok, head, prompts, max_new_tokens=12, depth=k, progress=False)
    config = DecodeConfig(tree="chain", depth=k, budget=k + 1, max_new_tokens=12, copy=CopyOptions(enabled=False))
    decoder = Decoder(model, tok, head, config)
    checked = 0
    for prompt, answer in zip(prompts, chains):
        t = 0
        for step in decoder.steps(prompt):
            chain = answer[t]
            drafted = step.draft.tokens[1:].tolist()  # (fewer than k where the answer's last tokens are near)
            assert drafted == chain.tokens[: len(drafted)] and len(drafted) >= min(k, 12 - t - 1)
            assert len(step.accepted) - 1 == min(chain.matched, len(drafted))
            assert all(0 < p <= 1 for p in chain.probs)
            t, checked = t + len(step.tokens), checked + 1
        assert t == len(answer)
    assert checked >= 8


def costs(threads=2, plain_ms=10.0, empty_ms=12.0, one_ms=20.0, draft_ms=3.0, stop_call_ms=2.0, share=0.8, ngram=None):
    return LlamaCosts(threads, plain_ms, empty_ms, one_ms, draft_ms, stop_call_ms, share, ngram or {})


def test_the_prediction_is_tokens_over_the_modelled_step_time():
    rows = options([ANSWER], [costs()], max_k=3, call_per_draft=True, n_predict=None)
    row = next(r for r in rows if r["mode"] == "head" and r["k"] == 3 and r["p_min"] == 0.0)
    assert row["tokens_per_s"] == pytest.approx(6 / (2 * 20.0 + 4 * 3.0) * 1e3)  # two steps of 3 drafts
    # k=2, p_min=0.8: two steps of 1 draft, each with a call past it, and one that drafted nothing
    row = next(r for r in rows if r["mode"] == "head" and r["k"] == 2 and r["p_min"] == 0.8)
    assert row["tokens_per_s"] == pytest.approx(6 / (12.0 + 2 * 20.0 + 2 * 2.0) * 1e3)
    assert next(r for r in rows if r["mode"] == "plain")["tokens_per_s"] == pytest.approx(100.0)


def test_a_head_setting_is_chosen_only_when_clearly_faster_and_ngram_modes_never():
    rows = [
        {"mode": "plain", "threads": 2, "tokens_per_s": 100.0},
        {"mode": "plain", "threads": 1, "tokens_per_s": 60.0},
        {"mode": "ngram-mod", "threads": 2, "tokens_per_s": 104.0},
    ]
    rows.append({"mode": "head", "threads": 1, "k": 2, "p_min": 0.0, "tokens_per_s": 104.0})
    assert choose(rows) == rows[0]  # 4% faster: within the prediction's tolerance, plain stays
    rows.append({"mode": "ngram-simple", "threads": 2, "tokens_per_s": 150.0})  # listed, never chosen
    assert choose(rows) == rows[0]
    rows.append({"mode": "head", "threads": 1, "k": 2, "p_min": 0.0, "tokens_per_s": 130.0})
    assert choose(rows) == rows[-1]


def test_a_cheap_head_is_chosen_with_its_flags_and_a_bigger_target_is_projected():
    """The same chains: where draft calls are cheap beside a plain token the head wins, and a 10x heavier target
    (its plain token, its share of a step and each verified draft scaled) makes drafting pay more."""
    answers = [[Chain([1, 2, 3], [0.9, 0.9, 0.9], 3)] * 40]
    cheap = costs(plain_ms=10.0, empty_ms=10.5, one_ms=11.0, draft_ms=0.5, stop_call_ms=0.5, share=0.9)
    profile = {"costs": [cheap], "spec_type": "draft-eagle3"}
    profile |= {"target_bytes": 100e6, "head_type": "eagle3", "max_k": 3}
    result = plan_llamacpp(answers, profile, "out/head", True, 64, project_gb=1.0)
    choice = result["choice"]
    assert choice["mode"] == "head" and choice["k"] == 3
    flags = result["config"]["flags"]
    assert flags["-md"] == "out/head/model.gguf" and flags["--spec-type"] == "draft-eagle3"
    assert flags["--spec-draft-n-max"] == 3 and flags["-t"] == 2
    p = result["projection"]
    assert p["scale"] == pytest.approx(10.0) and p["plain_tokens_per_s"] == pytest.approx(10.0)
    gain = choice["tokens_per_s"] / result["predicted_plain_tokens_per_s"]
    assert p["best_head"]["tokens_per_s"] / p["plain_tokens_per_s"] > gain


def test_a_head_that_does_not_pay_leaves_plain_decoding():
    dear = costs(plain_ms=9.0, empty_ms=11.0, one_ms=24.0, draft_ms=6.0, stop_call_ms=0.0)
    profile = {"costs": [dear], "spec_type": "draft-dflash"}
    profile |= {"target_bytes": 1e8, "head_type": "dflash", "max_k": 3}
    result = plan_llamacpp([ANSWER], profile, "EXPORT_DIR", False, 64)
    assert result["choice"]["mode"] == "plain"
    assert result["config"]["flags"] == {"-t": 2, "-tb": 2}
    assert result["best_head"]["tokens_per_s"] < result["predicted_plain_tokens_per_s"]


def test_llamacpp_is_a_registered_engine_with_its_own_costs():
    engine = serve.engine("llamacpp")
    assert engine.measured_costs and engine.chain and engine.formats == ("gguf",)
    assert not serve.engine("vllm").measured_costs
    assert serve.engine("llamacpp").settings({"mode": "ngram-mod", "threads": 1}, "x", "draft-dflash")["flags"] == {
        "-t": 1,
        "-tb": 1,
        "--spec-type": "ngram-mod",
    }


def test_a_cost_profile_missing_its_terms_is_refused_naming_the_file(tmp_path):
    bad = tmp_path / "costs.json"
    bad.write_text(json.dumps({"costs": [{"threads": 2, "plain_ms": 9.0}]}))
    with pytest.raises(InvalidValue, match="costs.json.*profile_llamacpp"):
        read_costs(bad)
    bad.write_text(
        json.dumps({"costs": [], "spec_type": "draft-dflash", "target_bytes": 1, "head_type": "dflash", "max_k": 3})
    )
    with pytest.raises(InvalidValue, match="no thread count"):
        read_costs(bad)


def test_plan_cli_for_llamacpp_needs_the_engines_costs(tmp_path, capsys):
    from eagletree.cli import main

    rc = main(["plan", "--engine", "llamacpp", "--head", "none", "-o", str(tmp_path / "p.json")])
    assert rc != 0
    assert "profile_llamacpp.py" in capsys.readouterr().err

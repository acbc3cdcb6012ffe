"""`eagletree plan`: acceptance by depth and rank, the static tree under a latency profile, engine settings."""

import itertools
import json
import math

import pytest
import torch

from eagletree.draft import EagleHead
from eagletree.plan import Acceptance, best_plan, engine_config, load_profile, measure_acceptance
from eagletree.search import LatencyProfile, sequoia_tree

from helpers import tiny_model, tiny_tokenizer


def brute_force_by_depth(rows, budget, depth):
    """Best value over static shapes of <= budget nodes (ranks without gaps), a child at depth d accepting rows[d-1]."""
    k = len(rows[0])
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    best = 1.0
    for size in range(1, budget):
        for sub in itertools.combinations(paths, size):
            nodes = set(sub)
            if any(len(p) > 1 and p[:-1] not in nodes for p in nodes):
                continue
            if any(p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in nodes for p in nodes):
                continue
            best = max(best, 1.0 + sum(math.prod(rows[i][r] for i, r in enumerate(p)) for p in nodes))
    return best


def test_sequoia_with_acceptance_by_depth_equals_brute_force():
    g = torch.Generator().manual_seed(3)
    for _ in range(12):
        depth, k = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 3, (1,), generator=g))
        rows = torch.rand(depth, k, generator=g).tolist()
        budget = int(torch.randint(2, 7, (1,), generator=g))
        shape = sequoia_tree(rows, budget, depth)
        assert shape.expected_tokens == pytest.approx(brute_force_by_depth(rows, budget, depth), abs=1e-12)
        depth_of = [0] * len(shape.parents)
        value = [1.0]  # the shape's value recomputed from its own ranks and depths
        for i in range(1, len(shape.parents)):
            depth_of[i] = depth_of[shape.parents[i]] + 1
            value.append(value[shape.parents[i]] * rows[depth_of[i] - 1][shape.ranks[i]])
        assert sum(value) == pytest.approx(shape.expected_tokens, abs=1e-12)
    # one row is every depth's row (the per-rank form generate has always taken)
    assert sequoia_tree([0.6, 0.2], 10, 3).parents == sequoia_tree([[0.6, 0.2]] * 3, 10, 3).parents


def test_depth_one_acceptance_equals_the_heads_ranks_over_the_answer():
    from eagletree.decode import generate

    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config, torch.arange(0, 97, 2)).eval()
    prompts = [torch.tensor([5, 9, 11, 3]), torch.tensor([7, 2, 40])]
    table = measure_acceptance(model, tok, head, prompts, max_new_tokens=10, depth=3, top_k=4)
    # Reference for depth 1: the head over the whole sequence at once (teacher forcing), ranks of the true tokens.
    hits, total = [0] * 4, 0
    with torch.no_grad():
        for ids in prompts:
            answer = generate(model, tok, head, ids, tree="eagle2", budget=60, max_new_tokens=10).token_ids
            seq = torch.cat([ids, torch.tensor(answer)])
            out = model(seq[None, :-1], output_hidden_states=True)
            feats = out.hidden_states[-1][0]
            pred = head(feats[None], seq[None, 1:], torch.arange(seq.numel() - 1), model.get_input_embeddings())[0]
            logits = pred @ model.get_output_embeddings().weight[head.d2t].T
            for t in range(ids.numel() - 1, seq.numel() - 1):  # predicts seq[t + 1], an answer token
                true = int(seq[t + 1])
                total += 1
                if true % 2:
                    continue  # outside the draft vocabulary: never drafted
                rank = int((logits[t - 1] > logits[t - 1, true // 2]).sum())
                if rank < 4:
                    hits[rank] += 1
    assert table.reached[0] == total == table.positions > 10
    assert table.accept[0] == pytest.approx([h / total for h in hits])
    assert [table.paths.get(str(r), 0) for r in range(4)] == hits  # depth-1 paths are the same counts
    for key, count in table.paths.items():  # a path's count never exceeds its parent's, nor its children's sum
        assert "," not in key or count <= table.paths[key.rsplit(",", 1)[0]]
        assert sum(v for k, v in table.paths.items() if "," in k and k.rsplit(",", 1)[0] == key) <= count


def table(paths, positions=100):
    return Acceptance({",".join(map(str, p)): c for p, c in paths.items()}, positions, [[0.0]], [positions], 3, 4)


ACCEPT = table(
    {
        (0,): 60,
        (1,): 15,
        (2,): 5,
        (0, 0): 40,
        (0, 1): 8,
        (1, 0): 9,
        (0, 0, 0): 25,
        (0, 0, 1): 6,
        (1, 0, 0): 4,
        (0, 1, 0): 3,
    }
)


def brute_force_plan(acceptance, profile, max_nodes, max_depth, chain=False):
    """Best rate over every connected set of measured paths (the empty tree excluded)."""
    paths = [tuple(int(r) for r in k.split(",")) for k in acceptance.paths]
    paths = [p for p in paths if not chain or not any(p)]
    best = 0.0
    for size in range(1, max_nodes):
        for sub in itertools.combinations(paths, size):
            if any(len(p) > 1 and p[:-1] not in sub for p in sub) or max(map(len, sub)) > max_depth:
                continue
            expected = 1 + sum(acceptance.frequency(p) for p in sub)
            best = max(best, expected / float(profile.step_time(size + 1, max(map(len, sub)))))
    return best


def test_plan_refuses_a_head_the_engine_loads_no_export_of():
    from eagletree.draft import MedusaHead
    from eagletree.plan import PlanOptions, make_plan

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = MedusaHead.for_target(model.config, num_heads=3).eval()
    profile = LatencyProfile([1, 64], [0.010, 0.012], draft_s_per_level=0.0005)
    with pytest.raises(ValueError, match="none of which takes 'medusa' heads"):
        make_plan(model, tok, head, profile, [torch.tensor([5, 9])], [], PlanOptions("vllm", "o", max_new_tokens=4))


def test_a_block_heads_plan_is_measured_as_deep_as_its_block_and_served_as_vllms_dflash():
    """A block head's levels read its block's positions whatever the parent: the rank paths are as valid, the plan's
    prediction is again what `generate` measures with its static tree, and vLLM gets method "dflash"."""
    from eagletree.draft import DFlashHead
    from eagletree.plan import PlanOptions, make_plan

    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = DFlashHead.for_target(model, block_size=4).eval()
    prompts = [torch.tensor([5, 9, 11, 3]), torch.tensor([7, 2, 40, 8, 8])]
    profile = LatencyProfile([1, 64], [0.010, 0.012], draft_s_per_level=0.0, draft_s_per_step=0.001)
    options = PlanOptions("vllm", "o", max_new_tokens=16, max_nodes=8, max_depth=8)
    result = make_plan(model, tok, head, profile, prompts, prompts, options)
    assert len(result["acceptance"]["accept"]) == 3  # the block's 3 drafted positions, not max_depth
    check = result["check"]
    assert check["measured_tokens_per_pass"] == pytest.approx(check["predicted_tokens_per_pass"], abs=1e-9)
    assert result["export_format"] == "dflash" and result["config"]["speculative_config"]["method"] == "dflash"


def test_best_plan_maximizes_tokens_per_second_and_vllm_gets_a_chain():
    flat = LatencyProfile([1, 64], [0.010, 0.0101], draft_s_per_level=0.0)  # verifying is free: the largest tree
    plan = best_plan(ACCEPT, flat, "sglang", max_nodes=12, max_depth=3)
    assert plan.nodes == 11 and plan.depth == 3 and plan.width == 3
    assert plan.expected_tokens == pytest.approx(1 + sum(ACCEPT.paths.values()) / 100)
    steep = LatencyProfile([1, 2, 64], [0.010, 0.030, 0.700], draft_s_per_level=0.0)  # any drafted node costs 3x
    assert best_plan(ACCEPT, steep, "sglang", 12, 3).nodes == 2
    mid = LatencyProfile([1, 4, 64], [0.010, 0.0105, 0.060], draft_s_per_level=0.0008)
    for engine in ("sglang", "eagle", "vllm"):
        for nodes, depth in ((12, 3), (5, 2), (3, 3)):
            plan = best_plan(ACCEPT, mid, engine, nodes, depth)
            want = brute_force_plan(ACCEPT, mid, nodes, depth, chain=engine == "vllm")
            assert plan.tokens_per_s == pytest.approx(want) and plan.nodes <= nodes and plan.depth <= depth
            assert all(p[:-1] == [] or p[:-1] in plan.paths for p in plan.paths)  # connected
    chain = best_plan(ACCEPT, flat, "vllm", 12, 3)
    assert chain.width == 1 and chain.paths == [[0], [0, 0], [0, 0, 0]]
    # ranks with a gap (0, 1, 3): an engine drafting at top-k 3 never proposes the rank-3 node; it needs top-k 4
    gapped = best_plan(table({(0,): 50, (1,): 20, (3,): 15}, 100), flat, "sglang", 4, 1)
    assert gapped.paths == [[0], [1], [3]] and gapped.width == 4
    assert engine_config(gapped, "out", False, False)["flags"]["--speculative-eagle-topk"] == 4
    # three nodes of level 2 with children, every rank <= 1: top-k 2 would expand only two of them
    bushy = best_plan(
        table(
            {(0,): 60, (1,): 40, (0, 0): 30, (0, 1): 25, (1, 0): 30, (0, 0, 0): 20, (0, 1, 0): 20, (1, 0, 0): 20}, 100
        ),
        flat,
        "sglang",
        9,
        3,
    )
    assert len(bushy.paths) == 8 and max(max(p) for p in bushy.paths) == 1 and bushy.width == 3
    assert chain.expected_tokens == pytest.approx(1 + 0.60 + 0.40 + 0.25)


def test_the_summary_warns_when_the_best_tree_loses_to_plain_decoding():
    from eagletree.plan import summary

    def result(rate, plain, positions=1500):
        return {
            "engine": "sglang",
            "config": {},
            "tree": {"nodes": 2, "depth": 1, "width": 1, "paths": [[0]]},
            "expected_tokens_per_pass": 1.6,
            "decoded_tokens_per_pass": None,
            "predicted_tokens_per_s": rate,
            "predicted_plain_tokens_per_s": plain,
            "check": None,
            "acceptance": {"positions": positions},
        }

    steep = LatencyProfile([1, 2, 64], [0.010, 0.030, 0.700], draft_s_per_level=0.0)  # a drafted node costs 3x
    plan = best_plan(ACCEPT, steep, "sglang", 12, 3)
    assert plan.tokens_per_s < plan.plain_tokens_per_s
    text = summary(result(plan.tokens_per_s, plan.plain_tokens_per_s))
    assert "warning: under this profile even the best tree is predicted 46.7% slower than plain decoding" in text
    assert "warning" not in summary(result(120.0, 100.0))
    few = summary(result(120.0, 100.0, positions=185))  # (8 held-out prompts x 48 tokens: the old default)
    assert "warning: the acceptance was measured on 185 answer positions; below 1000" in few


def test_decoding_the_measured_answers_with_a_tree():
    acceptance = Acceptance({}, 5, [[0.0]], [5], 2, 1, rank_paths=[[[0, 0], [1], [], [0], [0, 1]]])
    # position 0: (0,) and (0, 0) in the tree -> 3 tokens; position 3: (0,) -> 2 tokens (the answer ends there)
    assert acceptance.decoded_tokens_per_pass({(0,), (0, 0)}) == pytest.approx(5 / 2)
    assert acceptance.decoded_tokens_per_pass({(1,)}) == pytest.approx(5 / 4)  # position 1 starts a pass: 2 tokens


def test_the_plans_prediction_is_what_generate_measures_on_the_same_prompts():
    from eagletree.plan import PlanOptions, make_plan

    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config, torch.arange(60)).eval()
    prompts = [torch.tensor([5, 9, 11, 3]), torch.tensor([7, 2, 40, 8, 8])]
    profile = LatencyProfile([1, 64], [0.010, 0.012], draft_s_per_level=0.0005)
    options = PlanOptions("eagle", "o", max_new_tokens=16, max_nodes=8, max_depth=3)
    result = make_plan(model, tok, head, profile, prompts, prompts, options)
    check = result["check"]
    assert check["predicted_tokens_per_pass"] == result["decoded_tokens_per_pass"]
    assert check["measured_tokens_per_pass"] == pytest.approx(check["predicted_tokens_per_pass"], abs=1e-9)


def test_engine_settings_follow_each_engines_conventions():
    acceptance, profile = ACCEPT, LatencyProfile([1, 64], [0.010, 0.0101])
    vllm = engine_config(best_plan(acceptance, profile, "vllm", 8, 2), "out/v", eagle3=False, draft_vocab=True)
    # vLLM 0.33 SpeculativeConfig: method, model, num_speculative_tokens (no token tree; unknown keys are refused)
    assert vllm == {"speculative_config": {"method": "eagle", "model": "out/v", "num_speculative_tokens": 2}}
    plan = best_plan(acceptance, profile, "sglang", 8, 2)
    sglang = engine_config(plan, "out/s", eagle3=False, draft_vocab=True)["flags"]
    assert sglang["--speculative-num-steps"] == plan.depth and sglang["--speculative-eagle-topk"] == plan.width
    assert sglang["--speculative-num-draft-tokens"] == plan.nodes  # SGLang counts the root (steps + 1 for a chain)
    assert sglang["--speculative-token-map"].endswith("token_map.pt")
    assert "--speculative-token-map" not in engine_config(plan, "o", eagle3=True, draft_vocab=True)["flags"]
    eagle = engine_config(best_plan(acceptance, profile, "eagle", 8, 2), "o", False, False)
    assert eagle == {"total_token": plan.nodes, "depth": plan.depth - 1, "top_k": plan.width}


def test_a_bench_profile_file_is_read(tmp_path):
    rows = [
        {"n": 1, "forward_ms": 10.0, "engine_ms": 1.0, "search_ms": 0.0, "draft_level_ms": 0.0},
        {"n": 16, "forward_ms": 12.0, "engine_ms": 2.0, "search_ms": 0.6, "draft_level_ms": 0.5},
    ]
    (tmp_path / "profile.json").write_text(
        json.dumps({"device": "cuda", "config": "llama-3.1-8b", "depth": 6, "rows": rows})
    )
    profile = load_profile(tmp_path / "profile.json")
    assert profile.sizes == [1, 16] and profile.verify_s == pytest.approx([0.011, 0.0134])
    assert profile.draft_s_per_level == pytest.approx(0.0005) and profile.search_s_per_level == pytest.approx(0.0001)
    assert profile.draft_s_per_step == 0.0  # a profile.json from before the head's catch-up was timed
    rows[1]["catch_up_ms"] = 0.4
    (tmp_path / "profile.json").write_text(json.dumps({"depth": 6, "rows": rows}))
    assert load_profile(tmp_path / "profile.json").draft_s_per_step == pytest.approx(0.0004)
    (tmp_path / "bad.json").write_text(json.dumps({"rows": [{"n": 1}]}))
    with pytest.raises(ValueError, match="bench profile rows need"):
        load_profile(tmp_path / "bad.json")
    for data, message in (
        (
            {"engine": "sglang", "tree": {}},
            "is not a latency profile: expected a JSON object of sizes, verify_s, .* got keys engine, tree",
        ),  # a plan
        ([1, 2], "is not a latency profile: .* got list"),
        ({"sizes": [8, 1], "verify_s": [0.02, 0.01]}, "profile.json': profile sizes must be"),
    ):
        (tmp_path / "profile.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            load_profile(tmp_path / "profile.json")


def test_plan_cli_writes_the_engine_settings_and_checks_the_tree(tmp_path, monkeypatch, capsys):
    from eagletree.cli import main

    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    EagleHead.for_target(model.config, torch.arange(60)).save_pretrained(tmp_path / "head")
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    LatencyProfile([1, 64], [0.010, 0.012], draft_s_per_level=0.0005).save(tmp_path / "profile.json")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(p)
            for p in ["hello how are you", "what is two plus four", "why is the sky blue", "tell me a joke"]
        )
    )
    args = [
        "plan",
        "--target",
        "tiny",
        "--head",
        str(tmp_path / "head"),
        "--engine",
        "sglang",
        "--profile",
        str(tmp_path / "profile.json"),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--max-nodes",
        "10",
        "--max-depth",
        "3",
        "--export",
        str(tmp_path / "sg"),
        "-o",
        str(tmp_path / "plan.json"),
    ]
    # an --export that is not an export folder is refused before the model loads (it is named in the settings)
    assert main(args) == 2 and f"--export '{tmp_path / 'sg'}': no such folder" in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()
    head_dir = str(tmp_path / "head")
    assert (
        main(["export", "--head", head_dir, "--format", "sglang", "--out", str(tmp_path / "sg"), "--dtype", "fp32"])
        == 0
    )
    code = main(args)
    result = json.loads((tmp_path / "plan.json").read_text())
    check = result["check"]
    assert code == (0 if check["within_tolerance"] else 1)
    assert check["prompts"] == 2 and check["passes"] >= 1 and check["new_tokens"] == 24
    assert check["measured_tokens_per_pass"] == pytest.approx(check["new_tokens"] / check["passes"])
    assert result["config"]["flags"]["--speculative-num-draft-tokens"] == result["tree"]["nodes"]
    out = capsys.readouterr().out
    assert "measured" in out and "predicted" in out and "--speculative-eagle-topk" in out
    paths = result["tree"]["paths"]
    assert len(paths) + 1 == result["tree"]["nodes"] and all(p[:-1] == [] or p[:-1] in paths for p in paths)
    # reusing the acceptance decodes only the check prompts
    assert main(args[:-2] + ["-o", str(tmp_path / "again.json"), "--acceptance", str(tmp_path / "plan.json")]) == code
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["tree"] == result["tree"] and again["check"] == check
    # the plan records the vocabulary its acceptance was measured over; reusing it over another one is refused
    assert result["draft_vocab_size"] == 60
    capsys.readouterr()
    assert (
        main(
            args[:-2]
            + ["-o", str(tmp_path / "wide.json"), "--acceptance", str(tmp_path / "plan.json"), "--draft-vocab", "full"]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "measured drafting over 60 tokens, but the head drafts over 97 here; pass --draft-vocab head" in err
    assert not (tmp_path / "wide.json").exists()
    # SGLang's acceptance (the head's 60 tokens) for vLLM, which drafts the export over all 97: no --draft-vocab
    # makes it right (the hint said --draft-vocab head)
    vllm = [a if a != "sglang" else "vllm" for a in args[:-2]]
    assert main(vllm + ["-o", str(tmp_path / "v.json"), "--acceptance", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "(the head's draft vocabulary), but vllm drafts this head over all 97: measure anew" in err
    assert main(args[:-2] + ["--acceptance", str(tmp_path / "profile.json")]) == 2  # the wrong file
    assert "profile.json': an acceptance table needs paths, positions" in capsys.readouterr().err
    (tmp_path / "list.json").write_text("[1, 2]")
    assert main(args[:-2] + ["--acceptance", str(tmp_path / "list.json")]) == 2
    assert "expected a plan's JSON object, got list" in capsys.readouterr().err


@pytest.mark.real
def test_real_plan_predicts_the_static_trees_tokens_per_pass(smollm2):
    """On the shipped head: the plan's tree decoded by `generate` gives the predicted tokens/pass (same prompts,
    so only the estimator is checked, not prompt-to-prompt noise)."""
    from eagletree.bench import load_prompts
    from eagletree.draft import load_head
    from eagletree.loading import SHIPPED_HEADS
    from eagletree.plan import PlanOptions, make_plan

    model, tok = smollm2
    head = load_head(SHIPPED_HEADS["smollm2-135m"], target_config=model.config)
    prompts = load_prompts("mtbench:2")
    profile = LatencyProfile([1, 8, 64], [0.040, 0.047, 0.150], draft_s_per_level=0.003)
    options = PlanOptions("sglang", "out/sg", max_new_tokens=24, max_nodes=16, max_depth=5)
    result = make_plan(model, tok, head, profile, prompts, prompts, options)
    check = result["check"]
    assert check["prompts"] == 2 and check["new_tokens"] > 0
    assert check["measured_tokens_per_pass"] > 1.5  # the head drafts something
    assert abs(check["relative_error"]) <= 0.05, check  # the same passes, but for a flipped float near-tie

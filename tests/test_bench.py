"""`eagletree bench` on tiny random models: output structure, mismatch detection, input errors (never timings)."""

import json
import subprocess
import sys
import warnings

import pytest
import torch

from eagletree import bench
from eagletree.cli import main as cli_main
from eagletree.draft import EagleHead
from eagletree.loading import SHIPPED_HEADS, head_to_load
from eagletree.verify import DraftTree

from helpers import tiny_config, tiny_model, tiny_tokenizer

PROMPTS = [
    [{"role": "user", "content": "hello how are you"}],
    [{"role": "system", "content": "fine thanks"}, {"role": "user", "content": "what is two plus four"}],
]


@pytest.fixture(scope="module")
def tiny_setup():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    return model, tok, EagleHead.for_target(model.config).eval()


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))  # auto's latency profile lands here


def test_every_method_runs_and_the_outputs_are_written(tiny_setup, tmp_path):
    model, tok, head = tiny_setup
    methods = bench.method_grid(list(bench.METHODS), [3, 8], depth=3, top_k=3)
    report = bench.run_bench(
        model, tok, head, PROMPTS, methods, bench.BenchSettings((0.0, 1.0), max_new_tokens=10), progress=False
    )
    report.update(
        command="eagletree bench (test)",
        machine=bench.machine_info(model),
        settings={"target": "tiny", "head": "tiny", "prompts": "test", "depth": 3, "top_k_draft": 3},
    )
    out = bench.write_outputs(report, tmp_path / "out")

    for name in (
        "results.json",
        "results.md",
        "tokens_per_pass.png",
        "speedup.png",
        "accepted_lengths.png",
        "calibration.png",
    ):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    assert {"command", "machine", "settings", "results", "calibration", "accept_by_rank"} <= set(data)
    labels = [m.label for m in methods]
    assert labels == [
        "chain 3",
        "chain 4",
        "sequoia 3",
        "sequoia 8",
        "eagle2 3",
        "eagle2 8",
        "optimal 3",
        "optimal 8",
        "auto 3",
        "auto 8",
        "eagle2+copy 3",
        "eagle2+copy 8",
        "optimal+copy 3",
        "optimal+copy 8",
        "auto+copy 3",
        "auto+copy 8",
        "copy 3",
        "copy 8",
        "lookup",
        "packed",
    ]
    assert [r["label"] for r in data["results"]] == (["plain"] + labels) * 2
    for r in data["results"]:
        assert {
            "tokens_per_pass",
            "predicted_tokens_per_pass",
            "tokens_per_s",
            "speedup",
            "identical",
            "accepted_histogram",
        } <= set(r)
        assert len(r["speedup"]["per_prompt"]) == len(PROMPTS)
        assert r["identical"] is (True if r["temperature"] == 0 else None), r["label"]  # lossless at T=0
        assert sum(r["accepted_histogram"].values()) == r["passes"] and r["tokens_per_pass"] >= 1.0
        if r["method"] in bench.TREE_METHODS:
            assert r["predicted_tokens_per_pass"] >= 1.0
    plain = data["results"][0]
    assert plain["speedup"]["median"] == 1.0 and plain["tokens_per_pass"] == pytest.approx(1.0)
    assert data["calibration"]["nodes"] > 0 and data["calibration"]["bins"]

    md = (out / "results.md").read_text()
    assert md.count("| method | budget |") == 2 and "## Temperature 0 (greedy)" in md
    assert md.count("\n| eagle2 | 8 |") == 2 and "| plain | - | 1.00 |" in md and "NO" not in md
    assert "Plots: [tokens_per_pass.png](tokens_per_pass.png), [speedup.png](speedup.png)" in md  # linked once written


def test_a_wrong_output_is_reported_as_a_mismatch(tiny_setup, monkeypatch):
    model, tok, head = tiny_setup
    honest = bench.runners.run_tree

    def wrong(*args, **kwargs):
        run = honest(*args, **kwargs)
        run.token_ids[2] = (run.token_ids[2] + 1) % 97
        return run

    monkeypatch.setattr(bench.runners, "run_tree", wrong)  # where run_bench looks it up
    messages = []
    report = bench.run_bench(
        model,
        tok,
        head,
        PROMPTS[:1],
        bench.method_grid(["eagle2"], [4], 3, 3),
        bench.BenchSettings((0.0,), max_new_tokens=6),
        progress=False,
        log=messages.append,
    )
    row = next(r for r in report["results"] if r["method"] == "eagle2")
    assert row["identical"] is False
    miss = row["mismatches"][0]
    assert miss["prompt"] == 0 and miss["position"] == 2 and miss["logit_gap"] > 0  # plain's token is the argmax
    assert any("MISMATCH eagle2 4 on prompt 0: first difference at token 2" in m and "logit gap" in m for m in messages)
    assert "NO (1)" in bench.markdown_table(report, 0.0)


def test_batched_bench_decodes_the_prompts_in_groups(tiny_setup, tmp_path):
    model, tok, head = tiny_setup
    prompts = PROMPTS + [[{"role": "user", "content": "tell me a joke"}]]
    methods = bench.method_grid(["chain", "sequoia", "eagle2", "auto+copy", "copy", "packed"], [4], depth=3, top_k=3)
    report = bench.run_bench(
        model,
        tok,
        head,
        prompts,
        methods,
        bench.BenchSettings((0.0, 1.0), max_new_tokens=8, batch_size=2),
        progress=False,
    )
    assert report["batch_size"] == 2 and report["prompts"] == 3
    greedy = [r for r in report["results"] if r["temperature"] == 0]
    assert [r["label"] for r in greedy] == [
        "plain",
        "chain 4",
        "sequoia 4",
        "eagle2 4",
        "auto+copy 4",
        "copy 4",
        "packed",
    ]
    for r in report["results"]:
        assert len(r["speedup"]["per_prompt"]) == 2, r["label"]  # one throughput ratio per group of 2 prompts
        assert r["tokens_per_pass"] >= 1.0 and sum(r["accepted_histogram"].values()) == r["passes"]
        assert r["identical"] is (True if r["temperature"] == 0 else None), (r["label"], r["mismatches"])
    # lossless: every greedy row emits plain decoding's tokens, so the same count
    assert len({r["new_tokens"] for r in greedy}) == 1
    report.update(
        command="eagletree bench (test)",
        machine=bench.machine_info(model),
        settings={"target": "tiny", "head": "tiny", "prompts": "test", "depth": 3, "top_k_draft": 3},
    )
    md = (bench.write_outputs(report, tmp_path / "out") / "results.md").read_text()
    assert "Batches of 2 prompts: every row decodes the prompts 2 at a time" in md
    with pytest.raises(ValueError, match="method 'lookup' .* decodes one sequence at a time"):
        bench.run_bench(
            model, tok, head, prompts, bench.method_grid(["lookup"], [4]), bench.BenchSettings((0.0,), 4, batch_size=2)
        )


def _bench_cli(tiny_setup, tmp_path, monkeypatch) -> list[str]:
    """`eagletree bench` on the tiny target and head (saved, loaded as the CLI loads them) over three prompts."""
    model, tok, head = tiny_setup
    head.save_pretrained(tmp_path / "head")
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    (tmp_path / "p.jsonl").write_text('"hello how are you"\n"tell me a joke"\n"why is the sky blue"\n')
    return ["bench", "--target", "tiny", "--head", str(tmp_path / "head"), "--prompts", str(tmp_path / "p.jsonl")]


def test_batched_bench_from_the_command_line(tiny_setup, tmp_path, monkeypatch, capsys):
    argv = _bench_cli(tiny_setup, tmp_path, monkeypatch)
    argv += ["--budgets", "4", "--temperatures", "0", "--max-new-tokens", "6", "--pack", "off", "--batch-size", "2"]
    assert cli_main([*argv, "--methods", "eagle2,copy", "-o", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["batch_size"] == data["settings"]["batch_size"] == 2
    assert [r["label"] for r in data["results"]] == ["plain", "eagle2 4", "copy 4"] and all(
        r["identical"] for r in data["results"]
    )
    assert "Batches of 2 prompts" in capsys.readouterr().out
    monkeypatch.setattr("eagletree.target.load_target", lambda *a, **k: pytest.fail("loaded"))
    assert cli_main([*argv, "--methods", "eagle2,lookup", "-o", str(tmp_path / "x")]) == 2
    assert "--methods lookup: HF prompt lookup decodes one sequence at a time" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main([*argv[:-1], "0"])
    assert "--batch-size: must be an integer >= 1, got '0'" in capsys.readouterr().err
    # the default methods: HF prompt lookup only where prompts are decoded one at a time
    from eagletree.bench.command import _methods
    from eagletree.cli import build_parser

    for size, lookup in (("1", True), ("2", False)):
        args = build_parser().parse_args(["bench", "--batch-size", size])
        assert any(m.name == "lookup" for m in _methods(args, [8])) is lookup


def test_first_difference_counts_length():
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert bench.first_difference([1, 2], [1, 2, 3]) == 2


def test_method_grid_and_its_errors():
    grid = bench.method_grid(["chain", "eagle2"], [8, 16], depth=6, top_k=10)
    assert [(m.label, m.depth) for m in grid] == [("chain 7", 6), ("eagle2 8", 6), ("eagle2 16", 6)]
    assert bench.method_grid(["chain"], [4], depth=6)[0].depth == 3  # width-1 tree of 4 nodes
    with pytest.raises(ValueError, match="unknown method 'bushy'; expected some of chain"):
        bench.method_grid(["eagle2", "bushy"], [8])
    with pytest.raises(ValueError, match="budgets must be integers >= 2.*got 0"):
        bench.method_grid(["eagle2"], [8, 0])
    with pytest.raises(ValueError, match="--budgets: 'x' is not an integer"):
        bench.parse_list("8,x", int, "budgets")


def test_prompt_specs_and_jsonl(tmp_path):
    with pytest.raises(ValueError, match="'heldout:abc': expected heldout:N"):
        bench.load_prompts("heldout:abc")
    with pytest.raises(ValueError, match="no such file"):
        bench.load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="expected mtbench\\[:N\\], humaneval\\[:N\\], heldout:N or a .jsonl file"):
        bench.load_prompts("prompts.txt")
    with pytest.raises(ValueError, match="'mtbench:0': expected mtbench or mtbench:N"):
        bench.load_prompts("mtbench:0")
    path = tmp_path / "p.jsonl"
    path.write_text('"hello"\n{"prompt": "how are you"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert bench.load_prompts(str(path)) == [
        [{"role": "user", "content": "hello"}],
        [{"role": "user", "content": "how are you"}],
        [{"role": "user", "content": "hi"}],
    ]
    path.write_text('"hello"\n{"text": 3}\n')
    with pytest.raises(ValueError, match="line 2: expected a string"):
        bench.load_prompts(str(path))
    for messages, message in (
        (
            [{"role": "user"}],
            'line 1: message 0: expected {"role": system|developer|user|assistant|tool|ipython, "content": str or a '
            'list of parts}, got {"role": "user"}',
        ),
        ([{"role": "user", "content": 3}], 'got {"role": "user", "content": 3}'),
        ([{"role": "bot", "content": "hi"}], 'got {"role": "bot"'),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "line 1: message 1: the messages must end with the user's turn (or a tool's result) to answer, not the "
            "assistant's",
        ),
    ):
        path.write_text(json.dumps({"messages": messages}) + "\n")
        with pytest.raises(ValueError) as e:  # (a jinja traceback after loading the target, before)
            bench.load_prompts(str(path))
        assert message in str(e.value)


def test_cli_errors_name_the_bad_value(capsys):
    assert cli_main(["bench", "--prompts", "heldout:abc"]) == 2
    assert "heldout:abc" in capsys.readouterr().err
    assert cli_main(["bench", "--methods", "eagle2,bushy", "--prompts", "heldout:1"]) == 2
    assert "unknown method 'bushy'" in capsys.readouterr().err
    assert cli_main(["bench", "--budgets", "16,-1", "--prompts", "heldout:1"]) == 2
    assert "got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: a required flag
        cli_main(["profile"])
    assert "the following arguments are required: --config" in capsys.readouterr().err
    assert cli_main(["profile", "--config", "llama-9000"]) == 2
    assert "'llama-9000' is neither a built-in config (llama-3.1-8b)" in capsys.readouterr().err
    # the two commands' flags are their own: one the command does not read is refused by argparse, not ignored
    for argv, flag in (
        (["bench", "--sizes", "1,2"], "--sizes"),
        (["profile", "--config", "llama-3.1-8b", "--budgets", "8"], "--budgets"),
    ):
        with pytest.raises(SystemExit):
            cli_main(argv)
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err
    for flags, message in (
        (["--tokens-per-pass", "nan"], "--tokens-per-pass must be a finite number >= 1"),
        (["--results", "no/such.json"], "--results 'no/such.json' does not exist"),
    ):
        assert cli_main(["profile", "--config", "llama-3.1-8b", *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags


@pytest.mark.parametrize(
    "command, flags, message",
    [
        ("profile", ["--config", "llama-3.1-8b", "--depth", "0"], "--depth: must be an integer >= 1, got '0'"),
        ("profile", ["--config", "llama-3.1-8b", "--prefix", "-1"], "--prefix: must be an integer >= 1, got '-1'"),
        ("profile", ["--config", "llama-3.1-8b", "--reps", "0"], "--reps: must be an integer >= 1, got '0'"),
        ("bench", ["--lookup-tokens", "0"], "--lookup-tokens: must be an integer >= 1, got '0'"),
        ("bench", ["--seed", "-1"], "--seed: must be an integer >= 0, got '-1'"),
        ("bench", ["--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1, got '0'"),
        ("plan", ["--engine", "vllm", "--max-nodes", "1"], "--max-nodes: must be an integer >= 2, got '1'"),
        ("plan", ["--engine", "vllm", "--max-depth", "0"], "--max-depth: must be an integer >= 1, got '0'"),
        ("plan", ["--engine", "vllm", "--top-k-draft", "0"], "--top-k-draft: must be an integer >= 1, got '0'"),
        ("distill", ["--out", "x.jsonl", "--limit", "-1"], "--limit: must be an integer >= 0, got '-1'"),
        ("distill", ["--out", "x.jsonl", "--batch-size", "0"], "--batch-size: must be an integer >= 1, got '0'"),
        (
            "distill",
            ["--out", "x.jsonl", "--max-new-tokens", "2.5"],
            "--max-new-tokens: must be an integer >= 1, got '2.5'",
        ),
        ("features", ["--config", "c.yaml", "--shard-size", "0"], "--shard-size: must be an integer >= 1, got '0'"),
        ("viz", ["--prompt", "hi", "--step", "0"], "--step: must be an integer >= 1, got '0'"),
    ],
)
def test_counts_out_of_range_are_refused_before_loading(command, flags, message, capsys):
    with pytest.raises(SystemExit) as e:  # (--depth 0 looped forever; the others failed after loading)
        cli_main([command, *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_runs_end_to_end_on_a_jsonl_file(tiny_setup, tmp_path, monkeypatch, capsys):
    model, tok, head = tiny_setup
    head.save_pretrained(tmp_path / "head")
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    (tmp_path / "p.jsonl").write_text('"hello how are you"\n"tell me a joke"\n')
    out = tmp_path / "out"
    assert (
        cli_main(
            [
                "bench",
                "--target",
                "tiny",
                "--head",
                str(tmp_path / "head"),
                "--prompts",
                str(tmp_path / "p.jsonl"),
                "--methods",
                "eagle2,sequoia,lookup",
                "--budgets",
                "4",
                "--temperatures",
                "0",
                "--max-new-tokens",
                "6",
                "-o",
                str(out),
                "--pack",
                "off",
            ]
        )
        == 0
    )
    data = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in data["results"]] == ["plain", "eagle2 4", "sequoia 4", "lookup"]
    assert data["settings"]["budgets"] == [4] and data["prompts"] == 2
    assert all(r["identical"] for r in data["results"])  # whatever precision --draft-dtype auto picked for the head
    assert data["settings"]["head_dtype"] in ("float32", "bfloat16")
    assert "| sequoia | 4 |" in capsys.readouterr().out


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_target_adds_a_packed_row_and_plain_keeps_the_stock_kernels(tmp_path, monkeypatch, capsys):
    from eagletree.packing import PackedLinear

    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    EagleHead.for_target(model.config).save_pretrained(tmp_path / "head")
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    kernels = []  # per HF generate call: were the packed kernels on?
    real_run_hf = bench.runners.run_hf

    def spy(model_, *args, **kwargs):
        kernels.append(all(m.enabled for m in model_.modules() if isinstance(m, PackedLinear)))
        return real_run_hf(model_, *args, **kwargs)

    monkeypatch.setattr(bench.runners, "run_hf", spy)
    out = tmp_path / "out"
    (tmp_path / "p.jsonl").write_text('"hello how are you"\n')
    assert (
        cli_main(
            [
                "bench",
                "--target",
                "tiny",
                "--head",
                str(tmp_path / "head"),
                "--prompts",
                str(tmp_path / "p.jsonl"),
                "--methods",
                "eagle2",
                "--budgets",
                "4",
                "--temperatures",
                "0",
                "--max-new-tokens",
                "6",
                "-o",
                str(out),
                "--pack",
                "on",
            ]
        )
        == 0
    )
    data = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in data["results"]] == ["plain", "packed", "eagle2 4"]
    assert all(r["identical"] for r in data["results"]) and data["settings"]["packed"] is True
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    # warm-up (stock, packed), then per prompt: plain with the stock kernels, the packed row with the packed ones.
    assert kernels == [False, True, False, True]
    assert "packed for oneDNN in every row but plain" in (out / "results.md").read_text()
    # Like for like: each tree row's speedup over plain decoding with the same kernels is kept next to the one
    # over stock HF generate; 'packed' over 'plain' is the kernels' own gain.
    tree = data["results"][2]
    assert tree["speedup_same_kernels"]["median"] > 0 and data["results"][0]["speedup_same_kernels"] is None
    assert data["settings"]["kernels"]["kernels"] == "packed"
    assert "speedup vs plain, same kernels" in (out / "results.md").read_text()
    # 'packed' listed after a tree method still runs first: the tree row's same-kernels speedup is against it
    # (it was against stock plain decoding, the kernels' own gain included)
    assert (
        cli_main(
            [
                "bench",
                "--target",
                "tiny",
                "--head",
                str(tmp_path / "head"),
                "--prompts",
                str(tmp_path / "p.jsonl"),
                "--methods",
                "eagle2,packed",
                "--budgets",
                "4",
                "--temperatures",
                "0",
                "--max-new-tokens",
                "6",
                "-o",
                str(tmp_path / "out2"),
                "--pack",
                "on",
            ]
        )
        == 0
    )
    again = json.loads((tmp_path / "out2" / "results.json").read_text())
    assert [r["label"] for r in again["results"]] == ["plain", "packed", "eagle2 4"]
    # +copy rows copy from the head's datastore.npz too (read once for the whole run), unless --datastore none; the
    # settings say which
    from eagletree.search.store import SEPARATOR, TokenStore, vocab_fingerprint

    TokenStore([5, 6, 7, 8, 9, 10, SEPARATOR]).save(tmp_path / "head" / "datastore.npz", vocab_fingerprint(tok))
    stores, real_method = [], bench.runners.run_method
    monkeypatch.setattr(
        bench.runners, "run_method", lambda *a, **kw: stores.append(kw["store"]) or real_method(*a, **kw)
    )
    for flag, want in (([], [5, 6, 7, 8, 9, 10, SEPARATOR]), (["--datastore", "none"], None)):
        assert (
            cli_main(
                [
                    "bench",
                    "--target",
                    "tiny",
                    "--head",
                    str(tmp_path / "head"),
                    "--prompts",
                    str(tmp_path / "p.jsonl"),
                    "--methods",
                    "eagle2+copy",
                    "--budgets",
                    "4",
                    "--temperatures",
                    "0",
                    "--max-new-tokens",
                    "6",
                    "-o",
                    str(tmp_path / "out3"),
                    "--pack",
                    "off",
                    *flag,
                ]
            )
            == 0
        )
        settings = json.loads((tmp_path / "out3" / "results.json").read_text())["settings"]
        assert (
            len(stores) > 1 and len({id(s) for s in stores}) == 1 and (settings["datastore"] is None) == (want is None)
        )
        assert (stores[0] if want is None else stores[0].tokens.tolist()) == want
        stores.clear()
    # a store made for another tokenizer is refused by decoding (a warning), and the settings do not name it
    TokenStore([5, 6, 7, 8, 9, 10, SEPARATOR]).save(tmp_path / "head" / "datastore.npz", "another-tokenizer")
    with pytest.warns(UserWarning, match="made with tokenizer another-tokenizer"):
        assert (
            cli_main(
                [
                    "bench",
                    "--target",
                    "tiny",
                    "--head",
                    str(tmp_path / "head"),
                    "--prompts",
                    str(tmp_path / "p.jsonl"),
                    "--methods",
                    "eagle2+copy",
                    "--budgets",
                    "4",
                    "--temperatures",
                    "0",
                    "--max-new-tokens",
                    "6",
                    "-o",
                    str(tmp_path / "out3"),
                    "--pack",
                    "off",
                ]
            )
            == 0
        )
    assert json.loads((tmp_path / "out3" / "results.json").read_text())["settings"]["datastore"] is None
    # without a copying row the store is not read at all: no warning (the file written again, so that a refusal
    # remembered from above would not hide one), and not named
    TokenStore([5, 6, 7, 8, 9, SEPARATOR]).save(tmp_path / "head" / "datastore.npz", "another-tokenizer")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            cli_main(
                [
                    "bench",
                    "--target",
                    "tiny",
                    "--head",
                    str(tmp_path / "head"),
                    "--prompts",
                    str(tmp_path / "p.jsonl"),
                    "--methods",
                    "eagle2",
                    "--budgets",
                    "4",
                    "--temperatures",
                    "0",
                    "--max-new-tokens",
                    "6",
                    "-o",
                    str(tmp_path / "out4"),
                    "--pack",
                    "off",
                ]
            )
            == 0
        )
    assert json.loads((tmp_path / "out4" / "results.json").read_text())["settings"]["datastore"] is None


def test_rank_acceptance_counts_accepted_sibling_ranks():
    # root -> a (0.6), b (0.3); a -> c (0.9). Pass 1 accepts b (rank 1); pass 2 accepts a then c (rank 0 twice).
    tree = DraftTree([0, 5, 6, 7], [-1, 0, 0, 1], draft_probs=[1.0, 0.6, 0.3, 0.9])
    assert bench.rank_acceptance([(tree, [0, 2]), (tree, [0, 1, 3])], k=3) == [2 / 3, 1 / 3, 0.0]
    assert bench.rank_acceptance([(tree, [0])], k=3) is None  # nothing accepted: use the default


def test_profile_on_cpu_with_a_config_file(tmp_path, capsys):
    tiny_config("llama").to_json_file(tmp_path / "config.json")
    out = tmp_path / "profile"
    assert (
        cli_main(
            [
                "profile",
                "--config",
                str(tmp_path / "config.json"),
                "--device",
                "cpu",
                "--sizes",
                "1,4,8",
                "--reps",
                "1",
                "--prefix",
                "16",
                "--depth",
                "3",
                "--top-k-draft",
                "3",
                "--tokens-per-pass",
                "1.5",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads((out / "profile.json").read_text())
    assert [r["n"] for r in data["rows"]] == [1, 4, 8] and data["rows"][0]["ratio"] == 1.0
    assert data["rows"][0]["draft_ms"] == 0.0 and data["rows"][1]["draft_level_ms"] > 0
    assert [p["budget"] for p in data["projections"]] == [4, 8]
    assert data["projections"][0]["speedup"] == pytest.approx(1.5 / data["rows"][1]["step_over_t1"])
    assert "| N | verify ms | t(N)/t(1) |" in capsys.readouterr().out and (out / "profile.md").is_file()
    assert data["draft_vocab"] == "full"  # auto without a head: no draft vocabulary to copy


def test_profile_drafts_over_the_vocabulary_asked_for(tmp_path):
    from eagletree.bench.profile import profile_draft_vocab, random_model

    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text(json.dumps({"head_type": "eagle", "draft_vocab_size": 33}))
    cpu, cuda, head = torch.device("cpu"), torch.device("cuda"), str(tmp_path / "head")
    assert profile_draft_vocab("head", head, cpu, 97) == 33 and profile_draft_vocab("auto", head, cpu, 97) == 33
    assert profile_draft_vocab("auto", head, cuda, 97) is None and profile_draft_vocab("full", None, cpu, 97) is None
    with pytest.raises(ValueError, match="--draft-vocab full does not read --head"):  # (ignored it silently)
        profile_draft_vocab("full", head, cpu, 97)
    assert profile_draft_vocab("auto", None, cpu, 97) is None
    with pytest.raises(ValueError, match="--draft-vocab head: pass --head DIR"):
        profile_draft_vocab("head", None, cpu, 97)
    (tmp_path / "head" / "config.json").write_text(json.dumps({"draft_vocab_size": 500}))
    with pytest.raises(ValueError, match=r"draft_vocab_size 500 .* expected an integer in 1..97"):
        profile_draft_vocab("head", head, cpu, 97)
    _, narrow = random_model(tiny_config("llama"), "cpu", torch.float32, draft_vocab=33)
    assert narrow.config.draft_vocab_size == 33


def test_a_results_file_that_is_not_a_bench_result_is_named(tmp_path):
    from eagletree.bench.profile import measured_tokens_per_pass

    (tmp_path / "plan.json").write_text('{"engine": "vllm"}')
    with pytest.raises(ValueError, match=r"plan.json: not a bench results.json .*KeyError: 'results'"):
        measured_tokens_per_pass(tmp_path / "plan.json")


def test_projection_from_measured_tokens_per_pass():
    rows = [
        {"n": 1, "forward_ms": 10.0, "engine_ms": 0.0, "draft_level_ms": 0.0, "step_over_t1": 1.0},
        {"n": 8, "forward_ms": 10.0, "engine_ms": 1.0, "draft_level_ms": 1.0, "step_over_t1": 1.0},
        {"n": 16, "forward_ms": 12.0, "engine_ms": 1.0, "draft_level_ms": 1.0, "step_over_t1": 1.0},
    ]
    out = bench.project(
        rows, {("eagle2", 16, 6): 2.6, ("chain", 7, 6): 1.5, ("auto", 16, 6): 9.0, ("eagle2", 60, 6): 3.0}
    )
    assert [(p["method"], p["budget"]) for p in out] == [("eagle2", 16), ("chain", 7)]  # auto and N > 16 left out
    assert out[0]["step_over_t1"] == pytest.approx((12 + 1 + 6) / 10) and out[0]["speedup"] == pytest.approx(2.6 / 1.9)


def test_builtin_config_has_the_written_down_sizes():
    c = bench.build_config("llama-3.1-8b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_key_value_heads, c.intermediate_size, c.vocab_size) == (
        4096,
        32,
        8,
        14336,
        128256,
    )


def test_speedup_spread_skips_prompts_without_a_decoding_rate():
    nan = float("nan")
    s = bench.stats._quantiles([0.5, nan, 1.5])
    assert (s["median"], s["min"], s["max"], s["per_prompt"]) == (1.0, 0.5, 1.5, [0.5, None, 1.5])
    assert bench.stats._quantiles([nan])["median"] is None
    assert bench.Run([1, 2], 1.0, 0.5, [2]).decode_rate != bench.Run([1, 2], 1.0, 0.5, [2]).decode_rate  # NaN
    assert bench.Run([1, 2, 3], 1.0, 0.5, [1, 2]).decode_rate == 4.0


def test_paired_bootstrap_interval_holds_the_pooled_difference():
    new, passes = [10, 12, 9, 14, 11], [5, 6, 5, 6, 5]
    assert bench.ratio_interval(new, passes, new, passes) == (0.0, 0.0)  # a head against itself
    better = [n + 2 for n in new]
    lo, hi = bench.ratio_interval(better, passes, new, passes)
    pooled = (sum(better) / sum(passes)) / (sum(new) / sum(passes)) - 1
    assert 0 < lo <= pooled <= hi
    assert bench.ratio_interval([10], [5], [9], [5]) is None  # one prompt: nothing to resample (was (x, x))
    assert bench.ratio_interval([10, 0], [5, 0], [9, 3], [5, 2]) is None  # a prompt without passes


def test_timed_drafter_records_each_call_and_passes_its_answer_through():
    def expand(nodes, tokens, parents, level):
        return torch.full((len(nodes), 4), 0.25)

    timed = bench.TimedDrafter(expand)
    out = timed(torch.tensor([1, 2]), torch.tensor([5, 6]), torch.tensor([0, 0]), 2)
    timed(torch.tensor([3]), torch.tensor([7]), torch.tensor([1]), 3)
    assert torch.equal(out, torch.full((2, 4), 0.25))
    assert [level for level, _ in timed.calls] == [2, 3] and timed.seconds == sum(s for _, s in timed.calls) >= 0


def test_head_to_load_names_the_shipped_head_or_asks_for_one(tmp_path):
    from eagletree.target import TargetError

    assert head_to_load("smollm2-135m", None) == SHIPPED_HEADS["smollm2-135m"]
    assert head_to_load("smollm2-135m", "none") is None and head_to_load("other", "some/dir") == "some/dir"
    other = str(tmp_path)  # a model folder of the user's: no head is shipped for it
    assert head_to_load(other, None, required=False) is None
    with pytest.raises(ValueError, match=f"no head is shipped for target '{other}'; pass --head DIR"):
        head_to_load(other, None)
    with pytest.raises(TargetError, match=r"target 'smollm2-135' is neither a known alias"):
        head_to_load("smollm2-135", None)  # a typo is named as one, not as a target without a shipped head


def test_the_cli_parses_without_torch_matplotlib_or_transformers():
    code = "import sys, eagletree.cli; print([m for m in ('torch', 'matplotlib', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    # a mistyped flag is answered by the parser, before any command module (and torch) loads
    code = (
        "import sys, eagletree.cli\n"
        "try:\n    eagletree.cli.main(['generate', '--prompt', 'hi', '--tree', 'bushy'])\n"
        "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "2 False" and "invalid choice: 'bushy'" in run.stderr


def test_plain_decoding_ignores_the_models_own_generation_settings(tiny_setup):
    """HF generate fills unset settings from the model's generation_config; plain decoding is compared with
    eagletree's decoding, which applies none of them (a repetition penalty there made every row 'not identical')."""
    from eagletree.decode import generate

    model, tok, head = tiny_setup
    messages = [{"role": "user", "content": "abab abab abab"}]
    want = generate(model, tok, head, messages, tree="eagle2", budget=60, max_new_tokens=16).token_ids
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.top_k = 5
    try:
        assert bench.runners.run_hf(model, tok, messages, 16, 0.0, 0).token_ids == want
        assert bench.runners.run_hf(model, tok, messages, 16, 0.0, 0, lookup_tokens=4).token_ids == want
    finally:
        model.generation_config.repetition_penalty, model.generation_config.top_k = 1.0, 50


def test_a_run_without_budgets_writes_its_results_and_bad_runs_are_refused_before_loading(
    tiny_setup, tmp_path, monkeypatch, capsys
):
    model, tok, _ = tiny_setup
    loads = []
    monkeypatch.setattr(
        "eagletree.target.load_target", lambda spec, dtype=None, device=None: loads.append(spec) or (model, tok)
    )
    (tmp_path / "p.jsonl").write_text('"hello how are you"\n"tell me a joke"\n')
    args = [
        "bench",
        "--target",
        "tiny",
        "--prompts",
        str(tmp_path / "p.jsonl"),
        "--max-new-tokens",
        "6",
        "--pack",
        "off",
    ]
    # lookup alone has no budget axis: the plots crashed after the run, before results.json was written
    assert (
        cli_main(args + ["--head", "none", "--methods", "lookup", "--temperatures", "0", "-o", str(tmp_path / "a")])
        == 0
    )
    data = json.loads((tmp_path / "a" / "results.json").read_text())
    assert [r["label"] for r in data["results"]] == ["plain", "lookup"] and "speedup.png" not in data["plots"]
    loads.clear()
    assert cli_main(args + ["--head", "none", "--methods", "eagle2", "-o", str(tmp_path / "b")]) == 2
    assert "tree methods need a draft head" in capsys.readouterr().err and not loads  # (after loading, before)
    assert cli_main(args + ["--methods", "lookup", "--temperatures", "0,0", "-o", str(tmp_path / "c")]) == 2
    assert "--temperatures lists a temperature twice: [0.0, 0.0]" in capsys.readouterr().err and not loads
    assert cli_main(args + ["--methods", "lookup", "--temperatures", "0,1e-30", "-o", str(tmp_path / "c")]) == 2
    assert "--temperatures must be finite numbers, 0 or >= 1e-20" in capsys.readouterr().err and not loads


def test_bench_batch_sizes_writes_the_throughput_table_and_plot(tiny_setup, tmp_path, monkeypatch, capsys):
    argv = _bench_cli(tiny_setup, tmp_path, monkeypatch)
    argv += ["--max-new-tokens", "5", "--pack", "off", "-o", str(tmp_path / "out")]
    assert cli_main([*argv, "--batch-sizes", "1,2,3"]) == 0
    data = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert set(data["rates"]) == {"HF generate", "eagletree plain", "eagletree trees"}
    assert all(sorted(map(int, r)) == [1, 2, 3] and min(r.values()) > 0 for r in data["rates"].values())
    assert data["identical"] is True and data["prompts"] == 3
    assert (tmp_path / "out" / "throughput.png").stat().st_size > 0
    assert "| batch | HF generate tok/s" in capsys.readouterr().out
    for bad in ("1,0", "2,2"):
        assert cli_main([*argv, "--batch-sizes", bad]) == 2
        assert "--batch-sizes must be distinct integers >= 1" in capsys.readouterr().err
    assert cli_main([*argv, "--repeats", "2"]) == 2
    assert "--repeats 2 repeats the throughput sweep: pass --batch-sizes too" in capsys.readouterr().err


def test_bench_batch_sizes_repeats_rounds_and_reports_medians(tiny_setup, tmp_path, monkeypatch, capsys):
    """--repeats: every method measured in each round at each batch size, the table's rates the rounds' medians."""
    argv = _bench_cli(tiny_setup, tmp_path, monkeypatch)
    argv += ["--max-new-tokens", "4", "--pack", "off", "-o", str(tmp_path / "out")]
    assert cli_main([*argv, "--batch-sizes", "1,2", "--repeats", "3"]) == 0
    data = json.loads((tmp_path / "out" / "throughput.json").read_text())
    assert data["repeats"] == 3 and data["identical"] is True
    for method, by_size in data["rounds"].items():
        for b, rates in by_size.items():
            assert len(rates) == 3 and data["rates"][method][b] == sorted(rates)[1], (method, b)
    out = capsys.readouterr().out
    assert "medians of 3 rounds per batch size" in out and "B=1: " in out and "B=2: " in out
    with pytest.raises(SystemExit) as e:
        cli_main([*argv, "--batch-sizes", "1", "--repeats", "0"])
    assert e.value.code == 2 and "--repeats: must be an integer >= 1, got '0'" in capsys.readouterr().err

import json
from pathlib import Path

import pytest
import torch

from eagletree.train.config import lr_lambda
from eagletree.train.loop import TrainConfig, TrainingError, train
from eagletree.train.render import RenderError, render

from helpers import tiny_conversations, tiny_model, tiny_tokenizer


def test_render_masks_exactly_the_assistant_turns():
    tok = tiny_tokenizer()
    messages = [
        {"role": "user", "content": "hello how are you"},
        {"role": "assistant", "content": "fine thanks"},
        {"role": "user", "content": "what is two plus four"},
        {"role": "assistant", "content": "six"},
    ]
    r = render(tok, messages)
    assert tok.decode(r.input_ids[r.loss_mask]) == "fine thanks <|end|> six <|end|>"
    cut = render(tok, messages, max_len=5)
    assert cut.truncated and cut.input_ids.numel() == 5
    # A conversation that opens with an assistant turn (ShareGPT's split chats): the mask starts at its text.
    opening = render(tok, messages[1:])
    assert tok.decode(opening.input_ids[opening.loss_mask]) == "fine thanks <|end|> six <|end|>"
    empty = render(tok, [{"role": "assistant", "content": " "}] + messages[2:])
    assert tok.decode(empty.input_ids[empty.loss_mask]) == "six <|end|>"
    context = render(tok, [messages[0], dict(messages[1], weight=0)] + messages[2:])  # weight 0: not trained on
    assert tok.decode(context.input_ids[context.loss_mask]) == "six <|end|>"
    assert torch.equal(context.input_ids, r.input_ids)


def test_render_needs_a_chat_template():
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(RenderError, match="no chat template"):
        render(tok, [{"role": "user", "content": "hi"}])


@pytest.mark.real
def test_render_smollm2_template(smollm2):
    _, tok = smollm2
    r = render(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there!"}])
    assert tok.decode(r.input_ids[r.loss_mask]) == "Hello there!<|im_end|>\n"
    # Opening with an assistant turn: the default system prompt and the header are not the answer's (they were).
    r = render(
        tok,
        [
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Sure."},
        ],
    )
    assert tok.decode(r.input_ids[r.loss_mask]) == "Hello! How can I help?<|im_end|>\nSure.<|im_end|>\n"
    for text in ("end", "im", "assistant"):  # short texts that also occur in the template's markup
        r = render(tok, [{"role": "assistant", "content": text}, {"role": "user", "content": "hi"}])
        assert tok.decode(r.input_ids[r.loss_mask]) == f"{text}<|im_end|>\n", text


def test_config_errors(tmp_path):
    with pytest.raises(TrainingError, match=r"unknown config keys \['learning_rate'\]; valid keys: \[.*'lr'"):
        TrainConfig.from_sources(None, ["learning_rate=0.1"])
    with pytest.raises(TrainingError, match="must be int"):
        TrainConfig.from_sources(None, ["steps=many"])
    (tmp_path / "keys.yaml").write_text("2: 3\nfoo: 1\n")  # a number as a key (sorting it with 'foo' crashed)
    with pytest.raises(TrainingError, match=r"unknown config keys \[2, 'foo'\]"):
        TrainConfig.from_sources(tmp_path / "keys.yaml", [])
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\nlr: 1\n")
    cfg = TrainConfig.from_sources(path, ["grad_accum=2"])
    assert (cfg.steps, cfg.lr, cfg.grad_accum) == (7, 1.0, 2)
    # text keys take the override as written: empty clears, digits stay a name
    path.write_text("init_head: runs/old/head\n")
    cfg = TrainConfig.from_sources(path, ["init_head=", "out_dir=2024"])
    assert (cfg.init_head, cfg.out_dir) == ("", "2024")
    # a key the head type never reads is refused, not silently ignored; its default value is harmless
    ignored = (
        r"noise=0.1, ttt_steps=3: have no effect on 'medusa' heads \(it ignores noise, ttt_steps, ttt_decay, "
        r"l1_weight, ce_weight, fc_bias\); remove them"
    )
    with pytest.raises(TrainingError, match=ignored):
        TrainConfig.from_sources(None, ["head_type=medusa", "noise=0.1", "ttt_steps=3"])
    with pytest.raises(TrainingError, match=r"^l1_weight=0.5: has no effect on 'eagle3' heads"):
        TrainConfig.from_sources(None, ["head_type=eagle3", "l1_weight=0.5"])
    with pytest.raises(TrainingError, match=r"^medusa_heads=3: has no effect on 'eagle' heads"):
        TrainConfig.from_sources(None, ["medusa_heads=3"])
    assert TrainConfig.from_sources(None, ["head_type=medusa", "noise=0.2", "medusa_heads=3"]).medusa_heads == 3
    assert TrainConfig.from_sources(None, ["head_type=medusa", "noise=0"]).noise == 0.0


def tiny_cfg(tmp_path, **kw):
    base = dict(
        out_dir=str(tmp_path),
        report_to="none",
        steps=8,
        grad_accum=2,
        save_every=2,
        warmup_steps=2,
        max_len=40,
        lr=1e-3,
        device="cpu",
    )
    return TrainConfig(**(base | kw))


def _records(folder):
    """The run's history.jsonl records."""
    return [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]


def run(cfg, resume=False):
    return train(
        cfg,
        resume=resume,
        model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
        conversations=tiny_conversations(12),
        progress=False,
    )


def test_resume_gives_identical_weights(tmp_path):
    straight, _ = run(tiny_cfg(tmp_path / "a"))
    run(tiny_cfg(tmp_path / "b", stop_after=4))
    history = tmp_path / "b" / "history.jsonl"
    with open(history, "a") as f:  # as if killed after writing step 5's record but before its checkpoint
        f.write('{"loss": 1.0, "step": 5}\n{"loss": 1.0, "st')
    resumed, summary = run(tiny_cfg(tmp_path / "b"), resume=True)
    assert summary["steps"] == 8
    import json

    steps = [json.loads(line)["step"] for line in history.read_text().splitlines()]
    assert steps == list(range(1, 9))
    losses = {name: [r["loss"] for r in _records(tmp_path / name)] for name in ("a", "b")}
    assert max(abs(a - b) for a, b in zip(losses["a"], losses["b"])) < 1e-6
    # each record's lr is the one its step used: warm-up 1/2, 2/2, then the cosine (it was the next step's)
    cfg = tiny_cfg(tmp_path / "a")
    logged = [json.loads(line)["lr"] for line in history.read_text().splitlines()]
    assert logged == pytest.approx([cfg.lr * lr_lambda(cfg)(s) for s in range(8)]) and logged[0] == cfg.lr / 2
    # a dataset that changed under a run (a distill file continued) is noticed: its order would differ silently
    run(tiny_cfg(tmp_path / "c", stop_after=4))
    grown = dict(
        model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
        conversations=tiny_conversations(14),
        progress=False,
        resume=True,
    )
    with pytest.raises(
        TrainingError,
        match=r"training data changed since the checkpoint \(12 -> 14 conversations\)"
        r".*pass --allow-changes",
    ):
        train(tiny_cfg(tmp_path / "c"), **grown)
    with pytest.warns(UserWarning, match="training data changed") as caught:
        _, summary = train(tiny_cfg(tmp_path / "c"), allow_changes=True, **grown)
    assert {w.filename for w in caught if "training data changed" in str(w.message)} == {__file__}  # train()'s caller
    assert summary["steps"] == 8
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert (a - b).abs().max() <= 1e-6, name


def test_a_micro_batch_without_a_loss_does_not_shrink_the_step(tmp_path, monkeypatch):
    """The gradient of a step is the mean over the sequences that had a loss: a conversation without an answer
    among grad_accum micro-batches leaves the same gradient as the others alone; a step with none moves nothing."""
    from eagletree.train.data import Conversation

    grads = []

    def record(self, *a, **kw):
        grads.append([p.grad.clone() for group in self.param_groups for p in group["params"] if p.grad is not None])

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    answered = tiny_conversations(1)
    unanswered = [Conversation("u0", [{"role": "user", "content": "alpha beta"}])]

    def go(name, convs, **kw):
        cfg = tiny_cfg(tmp_path / name, **({"steps": 1} | kw), save_every=1, noise=0.0, clip=0.0)
        return train(
            cfg, model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()), conversations=convs, progress=False
        )

    go("one", answered, grad_accum=1)
    go("two", answered + unanswered, grad_accum=2)
    assert len(grads) == 2 and len(grads[0]) == len(grads[1]) > 0
    for alone, with_empty in zip(*grads):
        assert torch.allclose(alone, with_empty, rtol=1e-5, atol=1e-7)
    go("alternate", answered + unanswered, grad_accum=1, steps=2)  # one step each: the empty one moves nothing
    assert len(grads) == 3
    losses = [json.loads(line)["loss"] for line in (tmp_path / "alternate" / "history.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and sum(x is None for x in losses) == 1  # its record says null, not 0


def test_training_reduces_the_loss(tmp_path):
    _, summary = run(tiny_cfg(tmp_path, steps=40, save_every=40))
    history = [r["loss"] for r in _records(tmp_path)]
    assert sum(history[-5:]) / 5 < 0.8 * sum(history[:5]) / 5


def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    from eagletree.draft import EagleHead

    real = EagleHead.batch_loss
    calls = {"n": 0}

    def poisoned(self, *args, **kwargs):
        calls["n"] += 1
        ((loss, parts),) = real(self, *args, **kwargs)
        return [((loss * float("nan") if calls["n"] > 4 else loss), parts)]  # step 3's first micro-batch

    monkeypatch.setattr(EagleHead, "batch_loss", poisoned)
    with pytest.raises(TrainingError, match=r"loss is nan at step 3 .*step-0000002"):
        run(tiny_cfg(tmp_path))
    # the history of the checkpointed steps is on disk too
    assert [r["step"] for r in _records(tmp_path)] == [1, 2]
    from eagletree.draft import EagleHead

    assert EagleHead.from_pretrained(tmp_path / "checkpoints" / "step-0000002" / "head") is not None


def test_a_head_started_from_the_targets_last_layer_trains(tmp_path):
    from eagletree.draft import EagleHead

    model = tiny_model("llama")
    torch.manual_seed(0)
    head = EagleHead.create(model, tiny_cfg(tmp_path, init_from_target=True))
    last = model.get_decoder().layers[-1].state_dict()
    mine = head.layer.state_dict()
    scaled = {
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.down_proj.weight",
    }
    assert all(torch.equal(v, last[k]) for k, v in mine.items() if k not in scaled)
    # the rescaled ones: the target's weight times one factor per group, measured on a target pass
    ratio = {k: (mine[k] / last[k]).flatten() for k in scaled}
    assert all(torch.allclose(r, r[:1].expand_as(r), rtol=1e-4) for r in ratio.values())
    first = {k: r[0].item() for k, r in ratio.items()}
    assert first["self_attn.q_proj.weight"] == pytest.approx(first["self_attn.v_proj.weight"], rel=1e-5)
    assert first["self_attn.o_proj.weight"] == pytest.approx(first["mlp.down_proj.weight"], rel=1e-5)
    from eagletree.draft.base import HeadError
    from eagletree.draft.eagle import _last_layer_scales

    residual, normed, feature = _last_layer_scales(model, None)
    assert first["mlp.down_proj.weight"] == pytest.approx(feature / residual, rel=1e-5) and feature / residual < 0.9
    assert first["self_attn.q_proj.weight"] == pytest.approx(normed / feature, rel=1e-5)
    with pytest.raises(
        HeadError,
        match=r"probe_tokens must be one sequence of at least 32 token ids, got shape "
        r"\(2, 40\)",
    ):
        _last_layer_scales(model, torch.zeros(2, 40, dtype=torch.long))
    assert set(last) - set(head.layer.state_dict()) == {"input_layernorm.weight"}  # the head's layer has no input norm
    h = model.config.hidden_size
    assert torch.equal(head.fc.weight[:, h:], torch.eye(h)) and head.fc.weight[:, :h].abs().sum() > 0
    # fc passes the feature through: with a zero token embedding the layer's input is the feature itself
    feats = torch.randn(1, 3, h)
    zero = torch.nn.Embedding(model.config.vocab_size, h).requires_grad_(False)
    torch.nn.init.zeros_(zero.weight)
    assert torch.allclose(head.fc(torch.cat([zero(torch.zeros(1, 3, dtype=torch.long)), feats], -1)), feats)
    fresh = EagleHead.create(model, tiny_cfg(tmp_path))
    assert not torch.equal(fresh.layer.state_dict()["mlp.down_proj.weight"], last["mlp.down_proj.weight"])
    trained, summary = run(tiny_cfg(tmp_path / "run", init_from_target=True))
    assert summary["steps"] == 8 and not torch.equal(
        trained.layer.state_dict()["mlp.down_proj.weight"].cpu(), last["mlp.down_proj.weight"]
    )
    with pytest.raises(
        TrainingError, match="init_from_target starts a head .* which 'eagle' heads can; head_type is 'medusa'"
    ):
        TrainConfig.from_sources(None, ["init_from_target=true", "head_type=medusa"])
    with pytest.raises(TrainingError, match="init_from_target and init_head 'runs/x' both say where the head starts"):
        TrainConfig.from_sources(None, ["init_from_target=true", "init_head=runs/x"])


def test_draft_vocab_head_trains(tmp_path):
    head, _ = run(tiny_cfg(tmp_path, draft_vocab=20, steps=2))
    assert head.config.draft_vocab_size == 20 and head.d2t.numel() == 20


def test_medusa_heads_train(tmp_path):
    head, summary = run(tiny_cfg(tmp_path, head_type="medusa", medusa_heads=2, steps=20, save_every=20, lr=3e-3))
    history = [r["loss"] for r in _records(tmp_path)]
    assert head.num_heads == 2 and history[-1] < history[0]


def test_offline_features_resume_and_train_like_online(tmp_path, monkeypatch):
    import json

    from eagletree import files  # every cache file is renamed into place by files.writing
    from eagletree.train.features import FeatureError, cache_features

    model, tok, convs = tiny_model("llama"), tiny_tokenizer(), tiny_conversations(10)
    cfg = tiny_cfg(tmp_path / "run", features_dir=str(tmp_path / "feats"), feature_dtype="fp32", steps=3, save_every=3)
    # Interrupt after the first shard: the second is neither on disk nor in the manifest.
    real_save = files.os.replace
    calls = {"n": 0}

    def flaky(src, dst):
        if str(dst).endswith(".safetensors"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise KeyboardInterrupt
        return real_save(src, dst)

    monkeypatch.setattr(files.os, "replace", flaky)
    with pytest.raises(KeyboardInterrupt):
        cache_features(cfg, model, tok, convs, shard_size=4, progress=False)
    manifest = json.loads((tmp_path / "feats" / "manifest.json").read_text())
    assert [s["index"] for s in manifest["shards"]] == [0] and not manifest["complete"]
    assert sorted(p.name for p in (tmp_path / "feats").glob("shard-*")) == ["shard-00000.safetensors"]
    # Resuming writes only the missing shards.
    calls["n"] = -100
    manifest = cache_features(cfg, model, tok, convs, shard_size=4, progress=False)
    assert calls["n"] == -98  # shards 1 and 2
    assert manifest["complete"] and [s["index"] for s in manifest["shards"]] == [0, 1, 2]
    # another shard size would cut the conversations differently: some would be cached twice
    with pytest.raises(FeatureError, match=r"cached with --shard-size 4; continue it with --shard-size 4 \(got 3\)"):
        cache_features(cfg, model, tok, convs, shard_size=3, progress=False)
    # a dataset that grew (a distill file continued) would leave its new conversations out of the finished last
    # shard, yet the cache was "complete"; one that changed would train on stale shards
    for changed in (tiny_conversations(12), convs[::-1]):
        with pytest.raises(FeatureError, match="the dataset changed since it was cached: use another features_dir"):
            cache_features(cfg, model, tok, changed, shard_size=4, progress=False)
    with pytest.raises(FeatureError, match="shard 2: it holds 2 conversations, the data now puts 4 there"):
        cache_features(cfg, model, tok, tiny_conversations(12), shard_size=4, progress=False)
    monkeypatch.undo()

    offline, _ = train(cfg, model_and_tokenizer=(model, tok), progress=False)
    online_cfg = tiny_cfg(tmp_path / "run2", steps=3, save_every=3)
    online, _ = train(online_cfg, model_and_tokenizer=(model, tok), conversations=convs, progress=False)
    for (name, a), (_, b) in zip(offline.state_dict().items(), online.state_dict().items()):
        assert (a - b).abs().max() <= 1e-5, name

    with pytest.raises(FeatureError, match="holds features for"):
        cache_features(tiny_cfg(tmp_path / "x", features_dir=str(tmp_path / "feats"), max_len=20), model, tok, convs)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")  # a mistyped features_dir: nothing is written there
    with pytest.raises(FeatureError, match="'.*notes' holds other files \\(todo.txt\\) and no manifest.json"):
        cache_features(tiny_cfg(tmp_path / "x", features_dir=str(tmp_path / "notes")), model, tok, convs)
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["todo.txt"]


def _tiny_run_inputs(tmp_path):
    """A tiny target folder and a JSONL dataset, as a user would pass them to train.py."""
    import json

    model, tok = tiny_model("llama"), tiny_tokenizer()
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in tiny_conversations(40)))
    return tmp_path / "target", data


def _losses(folder):
    import json

    return [json.loads(line)["loss"] for line in (folder / "history.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("from_features", [False, True])
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, from_features):
    """Two CPU processes vs `python train.py` with twice the accumulation, online or from cached features (then
    each process loads the target's shell alone and reads only its own shard group; the one process reads the
    same two groups, `feature_groups=2`).

    On CPU, `accelerate launch --num_processes 2 --cpu` needs mpirun; torchrun is the equivalent
    launcher and Accelerator picks its environment up (MULTI_CPU, gloo).
    """
    import os
    import subprocess
    import sys

    target, data = _tiny_run_inputs(tmp_path)
    cached = []
    if from_features:
        from eagletree.target import load_target
        from eagletree.train.features import cache_features
        from eagletree.train.inputs import training_conversations

        keys = dict(target=str(target), dataset=str(data), heldout_fraction=0.01, max_len=40, precision="fp32")
        cfg = TrainConfig(**keys, features_dir=str(tmp_path / "feats"), feature_dtype="fp32")
        cache_features(cfg, *load_target(target), training_conversations(cfg), shard_size=8, progress=False)
        cached = [f"features_dir={tmp_path / 'feats'}", "feature_dtype=fp32", "precision=fp32", "draft_vocab=40"]
    common = [
        *cached,
        f"target={target}",
        f"dataset={data}",
        "heldout_fraction=0.01",
        "steps=6",
        "save_every=6",
        "warmup_steps=1",
        "max_len=40",
        "lr=0.001",
        "noise=0.0",
        "device=cpu",
        "--report-to",
        "none",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    groups = ["feature_groups=2"] if from_features else []
    single = subprocess.run(
        [sys.executable, "train.py", f"out_dir={tmp_path / 'one'}", "grad_accum=4", *groups, *common],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    out = subprocess.run(
        [*launch, "train.py", f"out_dir={tmp_path / 'two'}", "grad_accum=2", *common],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(one) == len(two) == 6
    # Same conversations per optimizer step, gradients averaged across processes: the same curve up to float order.
    assert max(abs(a - b) / a for a, b in zip(one, two)) < 1e-3, (one, two)
    # one summary, of the whole run: the token count summed over both processes (each printed its own half)
    summaries = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1 and summaries[0]["tokens"] == json.loads(single.stdout.splitlines()[-1])["tokens"]
    saved = torch.load(tmp_path / "two" / "checkpoints" / "step-0000006" / "trainer.pt", weights_only=False)
    assert saved["counters"]["tokens"] == summaries[0]["tokens"]


def test_evaluation_reports_agreement_tokens_per_pass_and_calibration():
    from eagletree.draft import EagleHead
    from eagletree.train.evaluate import agreement, answer_sequences, calibrate, heldout_prompts, tokens_per_pass

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config, torch.arange(60)).eval()
    convs = tiny_conversations(4)
    result = agreement(head, model, tok, convs, steps=3, max_len=40, stride=2)
    assert 0 <= result["teacher_forced"] <= 1 and len(result["free_running"]) == 3 and result["chains"] > 0
    steps = []
    prompts = heldout_prompts(convs, 3)
    assert [m[-1]["role"] for m in prompts] == ["user"] * 3
    answers = []
    report = tokens_per_pass(
        head, model, tok, prompts, max_new_tokens=12, steps=steps, answers=answers, budget=8, depth=3, top_k_draft=2
    )
    assert report["passes"] == len(steps) and report["tokens_per_pass"] >= 1.0
    # the answers are the target's own greedy continuations (a no-cache argmax loop)
    assert len(answers) == 3 and sum(a.numel() for _, a in answers) == report["new_tokens"]
    for prompt_ids, answer in answers:
        ids = prompt_ids.clone()
        with torch.no_grad():
            for _ in range(answer.numel()):
                ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax()[None]])
        assert ids[prompt_ids.numel() :].equal(answer)
    own = agreement(head, model, tok, steps=3, stride=2, sequences=answer_sequences(answers))
    assert own["positions"] == sum(a.numel() - 1 for _, a in answers) and own["chains"] > 0
    calibrator, cal = calibrate(steps)
    assert cal["steps"] == len(steps) - len(steps) // 2 and calibrator.method == "isotonic"


def test_config_ranges_and_head_type_on_resume(tmp_path):
    with pytest.raises(TrainingError, match="'save_every' must be >= 1, got 0"):
        TrainConfig.from_sources(None, ["save_every=0"])
    run(tiny_cfg(tmp_path, steps=2, save_every=2))
    with pytest.raises(TrainingError, match="holds a 'eagle' head but the config asks for head_type 'medusa'"):
        run(tiny_cfg(tmp_path, steps=4, head_type="medusa"), resume=True)


def test_precision_key(tmp_path, monkeypatch):
    from eagletree.train import config
    from eagletree.train.loop import resolve_precision

    with pytest.raises(TrainingError, match="precision must be 'auto', 'bf16' or 'fp32', got 'fp16'"):
        TrainConfig.from_sources(None, ["precision=fp16"])
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: False)
    assert (resolve_precision("auto", cpu=True), resolve_precision("auto", cpu=False)) == ("fp32", "bf16")
    assert resolve_precision("bf16", cpu=True) == "bf16"
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: True)
    assert resolve_precision("auto", cpu=True) == "bf16" and resolve_precision("fp32", cpu=True) == "fp32"
    # bf16 runs the head under autocast with fp32 master weights: close to the fp32 run, but not the same numbers.
    full, _ = run(tiny_cfg(tmp_path / "fp32", steps=4, precision="fp32"))
    half, _ = run(tiny_cfg(tmp_path / "bf16", steps=4, precision="bf16"))
    diffs = []
    for (name, a), (_, b) in zip(full.state_dict().items(), half.state_dict().items()):
        if a.is_floating_point():
            assert a.dtype == b.dtype == torch.float32, name
            diffs.append(float((a - b).abs().max()))
    assert 0 < max(diffs) < 0.05
    # Resuming in another precision than the checkpoint's says so.
    run(tiny_cfg(tmp_path / "mixed", steps=4, stop_after=2, precision="fp32"))
    with pytest.warns(UserWarning, match=r"was trained in fp32 and continues in bf16") as caught:
        run(tiny_cfg(tmp_path / "mixed", steps=4, precision="bf16"), resume=True)
    assert {w.filename for w in caught if "continues in bf16" in str(w.message)} == {__file__}  # train()'s caller


def test_unrolled_steps_equal_sequential_drafting():
    """The training-time test of an EAGLE-1/2 head: step k at position p is exactly the depth-k node that
    chain drafting from the committed position p-k+1 computes, one step at a time with the head's cache."""
    from eagletree.draft import EagleHead
    from eagletree.draft.objectives import unroll_drafts

    model = tiny_model("llama")
    torch.manual_seed(1)
    head = EagleHead.for_target(model.config, torch.arange(60)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    embed = model.get_input_embeddings()
    t, h = 9, model.config.hidden_size
    feats, tokens = torch.randn(t, h), torch.randint(0, 60, (t,))
    with torch.no_grad():
        unrolled = dict(unroll_drafts(head, feats, tokens, embed, 3))
        for k in (1, 2, 3):
            for p in range(k - 1, t):
                root = p - k + 1
                cache = head.new_cache()
                out = head(
                    feats[None, : root + 1], tokens[None, : root + 1], torch.arange(root + 1), embed, cache=cache
                )[0]
                for pos in range(root + 1, p + 1):
                    out = head(out[None, -1:], tokens[None, pos : pos + 1], torch.tensor([pos]), embed, cache=cache)[0]
                assert torch.allclose(unrolled[k][p], out[-1], rtol=1e-4, atol=1e-4), (k, p)
        # one step is the plain causal call
        plain = head(feats[None], tokens[None], torch.arange(t), embed)[0]
        assert torch.equal(dict(unroll_drafts(head, feats, tokens, embed, 1))[1], plain)


def test_eagle_head_trains_with_the_training_time_test(tmp_path):
    from eagletree.draft import objectives

    seen = []
    real = objectives.unroll_drafts

    def spy(*args):
        seen.append(args[-1])
        yield from real(*args)

    default, _ = run(tiny_cfg(tmp_path / "a", steps=2))
    one, _ = run(tiny_cfg(tmp_path / "b", steps=2, ttt_steps=1))
    for (name, a), (_, b) in zip(default.state_dict().items(), one.state_dict().items()):
        assert torch.equal(a, b), name  # 0 = the original one-step objective
    objectives.unroll_drafts = spy
    try:
        run(tiny_cfg(tmp_path / "c", steps=30, save_every=30, ttt_steps=3, lr=3e-3))
    finally:
        objectives.unroll_drafts = real
    assert set(seen) == {3}
    history = [r["loss"] for r in _records(tmp_path / "c")]
    assert sum(history[-5:]) < 0.8 * sum(history[:5])
    with pytest.raises(TrainingError, match="'ttt_steps' must be >= 0"):
        TrainConfig.from_sources(None, ["ttt_steps=-1"])


def test_a_fresh_run_never_mixes_with_a_run_in_its_out_dir(tmp_path):
    run(tiny_cfg(tmp_path, steps=6))
    with pytest.raises(
        TrainingError, match=r"holds a run \(checkpoints up to step-0000006\); pass --resume .*--overwrite"
    ):
        run(tiny_cfg(tmp_path, steps=6, stop_after=2))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000004", "step-0000006"]
    # --overwrite with an input that fails to load (a mistyped init_head) leaves the old run as it was (it was
    # deleted before the inputs were read)
    with pytest.raises(TrainingError, match="is not a saved head"):
        train(
            tiny_cfg(tmp_path, steps=6, init_head=str(tmp_path / "typo")),
            progress=False,
            overwrite=True,
            model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
            conversations=tiny_conversations(12),
        )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000004", "step-0000006"]
    assert (tmp_path / "head").is_dir() and len((tmp_path / "history.jsonl").read_text().splitlines()) == 6
    with pytest.raises(TrainingError, match="--resume continues the run in out_dir and --overwrite deletes it"):
        train(tiny_cfg(tmp_path, steps=6), resume=True, overwrite=True, progress=False)
    with pytest.raises(TrainingError, match="report_to must be 'wandb' or 'none', got 'tensorboard'"):
        TrainConfig.from_sources(None, ["report_to=tensorboard"])
    _, summary = train(
        tiny_cfg(tmp_path, steps=6, stop_after=2),
        model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
        conversations=tiny_conversations(12),
        progress=False,
        overwrite=True,
    )
    assert summary["steps"] == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-0000002"]  # the old run's are gone
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == 2
    (tmp_path / "afile").write_text("x")
    with pytest.raises(TrainingError, match=r"out_dir '.*afile' is a file; expected a folder for the run"):
        run(tiny_cfg(tmp_path / "afile"))
    for key, value, message in (("out_dir", "", "the run's folder"), ("heldout_fraction", "0", r"must be in \(0, 1\)")):
        with pytest.raises(TrainingError, match=rf"'{key}'.*{message}"):
            TrainConfig.from_sources(None, [f"{key}={value}"])


def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resume_loses_nothing(tmp_path, monkeypatch):
    import os
    import signal

    from eagletree.draft import EagleHead
    from eagletree.train.loop import TrainingInterrupted

    straight, _ = run(tiny_cfg(tmp_path / "a", save_every=100))
    real, calls = EagleHead.batch_loss, {"n": 0}

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # step 3's first micro-batch
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EagleHead, "batch_loss", interrupted)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(
        TrainingInterrupted,
        match=r"interrupted by SIGTERM after step 3 of 8: saved .*step-0000003; "
        r"run the same command with --resume",
    ):
        run(tiny_cfg(tmp_path / "b", save_every=100))
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # the run's are gone
    assert [p.name for p in (tmp_path / "b" / "checkpoints").iterdir()] == ["step-0000003"]
    monkeypatch.setattr(EagleHead, "batch_loss", real)
    resumed, summary = run(tiny_cfg(tmp_path / "b", save_every=100), resume=True)
    assert summary["steps"] == 8
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert (a - b).abs().max() <= 1e-6, name


def test_a_signal_during_the_last_step_still_writes_the_head(tmp_path, monkeypatch):
    import os
    import signal

    from eagletree.draft import EagleHead

    straight, _ = run(tiny_cfg(tmp_path / "a", save_every=100))
    real, calls = EagleHead.batch_loss, {"n": 0}

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 15:  # step 8's first micro-batch: the last step
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EagleHead, "batch_loss", interrupted)
    head, summary = run(tiny_cfg(tmp_path / "b", save_every=100))
    assert calls["n"] == 16 and summary["steps"] == 8
    assert (tmp_path / "b" / "head" / "config.json").is_file()
    assert [p.name for p in (tmp_path / "b" / "checkpoints").iterdir()] == ["step-0000008"]
    for (name, a), (_, b) in zip(straight.state_dict().items(), head.state_dict().items()):
        assert (a - b).abs().max() <= 1e-6, name


def test_resume_sets_a_damaged_checkpoint_aside_and_keeps_the_head_defining_keys(tmp_path, capsys):
    run(tiny_cfg(tmp_path, steps=8, stop_after=6, keep_checkpoints=2))
    (tmp_path / "checkpoints" / "step-0000006" / "trainer.pt").write_bytes(b"cut")
    run(tiny_cfg(tmp_path, steps=8, stop_after=7, keep_checkpoints=1, save_every=1), resume=True)
    assert "set the damaged step-0000006 aside" in capsys.readouterr().err
    # the resumed run's checkpoint is kept (it sorts before the damaged one, which pruning no longer sees)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["damaged-step-0000006", "step-0000007"]
    with pytest.raises(TrainingError, match=r"fc_bias False -> True would change the head's shape or start"):
        train(
            tiny_cfg(tmp_path, steps=8, fc_bias=True),
            resume=True,
            allow_changes=True,
            model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
            conversations=tiny_conversations(12),
            progress=False,
        )
    capsys.readouterr()
    run(tiny_cfg(tmp_path / "fresh"), resume=True)
    assert "no checkpoint in" in capsys.readouterr().err


def test_training_data_that_was_cut_is_warned_about(tmp_path):
    import json

    from eagletree.train.data import DataWarning
    from eagletree.train.loop import training_conversations

    convs = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(60)
    ]
    text = json.dumps(convs)
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) // 2])
    with pytest.warns(DataWarning, match=r"cut.json is cut off"):
        train_convs = training_conversations(TrainConfig(dataset=str(path)))
    assert 0 < len(train_convs) < 60


class _Payload:
    """Unpickling it creates a file: what a trainer.pt in a run folder from elsewhere could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_a_trainer_state_that_would_run_code_is_refused_unless_trusted(tmp_path):
    """--resume loads trainer.pt with weights_only=True (what this version writes loads so); a file holding other
    Python objects is refused, naming them and --trust-checkpoint, without running them or setting it aside."""
    from eagletree.train.checkpoints import latest_checkpoint

    run(tiny_cfg(tmp_path / "b", stop_after=4))
    ckpt = latest_checkpoint(tmp_path / "b")
    state = torch.load(ckpt / "trainer.pt", weights_only=True)  # the format written: no code to run
    marker = tmp_path / "ran"
    torch.save(dict(state, extra=_Payload(marker)), ckpt / "trainer.pt")
    with pytest.raises(TrainingError, match=r"holds Python objects .*pathlib.*--trust-checkpoint"):
        run(tiny_cfg(tmp_path / "b"), resume=True)
    assert not marker.exists() and latest_checkpoint(tmp_path / "b") == ckpt  # nothing ran, nothing set aside
    _, summary = train(
        tiny_cfg(tmp_path / "b"),
        resume=True,
        trust_checkpoint=True,
        model_and_tokenizer=(tiny_model("llama"), tiny_tokenizer()),
        conversations=tiny_conversations(12),
        progress=False,
    )
    assert marker.exists() and summary["steps"] == 8  # trusted: loaded with pickle (it ran), the run went on


def test_train_py_refuses_an_untrusted_trainer_state_in_one_line_and_takes_trust_checkpoint(tmp_path, capsys):
    import importlib.util

    from eagletree.train.checkpoints import latest_checkpoint

    spec = importlib.util.spec_from_file_location("train_script", Path(__file__).parent.parent / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    target, data = _tiny_run_inputs(tmp_path)
    out = tmp_path / "run"
    common = [f"target={target}", f"dataset={data}", f"out_dir={out}", "steps=4", "save_every=2", "max_len=40"]
    common += ["heldout_fraction=0.05", "warmup_steps=1", "report_to=none", "device=cpu"]
    assert script.main(common + ["stop_after=2"]) == 0
    ckpt = latest_checkpoint(out)
    state = torch.load(ckpt / "trainer.pt", weights_only=True)
    torch.save(dict(state, extra=_Payload(tmp_path / "ran")), ckpt / "trainer.pt")
    capsys.readouterr()
    assert script.main(common + ["--resume"]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]  # (after the target's loading bar)
    assert line.startswith("error: ") and "--trust-checkpoint" in line and "Traceback" not in err
    assert not (tmp_path / "ran").exists()
    assert script.main(common + ["--resume", "--trust-checkpoint"]) == 0 and (tmp_path / "ran").exists()

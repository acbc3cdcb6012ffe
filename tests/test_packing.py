"""Packed training (`micro_batch` > 1): several conversations in one padded target pass and one `batch_loss`, for
every head kind, give each conversation the loss, the gradient and the noise it gets alone, so a packed run takes
the steps of a run with one conversation per micro-batch."""

import json

import pytest
import torch

from eagletree.draft import head_class
from eagletree.train.config import TrainConfig, TrainingError
from eagletree.train.loop import train

from helpers import tiny_conversations, tiny_model, tiny_tokenizer

KINDS = {
    "eagle": {},
    "eagle-ttt3": {"ttt_steps": 3},
    "eagle3": {"head_type": "eagle3"},
    "medusa": {"head_type": "medusa", "medusa_heads": 2},
    "dflash": {"head_type": "dflash", "block_size": 4, "block_anchors": 3},
}


def settings(kind: str, **more) -> TrainConfig:
    return TrainConfig(**({"noise": 0.2, "ce_weight": 0.5} | KINDS[kind] | more))


def three_sequences(vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, loss mask) of three sequences of different lengths, each with assistant tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in (23, 9, 31):
        ids = torch.randint(0, vocab, (length,), generator=g)
        mask = torch.rand(length, generator=g) < 0.7
        mask[:2] = False
        rows.append((ids, mask))
    return rows


def assert_near(a: torch.Tensor, b: torch.Tensor, name: str, tol: float) -> None:
    """a equals b up to rounding: |a - b| <= tol x |b| (norms over the whole tensor)."""
    a, b = a.double(), b.double()
    diff, size = float((a - b).norm()), float(b.norm())
    assert diff <= tol * max(size, 1e-12), f"{name}: |a - b| = {diff:.3g}, |b| = {size:.3g}"


def generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_packed_micro_batch_gives_each_sequence_its_own_loss_and_gradient(kind):
    """In float64, where rounding cannot hide a difference (in float32 the padded calls' kernels round otherwise,
    and three unrolled drafting steps amplify that to ~1e-4 of an untrained head's gradient)."""
    model = tiny_model("llama").double()
    cfg = settings(kind)
    torch.manual_seed(0)
    head = head_class(cfg.head_type).create(model, cfg, torch.arange(64)).train().double()
    embed = model.get_input_embeddings()
    lm = (model.get_output_embeddings().weight.detach()[head.d2t], None)
    rows = three_sequences(64)
    with torch.no_grad():
        packed_feats = head.target_features_batch(model, [ids for ids, _ in rows])
        alone_feats = [head.target_features(model, ids) for ids, _ in rows]
    for packed, alone in zip(packed_feats, alone_feats):  # the padding is invisible to every real token
        torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)

    def grads(losses):
        head.zero_grad()
        torch.stack(losses).sum().backward()
        return {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    batch = [(f, ids, mask) for f, (ids, mask) in zip(alone_feats, rows)]
    packed = head.batch_loss(head, lm, embed, batch, cfg, generators(7, 3))
    packed_grads = grads([loss for loss, _ in packed])
    alone = [
        head.training_loss(head, lm, embed, f, ids, mask, cfg, g) for (f, ids, mask), g in zip(batch, generators(7, 3))
    ]
    alone_grads = grads([loss for loss, _ in alone])
    assert len(packed) == 3 and all(r is not None for r in packed)
    for (lp, pp), (la, pa) in zip(packed, alone):
        torch.testing.assert_close(lp, la, rtol=1e-12, atol=1e-12)
        assert pp["tokens"] == pa["tokens"] > 0
        for key in ("l1", "ce", "acc"):
            torch.testing.assert_close(
                torch.as_tensor(pp[key]).double(), torch.as_tensor(pa[key]).double(), atol=1e-12, rtol=1e-12
            )
    assert packed_grads.keys() == alone_grads.keys() and packed_grads
    for name in packed_grads:
        assert_near(packed_grads[name], alone_grads[name], name, 1e-10)
    # the noise is each sequence's own: another seed for one sequence changes only its loss
    if kind != "medusa":  # (Medusa's objective draws nothing)
        other = head.batch_loss(head, lm, embed, batch, cfg, generators(7, 2) + generators(99, 1))
        assert [torch.equal(a[0], b[0]) for a, b in zip(packed, other)] == [True, True, False]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_sequence_without_assistant_tokens_has_no_loss_in_a_pack(kind):
    model = tiny_model("llama")
    cfg = settings(kind)
    head = head_class(cfg.head_type).create(model, cfg, None).train()
    rows = three_sequences(64, seed=1)
    rows[1] = (rows[1][0], torch.zeros_like(rows[1][1]))
    with torch.no_grad():
        feats = head.target_features_batch(model, [ids for ids, _ in rows])
    lm = (model.get_output_embeddings().weight.detach(), None)
    batch = [(f, ids, mask) for f, (ids, mask) in zip(feats, rows)]
    result = head.batch_loss(head, lm, model.get_input_embeddings(), batch, cfg, generators(0, 3))
    assert result[1] is None and result[0] is not None and result[2] is not None


def _history(folder):
    return [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash"])
def test_a_packed_run_takes_the_steps_of_micro_batches_of_one(tmp_path, kind):
    """micro_batch=3, grad_accum=1 against micro_batch=1, grad_accum=3: the same conversations per step, the same
    noise, the same mean gradient; only the padded passes' rounding differs."""
    model, tok, convs = tiny_model("llama"), tiny_tokenizer(), tiny_conversations(12)
    common = dict(report_to="none", steps=4, save_every=4, warmup_steps=1, max_len=40, lr=1e-3, device="cpu")
    kw = common | ({"block_size": 4, "block_anchors": 4} if kind == "dflash" else {}) | KINDS[kind]
    heads = {}
    for name, micro, accum in (("packed", 3, 1), ("single", 1, 3)):
        cfg = TrainConfig(out_dir=str(tmp_path / name), micro_batch=micro, grad_accum=accum, **kw)
        heads[name], _ = train(cfg, model_and_tokenizer=(model, tok), conversations=convs, progress=False)
    for (name, a), (_, b) in zip(heads["packed"].state_dict().items(), heads["single"].state_dict().items()):
        assert_near(a, b, name, 1e-3)  # (AdamW turns a rounding-sized gradient difference into up to lr a step)
    packed, single = _history(tmp_path / "packed"), _history(tmp_path / "single")
    assert [r["sequences"] for r in packed] == [r["sequences"] for r in single] == [3] * 4
    assert packed[0]["loss"] == pytest.approx(single[0]["loss"], rel=1e-6)  # the same weights: the same loss
    assert [r["loss"] for r in packed] == pytest.approx([r["loss"] for r in single], rel=1e-3)


def test_micro_batch_must_be_positive():
    with pytest.raises(TrainingError, match="'micro_batch' must be >= 1, got 0"):
        TrainConfig.from_sources(None, ["micro_batch=0"])

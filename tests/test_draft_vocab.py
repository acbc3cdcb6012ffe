"""Drafting over the target's whole vocabulary with a head trained on a draft vocabulary (`--draft-vocab full`)."""

import argparse
import types

import pytest
import torch

from eagletree.decode import GenerationStats, decode_steps
from eagletree.draft import EagleHead, HeadError, MedusaHead, TreeDrafter, make_drafter
from eagletree.draft.eagle3 import Eagle3Head
from eagletree.loading import draft_vocab_for, load_models

from helpers import tiny_model, tiny_tokenizer

VOCAB = torch.arange(0, 97, 3)  # every third of the tiny model's 97 tokens


def narrow_head(model):
    torch.manual_seed(0)
    return EagleHead.for_target(model.config, VOCAB).eval()


def test_a_widened_head_scores_every_token_with_the_targets_lm_head():
    model = tiny_model("llama")
    head = narrow_head(model)
    g = torch.Generator().manual_seed(3)
    feats, toks = torch.randn(6, 64, generator=g), torch.randint(97, (6,), generator=g)
    narrow = TreeDrafter(head, model).extend(feats, toks)
    assert narrow.shape == (VOCAB.numel(),)
    assert head.widen_vocab() is head and head.config.draft_vocab_size is None
    drafter = TreeDrafter(head, model)
    wide = drafter.extend(feats, toks)
    assert drafter.token_map is None and wide.shape == (97,)
    with torch.no_grad():
        feature = head(feats[None], toks[None], torch.arange(6), model.get_input_embeddings())[0, -1]
        expected = torch.softmax(model.lm_head(feature), -1)
    assert torch.allclose(wide, expected, atol=1e-6)
    # The same scores: over the old vocabulary, the full distribution renormalized is the narrow one.
    assert torch.allclose(wide[VOCAB] / wide[VOCAB].sum(), narrow, atol=1e-6)


@pytest.mark.parametrize("tree", ["eagle2", "optimal"])
def test_greedy_decoding_with_a_widened_head_equals_plain_and_drafts_the_other_tokens(tree):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = narrow_head(model).widen_vocab()
    g = torch.Generator().manual_seed(1)
    outside = 0
    for _ in range(3):
        ids = torch.randint(97, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g)
        stats = GenerationStats(steps=[])
        got = [
            t
            for step in decode_steps(
                model,
                tok,
                head,
                ids,
                max_new_tokens=24,
                tree=tree,
                budget=10,
                depth=3,
                top_k_draft=3,
                copy=False,
                stats=stats,
            )
            for t in step
        ]
        with torch.no_grad():
            plain = model.generate(
                ids[None],
                attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
            )[0, ids.numel() :].tolist()
        assert got == plain
        outside += sum(int(t) % 3 != 0 for draft, _ in stats.steps for t in draft.tokens[1:])
    assert outside > 0  # tokens the draft vocabulary left out were drafted


def test_heads_with_their_own_lm_head_keep_their_vocabulary():
    model = tiny_model("llama")
    refusal = r"its own lm_head \(33 rows\), so it cannot draft over the target's full vocabulary \(--draft-vocab full"
    with pytest.raises(HeadError, match=refusal):
        Eagle3Head.for_target(model, VOCAB).widen_vocab()
    own = MedusaHead.for_target(model.config, VOCAB, num_heads=2, own_lm_head=True)
    with pytest.raises(HeadError, match="own lm_head"):
        own.widen_vocab()
    shared = MedusaHead.for_target(model.config, VOCAB, num_heads=2).widen_vocab()  # reads the target's lm_head
    drafter = make_drafter(shared, model)
    assert drafter.token_map is None and drafter.extend(torch.randn(3, 64), torch.tensor([1, 2, 3])).shape == (97,)


def test_load_models_draft_vocab(tmp_path, monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    narrow_head(model).save_pretrained(tmp_path / "eagle")
    Eagle3Head.for_target(model, VOCAB).save_pretrained(tmp_path / "eagle3")
    sizes = {}
    for name in ("eagle", "eagle3"):
        for vocab in ("auto", "head", "full"):
            if (name, vocab) == ("eagle3", "full"):
                with pytest.raises(HeadError, match="own lm_head"):
                    load_models("tiny", tmp_path / name, draft_vocab=vocab)
                continue
            sizes[name, vocab] = load_models("tiny", tmp_path / name, draft_vocab=vocab)[2].config.draft_vocab_size
    # auto on a CPU: the head's own vocabulary (a larger lm_head costs a CPU drafting level the most).
    assert sizes == {
        ("eagle", "auto"): 33,
        ("eagle", "head"): 33,
        ("eagle", "full"): None,
        ("eagle3", "auto"): 33,
        ("eagle3", "head"): 33,
    }
    with pytest.raises(ValueError, match=r"draft_vocab must be one of \('auto', 'head', 'full'\), got 'all'"):
        load_models("tiny", tmp_path / "eagle", draft_vocab="all")
    assert draft_vocab_for("auto", types.SimpleNamespace(device=torch.device("cuda"))) == "full"
    assert draft_vocab_for("auto", types.SimpleNamespace(device=torch.device("cpu"))) == "head"
    # auto on a GPU: the full vocabulary, except for a head with an lm_head of its own.
    monkeypatch.setattr("eagletree.loading.draft_vocab_for", lambda name, model: "full")
    assert load_models("tiny", tmp_path / "eagle", draft_vocab="auto")[2].config.draft_vocab_size is None
    assert load_models("tiny", tmp_path / "eagle3", draft_vocab="auto")[2].config.draft_vocab_size == 33


@pytest.mark.parametrize(
    "engine, vocab, size",
    [("vllm", "auto", None), ("eagle", "auto", None), ("sglang", "auto", 33), ("vllm", "head", 33)],
)
def test_plan_measures_the_vocabulary_its_engine_drafts_over(engine, vocab, size, capsys):
    from eagletree.cli.models import _draft_vocab
    from eagletree.cli.plan import _engine_vocab

    model = tiny_model("llama")
    args = argparse.Namespace(draft_vocab=vocab, engine=engine)
    assert _draft_vocab(args) == "head"  # plan loads the head's own, then settles auto by the engine
    head = narrow_head(model)
    _engine_vocab(args, head)
    assert head.config.draft_vocab_size == size
    assert ("drafting over the full vocabulary" in capsys.readouterr().err) == (size is None)
    eagle3 = Eagle3Head.for_target(model, VOCAB)
    _engine_vocab(args, eagle3)  # vLLM and EAGLE draft an EAGLE-3 export over its d2t
    assert eagle3.config.draft_vocab_size == 33

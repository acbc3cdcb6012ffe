import pytest
import torch

import eagletree
from eagletree.draft_heads import EagleHead
from eagletree.generate import GenerationStats, decode_steps, generate

from helpers import tiny_model, tiny_tokenizer


def plain(model, ids, n):
    with torch.no_grad():
        out = model.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, ids.numel():].tolist()


@pytest.mark.parametrize("tree", ["eagle2", "optimal", "chain", "sequoia"])
@pytest.mark.parametrize("draft_vocab", [None, 50])
def test_greedy_generation_equals_plain_decoding_tiny(tree, draft_vocab):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config, None if draft_vocab is None else torch.arange(draft_vocab)).eval()
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(97, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        result = generate(model, tok, head, ids, max_new_tokens=40, tree=tree, budget=12, depth=4, top_k_draft=3)
        assert result.token_ids == plain(model, ids, 40)
        assert result.stats.passes >= 1 and result.stats.new_tokens == 40


def test_edge_cases():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    result = eagletree.generate(model, tok, head, torch.tensor([3, 4]), max_new_tokens=0)
    assert result.token_ids == [] and result.stats.passes == 0
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, tok, head, torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the model's context of 512 tokens"):
        generate(model, tok, head, torch.arange(500) % 97, max_new_tokens=20)
    cut = generate(model, tok, head, torch.arange(500) % 97, max_new_tokens=20, truncate_prompt=True)
    assert len(cut.token_ids) == 20
    with pytest.raises(ValueError, match="tree must be one of"):
        generate(model, tok, head, torch.tensor([3]), tree="bushy")


def test_head_for_another_target_is_refused():
    from eagletree.draft_heads import HeadError

    head = EagleHead.for_target(tiny_model("qwen2").config)
    with pytest.raises(HeadError, match="model_type"):
        generate(tiny_model("llama"), tiny_tokenizer(), head, torch.tensor([3, 4]), max_new_tokens=3)


def test_stats_add_up():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    stats = GenerationStats()
    steps = list(decode_steps(model, tok, head, torch.tensor([5, 6, 7]), max_new_tokens=30, stats=stats))
    assert sum(len(s) for s in steps) == stats.new_tokens == 30
    assert stats.passes == len(steps) and sum(stats.histogram().values()) == stats.passes
    d = stats.as_dict()
    assert d["tokens_per_pass"] == pytest.approx(30 / len(steps)) and d["seconds"] > 0


def test_medusa_generation_is_lossless():
    from eagletree.draft_heads import MedusaHead

    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    head = MedusaHead.for_target(model.config, num_heads=3).eval()
    ids = torch.tensor([4, 9, 16, 25, 36])
    for tree in ("sequoia", "eagle2"):
        result = generate(model, tok, head, ids, max_new_tokens=30, tree=tree, budget=10, depth=3, top_k_draft=3)
        assert result.token_ids == plain(model, ids, 30)
    assert result.stats.tokens_per_pass > 1.0  # identity-initialized heads guess repeated tokens sometimes

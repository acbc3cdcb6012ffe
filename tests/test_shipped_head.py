"""The head shipped for SmolLM2: it loads, it is small, and decoding with it is lossless."""

import pytest
import torch

from eagletree.decode import generate
from eagletree.draft import EagleHead, load_head
from eagletree.loading import SHIPPED_HEADS
from eagletree.packing import pack_linears, packing_problem, stock_kernels

HEAD = SHIPPED_HEADS["smollm2-135m"]


def test_shipped_head_is_small_bf16_safetensors():
    weights = HEAD / "model.safetensors"
    assert weights.is_file() and weights.stat().st_size <= 20 * 2**20
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if k != "d2t"} == {torch.bfloat16}


@pytest.fixture
def prompts(smollm2, sharegpt):
    """The 4 shortest of 40 held-out first turns: long prompts only make every pass slower, not the test stronger."""
    from eagletree.train.data import split
    from eagletree.train.evaluate import heldout_prompts

    _, tok = smollm2
    _, heldout = split(sharegpt)
    candidates = heldout_prompts(heldout[200:], 40)
    # (the prompt's token count: apply_chat_template returns a dict of input_ids and attention_mask here, whose
    # len() was 2 for every prompt, so the "shortest" were the first 10, up to 509 tokens long)
    lengths = [
        len(tok.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"]) for m in candidates
    ]
    chosen = sorted(range(len(candidates)), key=lambda i: lengths[i])[:4]
    assert max(lengths[i] for i in chosen) < 100, [lengths[i] for i in chosen]
    return [candidates[i] for i in sorted(chosen)]


def plain(model, tok, messages, n):
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def first_difference(model, tok, messages, ours, ref) -> str:
    """Where greedy outputs first differ, with the target's two logits there (a float near-tie shows a tiny gap)."""
    i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    with torch.inference_mode():
        logits = model(torch.cat([ids, torch.tensor([ref[:i]], dtype=torch.long)], 1)).logits[0, -1]
    return (
        f"token {i}: ours {ours[i]} (logit {logits[ours[i]]:.6f}) vs plain {ref[i]} (logit {logits[ref[i]]:.6f}), "
        f"gap {abs(float(logits[ours[i]] - logits[ref[i]])):.2e}"
    )


@pytest.mark.real
def test_greedy_with_the_shipped_head_equals_plain_decoding(smollm2, shipped_head, prompts):
    """4 held-out prompts x 64 new tokens, every tree method on two of them (some drafting with the head in bf16),
    the target's Linears packed for oneDNN as the CLI does on CPU (EAGLE-2 also with PyTorch's stock kernels),
    against HF generate with the stock kernels. (It was 10 prompts x 128 tokens x every method: up to 19 minutes
    on a 2-core machine; a method that changes a token changes it on any prompt, within a few passes.)"""
    model, tok = smollm2
    head = shipped_head
    assert isinstance(head, EagleHead) and len(prompts) == 4
    if not packing_problem(model):
        pack_linears(model)  # unpacked again by the smollm2 fixture: the target is shared with other tests
    low = load_head(HEAD, target_config=model.config, dtype=torch.bfloat16)  # what --draft-dtype auto picks on CPU
    methods = [
        ("eagle2", head, dict(budget=60, depth=6, top_k_draft=10)),
        ("optimal", low, dict(budget=24, depth=6)),
        ("chain", head, dict(depth=5)),
        ("sequoia", low, dict(budget=16, depth=6)),
        ("auto", low, dict(budget=32, depth=6)),
        ("eagle2-stock", low, dict(budget=16, depth=6)),
    ]
    n, passes, new, decoded = 64, 0, 0, []
    for i, messages in enumerate(prompts):
        with stock_kernels(model):
            ref = plain(model, tok, messages, n)
        for j, (tree, drafter, kw) in enumerate(methods):
            if i not in (j % len(prompts), (j + 1) % len(prompts)):  # method j decodes prompts j and j + 1
                continue
            decoded.append(tree)
            if tree == "eagle2-stock":
                with stock_kernels(model):
                    out = generate(model, tok, drafter, messages, max_new_tokens=n, tree="eagle2", **kw)
            else:
                out = generate(model, tok, drafter, messages, max_new_tokens=n, tree=tree, **kw)
            # Both stop at EOS (and emit it); otherwise both give exactly n tokens.
            assert out.token_ids == ref[:n], f"{tree}: " + first_difference(model, tok, messages, out.token_ids, ref)
            if tree == "eagle2":
                passes, new = passes + out.stats.passes, new + out.stats.new_tokens
    assert sorted(decoded) == sorted([m[0] for m in methods] * 2)
    assert new / passes > 1.3  # the head really drafts: well above one token per pass


@pytest.mark.real
def test_a_batch_with_the_shipped_head_equals_plain_decoding_of_each_prompt(smollm2, shipped_head, prompts):
    """The 4 held-out prompts x 48 tokens decoded 3 at a time (continuous batching: the fourth joins when the first
    finishes), EAGLE-2 under one budget of 16 nodes per sequence with copied spans: every answer is HF generate's
    of its prompt alone, and the head's drafts are accepted (more than one token per pass)."""
    from eagletree import DecodeConfig, Decoder

    model, tok = smollm2
    n = 48
    decoder = Decoder(model, tok, shipped_head, DecodeConfig(tree="eagle2", budget=16, max_new_tokens=n))
    results = decoder.generate_batch(prompts, batch_size=3)
    for messages, result in zip(prompts, results):
        ref = plain(model, tok, messages, n)
        assert result.token_ids == ref[:n], first_difference(model, tok, messages, result.token_ids, ref)
    tokens = sum(r.stats.new_tokens for r in results)
    assert tokens / sum(r.stats.passes for r in results) > 1.5


@pytest.mark.real
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_drafter_drafts_what_the_transformers_layer_drafts_on_real_features(
    smollm2, shipped_head, prompts, dtype
):
    """On the target's own features of real prompts, the shipped head's lean layer gives the transformers layer's
    distributions (fp32: to float rounding; bf16: close, with the same top tokens wherever they are not a near
    tie), through a catch-up on each prompt and two drafting levels of the top-4 children."""
    from eagletree.draft.batch_drafter import RaggedTreeDrafter

    model, tok = smollm2
    head = load_head(HEAD, target_config=smollm2[0].config, dtype=dtype)  # (the shared one may have been packed)
    lean, stock = RaggedTreeDrafter(head, model), RaggedTreeDrafter(head, model, lean=False)
    assert lean.lean is not None
    for i, messages in enumerate(prompts):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"][0]
        with torch.inference_mode():
            features = model.model(input_ids=ids[None]).last_hidden_state[0]
        got, want = [], []
        for drafter, out in ((stock, want), (lean, got)):  # both expand the transformers layer's best children
            drafter.add_row()
            drafter.extend([i], [features[:-1]], [ids[1:]])
            out.append(drafter.rows[i].root_probs)
            if drafter is stock:
                children = stock.token_map[want[0].topk(4).indices]  # (requests carry target token ids)
            out.append(drafter.expand([(i, torch.arange(1, 5), children, torch.zeros(4, dtype=torch.long), 2)])[0])
            if drafter is stock:
                grand = stock.token_map[want[1].topk(2, dim=-1).indices.flatten()]
            parents = torch.arange(1, 5).repeat_interleave(2)
            out.append(drafter.expand([(i, torch.arange(5, 13), grand, parents, 3)])[0])
        for a, b in zip(got, want):
            if dtype == torch.float32:
                assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
            else:
                assert (a - b).abs().max() < 0.05
                top2 = b.topk(2, dim=-1).values
                clear = (top2[..., 0] - top2[..., 1]) > 0.05
                assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])

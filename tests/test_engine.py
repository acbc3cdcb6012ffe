"""The verify engine in a minimal decode loop: greedy output equals plain decoding; KV commit is exact."""

import pytest
import torch

from eagletree.target import cache_length, new_cache
from eagletree.verify import DraftTree, emitted_tokens, prefill, verify_step

from helpers import oracle_tree, random_tree, tiny_model


def stop_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def plain_greedy(model, prompt: torch.Tensor, max_new: int) -> list[int]:
    """HF's own greedy decoding; it ends early at an EOS token."""
    with torch.no_grad():
        out = model.generate(
            prompt[None],
            attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
        )
    return out[0, prompt.numel() :].tolist()


def speculative_greedy(model, prompt, max_new, make_tree):
    """Decode with the engine: each step verifies a tree from `make_tree(root, n_emitted)`."""
    cache = new_cache(model)
    prefill(model, cache, prompt[:-1])
    root, out, passes = int(prompt[-1]), [], 0
    while len(out) < max_new:
        step = verify_step(model, cache, make_tree(root, len(out)), stop_ids=stop_ids(model))
        out += step.tokens
        root, passes = step.tokens[-1], passes + 1
        if step.stopped:
            break
        assert cache_length(cache) == prompt.numel() + len(out) - 1  # everything emitted but the new root
    return out[:max_new], passes, cache


def explain_mismatch(model, prompt, ours, ref) -> str:
    """Where two greedy outputs first differ, with the target's two competing logits there."""
    i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    with torch.no_grad():
        logits = model(torch.cat([prompt, torch.tensor(ref[:i], dtype=torch.long)])[None]).logits[0, -1]
    gap = abs(float(logits[ours[i]] - logits[ref[i]]))
    verdict = "a float near-tie" if gap < 1e-3 else "NOT a near-tie: the engine is wrong"
    return (
        f"first difference at new token {i}: engine {ours[i]} (logit {logits[ours[i]]:.6f}) vs plain "
        f"{ref[i]} (logit {logits[ref[i]]:.6f}); gap {gap:.2e}, {verdict}"
    )


def check_lossless(model, prompts, max_new, n_nodes, depth, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    total_passes = 0
    for k, prompt in enumerate(prompts):
        ref = plain_greedy(model, prompt, max_new)

        def make_tree(root, done):
            if (done + k) % 2:  # useless random trees ...
                return random_tree(n_nodes, depth, vocab, g, root_token=root)
            return oracle_tree(root, ref[done:], n_nodes, depth, vocab, g)  # ... and trees that hold the truth

        ours, passes, _ = speculative_greedy(model, prompt, max_new, make_tree)
        assert ours == ref, explain_mismatch(model, prompt, ours, ref)
        total_passes += passes
    return total_passes


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_greedy_output_equals_plain_decoding_tiny(kind):
    model = tiny_model(kind)
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(model.config.vocab_size, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        for _ in range(20)
    ]
    passes = check_lossless(model, prompts, 64, n_nodes=16, depth=6, seed=3)
    assert passes < 20 * 64  # the oracle steps were accepted beyond one token


@pytest.mark.real
def test_greedy_output_equals_plain_decoding_smollm2(smollm2):
    model, tok = smollm2
    # 3 prompts x 48 tokens (was 5 x 64): every step still alternates useless random trees and trees holding the
    # truth, and the tiny models above run the long and many-prompt cases
    questions = ["What is the capital of France?", "Write a haiku about autumn leaves.", "How do airplanes fly?"]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"][0]
        for q in questions
    ]
    passes = check_lossless(model, prompts, 48, n_nodes=16, depth=6, seed=4)
    assert passes < 3 * 48  # the oracle trees' paths were accepted beyond one token


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_committed_cache_equals_a_plain_forward(kind):
    model = tiny_model(kind)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(97, (9,), generator=g)
    ref = plain_greedy(model, prompt, 40)
    out, passes, cache = speculative_greedy(
        model, prompt, 40, lambda root, done: oracle_tree(root, ref[done:], 24, 5, 97, g, hit=0.8)
    )
    assert passes > 3
    emitted = torch.cat([prompt, torch.tensor(out)])
    plain = new_cache(model)
    prefill(model, plain, emitted[:-1])  # the last emitted token is the next root, not cached yet
    assert cache_length(cache) == cache_length(plain) == emitted.numel() - 1
    for ours, theirs in zip(cache.layers, plain.layers):
        assert (ours.keys - theirs.keys).abs().max() <= 1e-4
        assert (ours.values - theirs.values).abs().max() <= 1e-4


def test_stop_token_ends_output_exactly_there():
    tree = DraftTree([1, 5, 2, 6], [-1, 0, 1, 2])
    assert emitted_tokens(tree, [0, 1, 2, 3], 9, stop_ids=[2]) == ([5, 2], True)
    assert emitted_tokens(tree, [0, 1, 2, 3], 9, stop_ids=[9]) == ([5, 2, 6, 9], True)
    assert emitted_tokens(tree, [0, 1], 2, stop_ids=[7]) == ([5, 2], False)


def test_verify_step_stops_at_an_accepted_stop_token():
    model = tiny_model("llama")
    prompt = torch.tensor([4, 8, 15, 16, 23])
    ref = plain_greedy(model, prompt, 6)
    cache = new_cache(model)
    prefill(model, cache, prompt[:-1])
    tree = DraftTree([int(prompt[-1])] + ref[:5], [-1, 0, 1, 2, 3, 4])
    step = verify_step(model, cache, tree, stop_ids=[ref[2]])
    assert step.stopped and step.tokens == ref[: ref.index(ref[2]) + 1]
    assert step.hidden.shape == (6, model.config.hidden_size)


def test_a_left_to_right_mask_is_the_models_own_causal_attention():
    from eagletree.target import tree_forward
    from eagletree.target.forward import is_causal
    from eagletree.verify.engine import causal_mask

    assert is_causal(torch.ones(1, 9, dtype=torch.bool)) and is_causal(causal_mask(4, 5))
    assert not is_causal(torch.ones(2, 7, dtype=torch.bool))  # two new rows that see each other: not causal
    tree = DraftTree([3, 4, 5], [-1, 0, 0])  # siblings do not see each other
    assert not is_causal(tree.attention_mask(5)) and not is_causal(torch.ones(2, 1, 6, dtype=torch.bool))
    model = tiny_model("llama")
    prompt = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    # The same pass with no mask (causal) and with a mask the causal check does not recognise (all-true in a
    # batch's per-row form) gives the same logits and features.
    outs = []
    for allowed in (causal_mask(4, 8), causal_mask(4, 8)[None]):
        cache = new_cache(model)
        prefill(model, cache, prompt[:8])
        outs.append(tree_forward(model, prompt[8:], cache, allowed, torch.arange(8, 12)))
        assert cache_length(cache) == 12
    assert torch.allclose(outs[0].logits, outs[1].logits, atol=1e-5)
    assert torch.allclose(outs[0].hidden, outs[1].hidden, atol=1e-5)


def test_an_accepted_path_in_place_is_committed_like_a_gathered_one():
    from eagletree.target import keep_cache_positions
    from eagletree.verify.engine import commit, verify_tree

    model = tiny_model("llama")
    prompt = torch.randint(0, model.config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    caches = []
    for fast in (True, False):
        cache = new_cache(model)
        prefill(model, cache, prompt)
        verify_tree(model, cache, DraftTree([1, 2, 3, 4], [-1, 0, 1, 0]))  # grows by 4 entries
        if fast:
            commit(cache, 10, [0, 1, 2])  # the path 0-1-2 is already in place: truncated
        else:
            keep_cache_positions(cache, 10, torch.tensor([0, 1, 2]))
        caches.append(cache)
    assert cache_length(caches[0]) == cache_length(caches[1]) == 13
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

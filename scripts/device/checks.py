"""Losslessness checks that run on any device (the GPU run's first evidence; the test suite runs them on CPU).

- greedy: eagletree's decoding (the `generate` loop with an EAGLE head, the same inside HF `generate` through
  `custom_generate=eagletree.hf.decoding(head)`, and the verify engine with trees that hold the true
  continuation) equals HF `generate(do_sample=False)` token for token; a difference is
  judged by the logit gap at that position in a plain forward (a near-tie of the dtype's rounding, or wrong);
- sampled: the first two tokens emitted by tree acceptance follow the target's distribution (chi-square);
- tree pass: the logits of every node of one tree pass (4D boolean mask, position = depth) equal a plain
  causal forward over the node's root path.

Each returns a dict of measurements with "ok"; nothing here needs pytest or scipy.
"""

from __future__ import annotations

import torch

from eagletree import hf
from eagletree.decode import decode_steps
from eagletree.draft import EagleHead
from eagletree.target import new_cache
from eagletree.verify import DraftTree, accept_tree, prefill, target_probs, verify_step, verify_tree
from eagletree.verify.synthetic import SyntheticPair, synthetic_tree


def tiny_model(kind: str, device, dtype, attn: str = "sdpa", seed: int = 0, vocab: int = 97):
    """A small random-weight Llama or Qwen2 (a wide init keeps greedy ties rare)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    config = cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts under probs (the chi-square survival function through the incomplete gamma)."""
    counts, probs = counts.flatten().double().cpu(), probs.flatten().double().cpu()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0  # a token the target never emits was emitted
    expected = probs[support] / probs[support].sum() * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _plain(model, prompt, max_new):
    with torch.no_grad():
        out = model.generate(
            prompt[None],
            attention_mask=torch.ones_like(prompt)[None],
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
        )
    return out[0, prompt.numel() :].tolist()


def _in_generate(model, prompt, max_new, method):
    """The answer of HF `generate` with eagletree's decoding method (the model has no end-of-sequence id)."""
    ones = torch.ones_like(prompt)[None]
    out = model.generate(
        prompt[None], attention_mask=ones, max_new_tokens=max_new, do_sample=False, custom_generate=method
    )
    return out[0, prompt.numel() :].tolist()


def _gap(model, prompt, ref, ours) -> tuple[int, float, float]:
    """(position, logit gap between the two tokens there, the logits' scale) at the first difference."""
    i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    with torch.no_grad():
        ids = torch.cat([prompt, torch.tensor(ref[:i], dtype=torch.long, device=prompt.device)])
        logits = model(ids[None]).logits[0, -1].float()
    return i, abs(float(logits[ours[i]] - logits[ref[i]])), float(logits.abs().max())


def _oracle_tree(root, truth, n, depth, vocab, g) -> DraftTree:
    """A random tree of n nodes that holds the true continuation along one branch (long accepted paths)."""
    tokens, parents, depths = [root], [-1], [0]
    for d in range(min(depth, len(truth))):
        tokens.append(truth[d])
        parents.append(len(tokens) - 2)
        depths.append(d + 1)
    taken = {}
    for v in range(1, len(tokens)):
        taken.setdefault(parents[v], set()).add(tokens[v])
    while len(tokens) < n:
        u = int(torch.randint(len(tokens), (1,), generator=g))
        t = int(torch.randint(vocab, (1,), generator=g))
        if depths[u] >= depth or t in taken.setdefault(u, set()):
            continue
        taken[u].add(t)
        tokens.append(t)
        parents.append(u)
        depths.append(depths[u] + 1)
    return DraftTree(tokens, parents)


def _engine_greedy(model, prompt, max_new, ref, g):
    """Decode with the verify engine alone; trees hold the true continuation (so many drafts are accepted)."""
    cache = new_cache(model)
    prefill(model, cache, prompt[:-1])
    root, out, passes = int(prompt[-1]), [], 0
    while len(out) < max_new:
        step = verify_step(model, cache, _oracle_tree(root, ref[len(out) :], 16, 6, model.config.vocab_size, g))
        out += step.tokens
        root, passes = step.tokens[-1], passes + 1
    return out[:max_new], passes


def greedy_check(device, dtype, kinds=("llama", "qwen2"), prompts: int = 10, max_new: int = 48) -> dict:
    """eagletree greedy == HF generate on tiny random models; mismatches are judged by their logit gap."""
    # A difference counts as a near-tie when the two logits are within the dtype's rounding of each other.
    tie = 1e-3 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    result = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "sequences": 0,
        "identical": 0,
        "near_ties": [],
        "wrong": [],
        "engine_tokens_per_pass": None,
    }
    new = passes = 0
    for kind in kinds:
        model = tiny_model(kind, device, dtype)
        head = EagleHead.for_target(model.config).to(device=device, dtype=dtype).eval()
        method = hf.decoding(head, tree="eagle2", budget=16, depth=4, top_k_draft=4)
        g = torch.Generator().manual_seed(7)
        for k in range(prompts):
            prompt = torch.randint(
                model.config.vocab_size, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g
            ).to(device)
            ref = _plain(model, prompt, max_new)
            runs = {
                "generate": [
                    t
                    for step in decode_steps(
                        model,
                        None,
                        head,
                        prompt,
                        max_new_tokens=max_new,
                        tree="eagle2",
                        budget=16,
                        depth=4,
                        top_k_draft=4,
                    )
                    for t in step
                ]
            }
            runs["hf_generate"] = _in_generate(model, prompt, max_new, method)
            runs["engine"], p = _engine_greedy(model, prompt, max_new, ref, g)
            new, passes = new + max_new, passes + p
            for name, ours in runs.items():
                result["sequences"] += 1
                if ours == ref:
                    result["identical"] += 1
                    continue
                i, gap, scale = _gap(model, prompt, ref, ours)
                item = {"model": kind, "prompt": k, "run": name, "position": i, "logit_gap": gap}
                result["near_ties" if gap <= tie * max(scale, 1.0) else "wrong"].append(item)
    result["engine_tokens_per_pass"] = new / max(passes, 1)
    result["ok"] = not result["wrong"] and result["engine_tokens_per_pass"] > 1.5
    return result


def sampled_check(
    device, draws: int = 20_000, vocab: int = 6, temperature: float = 1.0, top_p=None, max_seconds: float | None = None
) -> dict:
    """Chi-square of the first token and of the first two tokens emitted by tree acceptance on `device`,
    for top-k-drafted and sampled trees; p > 0.01 passes. `max_seconds` per tree kind ends the draws early
    (the stopping time does not depend on the draws' values, so the test stays valid)."""
    import time

    result = {"device": str(device), "temperature": temperature, "top_p": top_p}
    sampling = {"temperature": temperature, "top_p": top_p}
    for mode in ("deterministic", "sampled"):
        syn = SyntheticPair(vocab, device)
        # Trees are sampled on the device; acceptance samples on the host, as decoding does (a CPU generator).
        g_tree, g = torch.Generator(device=device).manual_seed(1), torch.Generator().manual_seed(0)
        pairs = torch.zeros(vocab, vocab)
        t0 = time.perf_counter()
        for n in range(draws):
            if max_seconds is not None and n >= 500 and time.perf_counter() - t0 > max_seconds:
                break
            context, out = (0,), []
            while len(out) < 2:
                tree, logits = synthetic_tree(syn, context, mode, g_tree)
                accepted, nxt = accept_tree(tree, logits, generator=g, **sampling)
                step = tree.tokens[accepted[1:]].tolist() + [int(nxt)]
                out += step
                context += tuple(step)
            pairs[out[0], out[1]] += 1
        p1 = target_probs(syn.logits((0,))[None], **sampling)[0].cpu()
        p2 = torch.stack([target_probs(syn.logits((0, a))[None], **sampling)[0].cpu() for a in range(vocab)])
        result[mode] = {
            "draws": int(pairs.sum()),
            "p_first": chi_square_p(pairs.sum(1), p1),
            "p_pair": chi_square_p(pairs, p1[:, None] * p2),
        }
    result["ok"] = all(min(result[m]["p_first"], result[m]["p_pair"]) > 0.01 for m in ("deterministic", "sampled"))
    return result


def tree_pass_check(device, dtype=torch.float32, kinds=("llama", "qwen2"), sizes=(1, 2, 9, 33, 64)) -> dict:
    """Max |tree-pass logit - root-path forward logit| over random trees, SDPA with the boolean tree mask."""
    tol = 1e-3 if dtype == torch.float32 else 0.05
    result = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "attention": "sdpa",
        "trees": 0,
        "max_abs_diff": 0.0,
        "max_rel_diff": 0.0,
    }
    g = torch.Generator().manual_seed(1)
    for kind in kinds:
        model = tiny_model(kind, device, dtype)
        prefix = torch.randint(97, (23,), generator=g).to(device)
        for n in sizes:
            tree = _oracle_tree(5, [], n, 8, 97, g)
            cache = new_cache(model)
            with torch.no_grad():
                prefill(model, cache, prefix)
                logits = verify_tree(model, cache, tree).logits[0].float()
                for path in tree.paths():
                    path = torch.as_tensor(path, dtype=torch.long)
                    ids = torch.cat([prefix, tree.tokens[path].to(device)])[None]
                    ref = model(ids).logits[0, prefix.numel() :].float()
                    diff = float((logits[path.to(device)] - ref).abs().max())
                    result["max_abs_diff"] = max(result["max_abs_diff"], diff)
                    result["max_rel_diff"] = max(result["max_rel_diff"], diff / max(float(ref.abs().max()), 1.0))
            result["trees"] += 1
    result["tolerance"] = tol
    result["ok"] = result["max_rel_diff"] <= tol
    return result

"""Acceptance rules: greedy exactness, and sampling losslessness by chi-square tests.

The target and drafter are synthetic functions of the context over a tiny vocabulary, so the
true distribution of the first two emitted tokens is known in closed form.
"""

import pytest
import torch
from scipy.stats import chisquare

from eagletree.verify import DraftTree, TreeError, accept_tree, target_probs
from eagletree.verify import accept as accept_mod
from eagletree.verify.synthetic import SyntheticPair, synthetic_tree

from helpers import chi_square_p

V = 6
DRAWS = 20_000


def first_two_tokens(syn, mode, generator, n=2, **sampling):
    """The first n tokens emitted (n=2 by default), pass after pass, from the context (0,)."""
    context, out = (0,), []
    while len(out) < n:
        tree, logits = synthetic_tree(syn, context, mode, generator)
        accepted, nxt = accept_tree(tree, logits, generator=generator, **sampling)
        step = tree.tokens[accepted[1:]].tolist() + [nxt]
        out += step
        context = context + tuple(step)
    return tuple(out[:n])


def test_chi_square_p_takes_float32_probabilities_whatever_their_last_bits():
    # A float32 distribution whose sum is off 1 in the last bit (the sum's rounding depends on the CPU's
    # kernels): expected counts normalized by that float32 sum miss the draws by ~3e-8, which scipy refuses.
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float32)
    probs[0] += 1.5e-8
    counts = torch.tensor([1000.0, 2000.0, 3000.0, 4000.0])
    assert chi_square_p(counts, probs) > 0.99
    assert chi_square_p(counts, probs.double() + 1e-3) > 0.99  # unnormalized weights are normalized over the support
    with pytest.raises(AssertionError, match="never emits"):
        chi_square_p(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))


def run_chi_square(mode, seed=0, **sampling):
    syn, g = SyntheticPair(V), torch.Generator().manual_seed(seed)
    pairs = torch.zeros(V, V)
    for _ in range(DRAWS):
        a, b = first_two_tokens(syn, mode, g, **sampling)
        pairs[a, b] += 1
    p1 = target_probs(syn.logits((0,))[None], **sampling)[0]
    p2 = torch.stack([target_probs(syn.logits((0, a))[None], **sampling)[0] for a in range(V)])
    return chi_square_p(pairs.sum(1), p1), chi_square_p(pairs, p1[:, None] * p2)


SETTINGS = [dict(temperature=0.7), dict(temperature=1.0), dict(temperature=1.0, top_p=0.9)]


@pytest.mark.real  # 20,000 draws each (slow, kept for the tests' power): the full run only
@pytest.mark.parametrize("mode", ["deterministic", "sampled", "replacement"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_sampling_is_lossless(mode, sampling):
    p_first, p_pair = run_chi_square(mode, **sampling)
    assert p_first > 0.01 and p_pair > 0.01, (p_first, p_pair)


@pytest.mark.real
@pytest.mark.parametrize("mode", ["deterministic", "sampled"])
def test_the_third_token_is_lossless_too(mode):
    """Trees of depth 2 emit up to three tokens in a pass: the third is the bonus token after an accepted leaf
    (or a correction). Its marginal over the first two, six cells, is checked (a bonus drawn by argmax
    instead of sampled survived the two-token tests)."""
    syn, g = SyntheticPair(V), torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    for _ in range(DRAWS):
        counts[first_two_tokens(syn, mode, g, n=3, temperature=1.0)[2]] += 1
    p1 = target_probs(syn.logits((0,))[None], temperature=1.0)[0].double()
    third = torch.zeros(V, dtype=torch.float64)
    for a in range(V):
        p2 = target_probs(syn.logits((0, a))[None], temperature=1.0)[0].double()
        for b in range(V):
            third += p1[a] * p2[b] * target_probs(syn.logits((0, a, b))[None], temperature=1.0)[0].double()
    assert chi_square_p(counts, third) > 0.01


@pytest.mark.real
def test_chi_square_catches_a_missing_renormalization(monkeypatch):
    """Negative control: the same test on a broken rule (no renormalization after a rejection) fails."""
    monkeypatch.setattr(accept_mod, "_normalized", lambda p, fallback: p)
    p_first, p_pair = run_chi_square("deterministic", temperature=1.0)
    assert min(p_first, p_pair) < 0.01, (p_first, p_pair)


@pytest.mark.real
def test_chi_square_catches_sampled_siblings_judged_against_the_wrong_q(monkeypatch):
    """Negative control for sampled trees: treating draws without replacement as with replacement fails."""
    real_init = DraftTree.__init__

    def wrong_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.with_replacement = True

    monkeypatch.setattr(DraftTree, "__init__", wrong_init)
    p_first, p_pair = run_chi_square("sampled", temperature=1.0)
    assert min(p_first, p_pair) < 0.01, (p_first, p_pair)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=0.9, top_k=20, top_p=0.5),
        dict(temperature=0.5, top_p=0.9),
    ],
)  # (temperature before top-p, as HF)
def test_warping_matches_hf_generate_sampling(sampling):
    """target_probs is the distribution `model.generate(do_sample=True)` draws its first token from."""
    from helpers import tiny_model

    model = tiny_model("llama")
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    probs = target_probs(logits[None], **sampling)[0]
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            prompt.expand(DRAWS, -1),
            attention_mask=torch.ones(DRAWS, 5, dtype=torch.long),
            do_sample=True,
            max_new_tokens=1,
            top_k=sampling.get("top_k", 0),
            **{k: v for k, v in sampling.items() if k != "top_k"},
        )
    counts = torch.bincount(out[:, -1], minlength=probs.numel())
    assert chi_square_p(counts, probs) > 0.01
    # Control: the same draws are far from the distribution with the warping left out.
    plain = torch.softmax(logits.double(), -1)
    assert chisquare(counts.double().numpy(), (plain * DRAWS).numpy()).pvalue < 0.01


def test_greedy_accepts_the_longest_matching_path():
    # target argmax after each node: root -> 3, node1 -> 4, node3 -> 9 ...
    tree = DraftTree([0, 3, 5, 4, 7], [-1, 0, 0, 1, 1])
    logits = torch.full((5, 10), -5.0)
    for v, best in enumerate([3, 4, 1, 9, 2]):
        logits[v, best] = 5.0
    assert accept_tree(tree, logits) == ([0, 1, 3], 9)
    logits[0] = -5.0
    logits[0, 8] = 5.0  # the root's argmax is drafted nowhere: only the correction token
    assert accept_tree(tree, logits) == ([0], 8)


def test_greedy_walk_matches_the_definition_on_random_trees():
    """accept_greedy's host walk against the definition: the deepest node whose whole root path holds the target's
    argmax after each parent, a sampled tree's repeated sibling only counting at its first occurrence."""
    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        vocab, sampled = 4, trial % 2 == 1  # (a sampled tree may repeat a token among siblings)
        parents, tokens = [-1], [int(torch.randint(0, vocab, (1,), generator=g))]
        for _ in range(int(torch.randint(0, 13, (1,), generator=g))):
            u = int(torch.randint(0, len(tokens), (1,), generator=g))
            t = int(torch.randint(0, vocab, (1,), generator=g))
            if sampled or all(tokens[w] != t for w in range(1, len(tokens)) if parents[w] == u):
                parents.append(u)
                tokens.append(t)
        n = len(tokens)
        logits = torch.randn(n, vocab, generator=g)
        best = logits.argmax(-1).tolist()
        dists = torch.full((n, vocab), 1.0 / vocab) if sampled else None
        tree = DraftTree(tokens, parents, draft_dists=dists, sampled=sampled, with_replacement=sampled)

        def correct(v):
            first = min(w for w in range(1, n) if parents[w] == parents[v] and tokens[w] == tokens[v])
            return tokens[v] == best[parents[v]] and first == v

        def on_path(v):
            return v == 0 or (correct(v) and on_path(parents[v]))

        deepest = max((v for v in range(n) if on_path(v)), key=lambda v: (int(tree.depths[v]), -v))
        path = [deepest]
        while path[-1]:
            path.append(parents[path[-1]])
        assert accept_mod.accept_greedy(tree, logits) == (path[::-1], best[deepest]), trial


def test_accept_checks_logits_against_the_tree():
    tree = DraftTree([0, 3], [-1, 0])
    with pytest.raises(TreeError, match=r"logits must be \[N=2, vocab\]"):
        accept_tree(tree, torch.zeros(3, 10))
    with pytest.raises(TreeError, match="expected 0 <= id < 2"):
        accept_tree(tree, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="temperature > 0"):
        accept_tree(tree, torch.zeros(2, 10), temperature=-1.0)

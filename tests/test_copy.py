"""Copy candidates: the n-gram index, the copy trie, calibration, and hybrid (head + copy) tree search."""

import json
import random

import pytest
import torch
from test_tree_search import connected_subtrees, drafter, paths_of

from eagletree.search import eagle2_search, eagle2_tree, optimal_search, optimal_tree, path_expand
from eagletree.search.copy import CopyCalibration, CopyTrie, NgramIndex, bin_labels, copy_trie, match_bin
from eagletree.verify import accept_tree


def naive_matches(tokens, max_ngram, max_match):
    """Every earlier occurrence of the last 1..max_ngram tokens, with its full match length (rescans everything)."""
    n_tok, out = len(tokens), {}
    for end in range(1, n_tok):
        length = 0
        while length < min(max_match, end) and tokens[end - 1 - length] == tokens[n_tok - 1 - length]:
            length += 1
        if length >= 1:
            out[end] = length
    return out


def test_index_built_incrementally_finds_what_a_rescan_finds():
    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(300)]
    index = NgramIndex(max_ngram=3, max_match=16)
    for i in range(0, 300, 7):
        index.extend(tokens[i : i + 7])  # committed a pass at a time
        ref = naive_matches(tokens[: i + 7], 3, 16)
        got = index.matches(per_ngram=10_000)
        assert dict((end, length) for length, end in got) == ref
        assert [m[0] for m in got] == sorted((m[0] for m in got), reverse=True)  # longest first
    assert len(index) == 300


def test_continuation_copies_what_followed_and_repeats_into_the_present():
    index = NgramIndex([7, 1, 2, 3, 9, 9, 1, 2])
    (length, end), *_ = index.matches()
    assert (length, end) == (2, 3) and index.continuation(end, 4) == [3, 9, 9, 1]
    loop = NgramIndex([5, 6, 4, 5, 6, 4, 5, 6])  # a model stuck in a loop: the copy continues the period
    length, end = loop.matches()[0]
    assert length == 5 and loop.continuation(end, 7) == [4, 5, 6, 4, 5, 6, 4]
    assert NgramIndex([1, 2, 3]).matches() == []
    with pytest.raises(ValueError, match="max_ngram must be >= 1, got 0"):
        NgramIndex(max_ngram=0)


def test_copies_are_looked_up_after_a_draft_path_and_grafted_under_its_node():
    index = NgramIndex([1, 2, 3, 4, 20, 21])  # the context's last token, 21, occurred nowhere before
    assert index.matches() == [] and index.matches(suffix=(9, 1)) == [(1, 1)]  # "... 21 9 1": the 1 at the start
    assert index.continuation(1, 6, suffix=(9, 1)) == [2, 3, 4, 20, 21, 9]  # into the path, then repeating
    cal = CopyCalibration(max_len=8)
    assert copy_trie(index, cal) is None
    trie = copy_trie(index, cal, at_nodes=True)
    assert len(trie) == 1 and trie.lookup((7,)) is None
    below = trie.lookup((1,))
    assert below.tokens[1:] == [2, 3, 4, 20, 21, 1, 2] and below.info[1] == (match_bin(1), 0)  # 7 = 8 - the path's 1

    def child_probs(path):  # the head: 1 first, then 0 (which the copy never proposes)
        p = torch.full((25,), 0.002, dtype=torch.float64)
        p[1], p[0] = 0.6, 1 - 0.6 - 23 * 0.002
        return p

    for search, reference in ((optimal_search, optimal_tree), (eagle2_search, eagle2_tree)):
        tree = search(path_expand(child_probs), 20, budget=12, depth=2, top_k=2, copies=trie)
        assert paths_of(tree) == paths_of(reference(child_probs, 20, budget=12, depth=2, top_k=2, copies=trie))
        assert (20, 1, 2, 3, 4) in paths_of(tree)  # the head's 1, then what followed 1 before
        two = next(v for v in range(len(tree)) if tree.tokens[tree.path_to(v)].tolist() == [20, 1, 2])
        assert tree.copy_info[two] == (match_bin(1), 0)
        without = search(
            path_expand(child_probs), 20, budget=12, depth=2, top_k=2, copies=copy_trie_without_lookup(trie)
        )
        assert (20, 1, 2, 3) not in paths_of(without)


def test_copy_trie_merges_agreeing_spans_and_values_by_match_length_and_position():
    cal = CopyCalibration(max_len=4)
    cal.prior[match_bin(3)] = torch.tensor([0.9, 0.8, 0.7, 0.6], dtype=torch.float64)
    # "1 2 3" occurred before, followed by 4 5 6 7 and once by 4 8 ...; the trie shares the 4.
    index = NgramIndex([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 8, 9, 9, 0, 1, 2, 3])
    trie = copy_trie(index, cal, max_spans=2)
    # The latest match is 4 tokens long ("0 1 2 3"), the first only 3: it comes first, the other branches off it.
    assert trie.tokens == [-1, 4, 8, 9, 9, 5, 6, 7] and trie.parents == [-1, 0, 1, 2, 3, 1, 5, 6]
    assert trie.info[1:] == [(3, 0), (3, 1), (3, 2), (3, 3), (2, 1), (2, 2), (2, 3)]
    assert trie.factors[1] == pytest.approx(0.5) and trie.factors[5:] == pytest.approx([0.8, 0.7, 0.6])
    assert trie.depth == 4 and trie.children()[0] == [1]  # one node for the shared first token
    assert copy_trie(NgramIndex([1, 2, 3]), cal) is None
    assert [match_bin(n) for n in (1, 3, 7, 8, 30)] == [0, 2, 3, 4, 4]
    assert bin_labels() == ["1", "2", "3", "4-7", "8+"]


def test_measured_rates_back_off_to_the_previous_position_and_long_spans_share_the_last_cell():
    cal = CopyCalibration(max_len=4, strength=2.0)
    cal.tried[4] = torch.tensor([10.0, 10.0, 0.0, 0.0], dtype=torch.float64)
    cal.accepted[4] = torch.tensor([9.0, 10.0, 0.0, 0.0], dtype=torch.float64)
    measured = cal.measured()
    assert measured[4, 0] == pytest.approx(10 / 12) and measured[4, 1] == pytest.approx((10 + 2 * 10 / 12) / 12)
    assert measured[4, 3] == pytest.approx(measured[4, 1])  # untried cells take their neighbour's rate, not 0.5
    assert cal.rate()[4, 3] == pytest.approx(0.5)  # while decoding, a cell follows its own prior
    cal.prior[:] = torch.tensor([0.9, 0.8, 0.7, 0.6], dtype=torch.float64)
    index = NgramIndex(list(range(10, 30)) + list(range(10, 12)))  # "10 11" again: 18 tokens follow it
    trie = copy_trie(index, cal, max_len=10)
    assert trie.tokens[1:] == list(range(12, 22)) and trie.depth == 10  # longer than the table
    assert [c for _, c in trie.info[1:]] == [0, 1, 2] + [3] * 7  # positions 3.. share the last column
    assert trie.factors[1:] == pytest.approx([0.9, 0.8, 0.7] + [0.6] * 7)  # a 2-token match: no counts, the prior


def random_trie(seed, vocab, spans=3, length=5, rate=0.7):
    rng = random.Random(seed)
    trie = CopyTrie([-1], [-1], [1.0], [None], [0])
    for _ in range(spans):
        u = 0
        for j in range(rng.randrange(1, length + 1)):
            t = rng.randrange(vocab)
            v = next((c for c in range(1, len(trie)) if trie.parents[c] == u and trie.tokens[c] == t), None)
            if v is None:
                trie.tokens.append(t)
                trie.parents.append(u)
                trie.factors.append(rng.uniform(0.2, 0.99) * rate)
                trie.info.append((rng.randrange(5), j))
                trie.depths.append(j + 1)
                v = len(trie) - 1
            u = v
    return trie


def brute_force_hybrid(child_probs, trie, budget, depth, top_k):
    """Max of 1 + sum of path values over every connected tree of head (top_k) and copy candidates.

    With `trie.lookup`, a path not on a copied one also has the copies that lookup gives for it."""
    value, trie_at = {(): 1.0}, {(): (trie, trie.children(), 0)}

    def children(path):
        kids = {}
        if len(path) < depth:
            p = child_probs(path)
            q, t = torch.topk(p, min(top_k, p.numel()))
            kids = {int(x): float(pr) for x, pr in zip(t, q) if pr > 0}
        if path not in trie_at and trie.lookup is not None and (below := trie.lookup(path)) is not None:
            trie_at[path] = (below, below.children(), 0)
        copy, kids_of, at = trie_at.get(path, (None, None, None))
        copied, head_q = set(), 0.0
        for c in kids_of[at] if copy is not None else ():
            tok = copy.tokens[c]
            head_q += kids.get(tok, 0.0)
            kids[tok] = 1 - (1 - kids.get(tok, 0.0)) * (1 - copy.factors[c])  # agreeing head and copy
            copied.add(tok)
            trie_at[path + (tok,)] = (copy, kids_of, c)
        if copied:  # a node's children are worth at most 0.99 + what the head's others keep
            mass = sum(kids[tok] for tok in copied)
            for tok in kids:
                kids[tok] *= min(1.0, 0.99 / mass) if tok in copied else min(1.0, (1 - min(mass, 0.99)) / (1 - head_q))
        for tok, f in kids.items():
            value[path + (tok,)] = value[path] * f
        return [path + (tok,) for tok in kids]

    return max(1.0 + sum(value[v] for v in sub) for sub in connected_subtrees(children, (), budget - 1))


def random_lookup(vocab, length, share=0.6):
    """A deterministic stand-in for `CopyTrie.lookup`: a random trie (or None) per path, the same on every call."""
    cache = {}

    def lookup(path):
        if path not in cache:
            rng = random.Random(str(path))
            cache[path] = (
                random_trie(rng.randrange(10**6), vocab, spans=2, length=length) if rng.random() < share else None
            )
        return cache[path]

    return lookup


def test_hybrid_optimal_equals_brute_force_and_batched_equals_reference():
    for seed in range(40):
        child_probs, trie = drafter(seed, vocab=5), random_trie(seed, vocab=5, length=4)
        for budget in (4, 6):
            ref = optimal_tree(child_probs, 0, budget, depth=2, top_k=2, copies=trie)
            assert ref.expected_tokens == pytest.approx(brute_force_hybrid(child_probs, trie, budget, 2, 2), abs=1e-12)
            assert_children_sum_to_at_most_one(ref)
    for seed in range(30):
        child_probs, trie = drafter(seed, vocab=12), random_trie(seed, vocab=12, spans=4, length=9)
        assert_batched_equals_reference(child_probs, trie, seed)


def assert_batched_equals_reference(child_probs, trie, seed):
    """Both batched searches build their reference form's tree (20 nodes, depth 3, top-k 3); returns them."""
    trees = {}
    for search, reference in ((optimal_search, optimal_tree), (eagle2_search, eagle2_tree)):
        ref = reference(child_probs, 0, 20, depth=3, top_k=3, copies=trie)
        fast = trees[search] = search(path_expand(child_probs), 0, 20, depth=3, top_k=3, copies=trie)
        assert paths_of(fast) == paths_of(ref), (seed, search.__name__)
        assert fast.expected_tokens == pytest.approx(ref.expected_tokens, abs=1e-12)
        assert copy_info_by_path(fast) == copy_info_by_path(ref)
        assert_children_sum_to_at_most_one(fast)
    return trees


def assert_children_sum_to_at_most_one(tree):
    """At most one child of a node is accepted: its children's estimates (head and copied) sum to at most 1."""
    for u, kids in enumerate(tree.children()):
        assert sum(float(tree.draft_probs[c]) for c in kids) <= 1 + 1e-9, (u, tree.draft_probs[kids].tolist())


def copy_info_by_path(tree):
    return {tuple(tree.tokens[tree.path_to(v)].tolist()): tree.copy_info[v] for v in range(len(tree))}


def test_copies_looked_up_under_head_nodes_equal_brute_force_and_batched_equals_reference():
    for seed in range(40):
        child_probs, trie = drafter(seed, vocab=5), random_trie(seed, vocab=5, length=3)
        trie.lookup = random_lookup(5, 3)
        for budget in (4, 6):
            ref = optimal_tree(child_probs, 0, budget, depth=2, top_k=2, copies=trie)
            assert ref.expected_tokens == pytest.approx(brute_force_hybrid(child_probs, trie, budget, 2, 2), abs=1e-12)
    grew = 0
    for seed in range(30):
        child_probs, trie = drafter(seed, vocab=12), random_trie(seed, vocab=12, spans=4, length=9)
        trie.lookup = random_lookup(12, 6)
        for search, fast in assert_batched_equals_reference(child_probs, trie, seed).items():
            plain = copy_trie_without_lookup(trie)
            grew += (
                fast.expected_tokens
                > search(path_expand(child_probs), 0, 20, depth=3, top_k=3, copies=plain).expected_tokens + 1e-9
            )
    assert grew > 10  # the looked-up copies are chosen, not only allowed


def copy_trie_without_lookup(trie):
    return CopyTrie(trie.tokens, trie.parents, trie.factors, trie.info, trie.depths)


def test_a_copied_token_equal_to_a_head_candidate_is_one_node_and_copies_reach_past_the_head():
    vocab = 6

    def child_probs(path):  # the head always prefers token 1, then 2
        p = torch.full((vocab,), 0.02, dtype=torch.float64)
        p[1], p[2] = 0.6, 0.32
        return p

    trie = CopyTrie(
        [-1, 2, 3, 4, 5, 3, 2, 1, 4],
        [-1, 0, 1, 2, 3, 4, 5, 6, 7],
        [1.0] + [0.9] * 8,
        [None] + [(4, j) for j in range(8)],
        [0, 1, 2, 3, 4, 5, 6, 7, 8],
    )
    tree = optimal_search(path_expand(child_probs), 0, budget=12, depth=2, top_k=2, copies=trie)
    kids = tree.children()
    assert sorted(tree.tokens[kids[0]].tolist()) == [1, 2]  # the copy's 2 merged with the head's 2
    two = next(c for c in kids[0] if int(tree.tokens[c]) == 2)
    # Both propose 2: 1 - (1 - 0.9)(1 - 0.32), more than either alone
    assert float(tree.draft_probs[two]) == pytest.approx(0.932) and tree.copy_info[two] == (4, 0, True)
    one = next(c for c in kids[0] if int(tree.tokens[c]) == 1)
    # At most one child is accepted: the head's 1 keeps its share of what the copy leaves, 0.6 (1 - 0.932) / (1 - 0.32).
    assert tree.copy_info[one] is None and float(tree.draft_probs[one]) == pytest.approx(0.6 * 0.068 / 0.68)
    assert tree.depth == 8  # the copied span runs past the head's depth 2
    assert tree.tokens[tree.path_to(int(tree.depths.argmax()))].tolist() == [0, 2, 3, 4, 5, 3, 2, 1, 4]
    # Siblings stay distinct (DraftTree refuses repeats), and a greedy target that follows the copy accepts it all.
    logits = torch.full((len(tree), vocab), -5.0)
    path = tree.path_to(int(tree.depths.argmax()))
    for u, v in zip(path, path[1:]):
        logits[u, int(tree.tokens[v])] = 5.0
    assert accept_tree(tree, logits)[0] == path
    # Without a head (prompt lookup alone), the trie is the tree.
    alone = optimal_search(None, 0, budget=60, depth=6, top_k=10, copies=trie)
    assert len(alone) == len(trie) and alone.depth == 8


def test_a_head_candidate_of_probability_zero_does_not_merge_with_a_copy():
    """top-k can return tokens the head gives probability 0; a copy of such a token is the copy's alone (the
    reference search makes it a copy-only node), not 'proposed by both'."""
    from eagletree.search import eagle2_search

    def child_probs(path):
        return torch.tensor([0.0, 0.7, 0.3, 0.0, 0.0], dtype=torch.float64)

    trie = CopyTrie([-1, 3], [-1, 0], [1.0, 0.9], [None, (4, 0)], [0, 1])
    for search in (optimal_search, eagle2_search):
        tree = search(path_expand(child_probs), 0, budget=6, depth=1, top_k=4, copies=trie)
        three = next(c for c in tree.children()[0] if int(tree.tokens[c]) == 3)
        assert tree.copy_info[three] == (4, 0), search.__name__  # (was (4, 0, True))


def test_calibration_learns_from_verified_trees_and_round_trips(tmp_path):
    cal = CopyCalibration(max_len=3, strength=2.0)
    trie = CopyTrie([-1, 4, 5, 6], [-1, 0, 1, 2], [1.0, 0.5, 0.5, 0.5], [None, (2, 0), (2, 1), (2, 2)], [0, 1, 2, 3])
    tree = optimal_search(None, 9, budget=10, depth=1, top_k=1, copies=trie)
    for _ in range(6):  # the first two copied tokens accepted, the third rejected
        cal.update(tree, [0, 1, 2])
    rate = cal.rate()
    assert rate[2, 0] == pytest.approx((6 + 1) / 8) and rate[2, 2] == pytest.approx(1 / 8)
    assert rate[0, 0] == pytest.approx(0.5)  # untried cells keep the prior
    cal.update(tree, [0])  # the first one rejected: the later ones were never tried
    assert cal.tried[2].tolist() == [7, 6, 6]
    tree.copy_info[1] = (2, 0, True)  # the head proposed it too: not a copy's own success
    cal.update(tree, [0, 1])
    assert cal.tried[2].tolist() == [7, 7, 6] and cal.accepted[2].tolist() == [6, 6, 0]
    cal.save(tmp_path / "c.json")
    back = CopyCalibration.load(tmp_path / "c.json")
    assert torch.allclose(back.prior, cal.measured().clamp(0.01, 0.99)) and back.max_len == 3
    assert back.prior[2].tolist() == pytest.approx(
        [(6 + 1) / 9, (6 + 2 * 7 / 9) / 9, (0 + 2 * float(back.prior[2, 1])) / 8]
    )
    assert back.prior[0].tolist() == pytest.approx([0.5] * 3)  # never tried: the prior all along
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a copy calibration file"):
        CopyCalibration.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="strength must be > 0"):
        CopyCalibration(strength=0)
    with pytest.raises(ValueError, match=r"prior must be \[5, 3\]"):
        CopyCalibration(max_len=3, prior=[[0.5] * 4] * 5)
    # A table measured with other match bins values other matches: refused, naming the fix.
    (tmp_path / "other.json").write_text(json.dumps({"match_bins": [1, 2, 3, 4, 8, 16], "rate": [[0.5] * 3] * 6}))
    with pytest.raises(
        ValueError, match=r"match bins \[1, 2, 3, 4, 8, 16\], expected \[1, 2, 3, 4, 8\].*calibrate-copy"
    ):
        CopyCalibration.load(tmp_path / "other.json")
    # damaged tables are one error naming the file (they crashed generate: IndexError, TypeError)
    bins = [1, 2, 3, 4, 8]
    for data, message in (
        ({"match_bins": bins, "rate": []}, "rate must be a table"),
        ({"match_bins": 5, "rate": [[0.5]] * 5}, "match bins 5, expected"),
        ({"match_bins": bins, "rate": [[]] * 5}, "at least one position"),
        ({"match_bins": bins, "rate": [[0.5, 0.5], [0.5]] * 2 + [[0.5]]}, "c.json"),
    ):
        (tmp_path / "c.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            CopyCalibration.load(tmp_path / "c.json")

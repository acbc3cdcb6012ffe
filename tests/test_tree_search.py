import hashlib
import math

import pytest
import torch

from eagletree.search import (
    Calibrator,
    LatencyProfile,
    acceptance_pairs,
    calibration_report,
    chain_shape,
    choices_shape,
    choose_budget,
    choose_depth_and_budget,
    eagle2_search,
    eagle2_tree,
    optimal_search,
    optimal_tree,
    path_expand,
    sequoia_tree,
    static_search,
    static_tree,
)
from eagletree.verify import accept_tree


def drafter(seed: int, vocab: int, sharpness: float = 2.0, ties: bool = False):
    """child_probs(path): a random distribution per path; with ties, some paths are certain (prob 1.0)."""

    def child_probs(path):
        digest = hashlib.sha256(f"{seed}/{path}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        if ties and digest[8] % 3 == 0:
            p = torch.zeros(vocab, dtype=torch.float64)
            p[digest[9] % vocab] = 1.0
            return p
        return torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * sharpness, -1)

    return child_probs


def connected_subtrees(children, root, limit):
    """Every connected subtree containing `root` with at most `limit` nodes besides the root (each once)."""

    def grow(chosen, frontier):
        yield chosen
        if len(chosen) == limit:
            return
        for i, v in enumerate(frontier):
            yield from grow(chosen + [v], frontier[i + 1 :] + children(v))

    yield from grow([], children(root))


def brute_force_best(child_probs, budget, depth, top_k):
    """Max of 1 + sum of path products over all connected trees of the top_k-restricted drafter tree."""
    value = {(): 1.0}

    def children(path):
        if len(path) >= depth:
            return []
        p = child_probs(path)
        q, t = torch.topk(p, min(top_k, p.numel()))
        kids = [path + (int(x),) for x, pr in zip(t, q) if pr > 0]
        for kid, pr in zip(kids, q):
            value[kid] = value[path] * float(pr)
        return kids

    return max(1.0 + sum(value[v] for v in sub) for sub in connected_subtrees(children, (), budget - 1))


def paths_of(tree):
    return {tuple(tree.tokens[tree.path_to(v)].tolist()) for v in range(len(tree))}


def test_optimal_equals_brute_force_and_beats_eagle2():
    rng = torch.Generator().manual_seed(0)
    for case in range(200):
        vocab, budget, depth, top_k = (
            int(torch.randint(lo, hi + 1, (1,), generator=rng)) for lo, hi in ((2, 6), (1, 8), (1, 4), (1, 3))
        )
        child_probs = drafter(case, vocab, sharpness=float(torch.rand((), generator=rng)) * 4, ties=case % 4 == 0)
        best = optimal_tree(child_probs, 0, budget, depth, top_k)
        exact = brute_force_best(child_probs, budget, depth, top_k)
        assert abs(best.expected_tokens - exact) <= 1e-9, (case, vocab, budget, depth, top_k)
        assert len(best) <= budget and best.depth <= depth
        eagle = eagle2_tree(child_probs, 0, budget, depth, top_k)
        assert eagle.expected_tokens <= best.expected_tokens + 1e-12


def test_certain_children_still_give_a_connected_tree():
    certain = lambda path: torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)  # noqa: E731
    for search in (optimal_tree, eagle2_tree):
        tree = search(certain, 0, budget=5, depth=4, top_k=3)
        assert tree.tokens.tolist() == [0, 1, 1, 1, 1] and tree.parents.tolist() == [-1, 0, 1, 2, 3]
        assert tree.expected_tokens == 5.0


def test_eagle2_follows_the_published_expand_and_rerank():
    """Level 1: the root's top_k; later levels: children of the top_k nodes by global value only."""
    probs = {(): [0.6, 0.3, 0.1], (0,): [0.5, 0.4, 0.1], (1,): [0.9, 0.05, 0.05], (2,): [1.0, 0.0, 0.0]}
    child_probs = lambda path: torch.tensor(probs.get(path, [0.34, 0.33, 0.33]), dtype=torch.float64)  # noqa: E731
    tree = eagle2_tree(child_probs, 7, budget=5, depth=2, top_k=2)
    # level 1 drafts (0) .6 and (1) .3; level 2 expands both: (0,0) .30 (0,1) .24 (1,0) .27 (1,1) .015
    assert paths_of(tree) == {(7,), (7, 0), (7, 1), (7, 0, 0), (7, 1, 0)}
    assert tree.expected_tokens == pytest.approx(1 + 0.6 + 0.3 + 0.3 + 0.27)
    # the optimal tree may keep nodes EAGLE-2 never drafts (children outside the top_k frontier)
    assert optimal_tree(child_probs, 7, budget=5, depth=2, top_k=2).expected_tokens >= tree.expected_tokens


@pytest.mark.parametrize("seed", range(8))
def test_batched_search_builds_the_reference_tree(seed):
    child_probs = drafter(100 + seed, vocab=50, sharpness=3.0)
    for budget, depth, top_k in [(20, 5, 4), (60, 6, 10), (8, 3, 2), (1, 2, 2)]:
        ref, fast = (
            eagle2_tree(child_probs, 3, budget, depth, top_k),
            eagle2_search(path_expand(child_probs), 3, budget, depth, top_k),
        )
        assert paths_of(ref) == paths_of(fast) and fast.expected_tokens == pytest.approx(ref.expected_tokens, abs=1e-12)
        ref, fast = (
            optimal_tree(child_probs, 3, budget, depth, top_k),
            optimal_search(path_expand(child_probs), 3, budget, depth, top_k),
        )
        assert paths_of(ref) == paths_of(fast) and fast.expected_tokens == pytest.approx(ref.expected_tokens, abs=1e-12)
    shape = sequoia_tree([0.6, 0.2, 0.1], budget=16, depth=5)
    assert paths_of(static_tree(child_probs, 3, shape)) == paths_of(static_search(path_expand(child_probs), 3, shape))


def test_batched_search_calls_the_drafter_once_per_level():
    calls = []
    expand = path_expand(drafter(1, vocab=30))

    def counting(nodes, tokens, parents, level):
        calls.append((level, nodes.numel()))
        return expand(nodes, tokens, parents, level)

    eagle2_search(counting, 0, budget=60, depth=6, top_k=10)
    assert [level for level, _ in calls] == [1, 2, 3, 4, 5, 6]
    assert [n for _, n in calls][:4] == [1, 10, 10, 10]


def test_nothing_is_drafted_under_nodes_worth_less_than_the_budgets_last():
    """Once budget-1 nodes are drafted, a frontier node worth less than the last of them cannot be chosen
    (nor its descendants): it is not expanded, and the tree is still the reference's."""
    child_probs = drafter(1, vocab=30)
    for budget in (8, 60):
        calls = []
        expand = path_expand(child_probs)

        def counting(nodes, tokens, parents, level):
            calls.append(nodes.numel())
            return expand(nodes, tokens, parents, level)

        tree = eagle2_search(counting, 0, budget=budget, depth=6, top_k=10)
        assert paths_of(tree) == paths_of(eagle2_tree(child_probs, 0, budget=budget, depth=6, top_k=10))
        # unpruned: 1 + 10 * 5 = 51 frontier nodes
        assert sum(calls) == {8: 10, 60: 38}[budget], calls


def test_min_gain_stops_drafting_once_a_level_cannot_pay():
    expand = path_expand(drafter(5, vocab=30, sharpness=1.0))  # flat: values shrink fast with depth
    levels = []

    def counting(nodes, tokens, parents, level):
        levels.append(level)
        return expand(nodes, tokens, parents, level)

    full = optimal_search(counting, 0, budget=60, depth=6, top_k=4)
    drafted = len(levels)  # (the sixth level: none of the fifth's nodes is worth a place among the best 59)
    assert levels == [1, 2, 3, 4, 5]
    levels.clear()
    cut = optimal_search(counting, 0, budget=60, depth=6, top_k=4, min_gain=0.2)
    assert 1 < len(levels) < drafted and cut.depth <= len(levels)
    # Up to the levels drafted, the tree is the optimum of that depth.
    again = optimal_search(expand, 0, budget=60, depth=len(levels), top_k=4)
    assert paths_of(again) == paths_of(cut)
    assert optimal_search(expand, 0, budget=60, depth=6, top_k=4, min_gain=0.0).expected_tokens == full.expected_tokens


def brute_force_static(p, budget, depth):
    """Best static shape by enumeration: connected subtrees of the rank tree whose children use ranks 0..m-1."""
    k = len(p)
    children = lambda path: [path + (r,) for r in range(k)] if len(path) < depth else []  # noqa: E731
    best = 0.0
    for sub in connected_subtrees(children, (), budget - 1):
        nodes = set(sub)
        if any(path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in nodes for path in nodes):
            continue  # a gap in the ranks
        best = max(best, 1.0 + sum(math.prod(p[r] for r in path) for path in nodes))
    return best


def test_sequoia_equals_brute_force_over_static_shapes():
    rng = torch.Generator().manual_seed(5)
    for _ in range(40):
        k = int(torch.randint(1, 4, (1,), generator=rng))
        p = sorted(torch.rand(k, generator=rng).tolist(), reverse=True)
        if _ % 5 == 0:
            p = torch.rand(k, generator=rng).tolist()  # unsorted acceptance: the rank constraint matters
        budget, depth = int(torch.randint(1, 8, (1,), generator=rng)), int(torch.randint(1, 5, (1,), generator=rng))
        shape = sequoia_tree(p, budget, depth)
        assert shape.expected_tokens == pytest.approx(brute_force_static(p, budget, depth), abs=1e-12)
        assert len(shape.parents) <= budget and shape.depth <= depth
        value = [1.0]
        for i in range(1, len(shape.parents)):
            value.append(value[shape.parents[i]] * p[shape.ranks[i]])
        assert sum(value) == pytest.approx(shape.expected_tokens, abs=1e-12)


def test_chain_and_choice_shapes():
    assert chain_shape(3).parents == [-1, 0, 1, 2] and chain_shape(3).ranks == [-1, 0, 0, 0]
    shape = choices_shape([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    assert shape.parents == [-1, 0, 0, 1, 1, 3] and shape.ranks == [-1, 0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match=r"choice \(1, 0\) has no parent \(1,\)"):
        choices_shape([(0,), (1, 0)])
    tree = static_tree(lambda path: torch.tensor([0.1, 0.7, 0.2], dtype=torch.float64), 9, shape)
    assert tree.tokens.tolist() == [9, 1, 2, 1, 2, 1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(budget=0), "budget must be an integer >= 1, got 0"),
        (dict(depth=0), "depth must be an integer >= 1, got 0"),
        (dict(top_k=0), "top_k must be an integer >= 1, got 0"),
        (dict(budget=2.5), "budget must be an integer >= 1, got 2.5"),
    ],
)
def test_bad_search_arguments(kwargs, message):
    args = dict(budget=8, depth=3, top_k=2) | kwargs
    for search in (eagle2_tree, optimal_tree):
        with pytest.raises(ValueError, match=message):
            search(drafter(0, 5), 0, **args)


@pytest.mark.parametrize(
    "probs, message",
    [
        ([0.5, -0.1, 0.6], "negative probability -0.1"),
        ([0.5, float("nan"), 0.5], "contains NaN"),
        ([0.5, 0.2, 0.1], "sums to 0.800000; expected 1"),
    ],
)
def test_bad_distributions(probs, message):
    bad = lambda path: torch.tensor(probs, dtype=torch.float64)  # noqa: E731
    for search in (eagle2_tree, optimal_tree):
        with pytest.raises(ValueError, match=message):
            search(bad, 0, 8, 3, 2)
    with pytest.raises(ValueError, match=message):
        eagle2_search(path_expand(bad), 0, 8, 3, 2)
    with pytest.raises(ValueError, match="accept_by_rank must hold probabilities"):
        sequoia_tree([0.5, 1.5], 8, 3)


def test_choose_budget_maximizes_tokens_per_second():
    profile = LatencyProfile([1, 16, 64], [0.060, 0.090, 0.180], draft_s_per_level=0.004)
    assert float(profile.verify(40)) == pytest.approx(0.135)
    assert float(profile.verify(128)) == pytest.approx(0.180 + 64 * (0.09 / 48))
    values = torch.tensor([0.9, 0.8, 0.5] + [0.05] * 60, dtype=torch.float64)
    n, expected, rate = choose_budget(values, profile, depth=5)
    brute = max(range(1, 65), key=lambda m: (1 + float(values[: m - 1].sum())) / float(profile.step_time(m, 5)))
    assert n == brute and expected == pytest.approx(1 + float(values[: n - 1].sum()))
    assert n < 64  # the 5% nodes cost more than they bring on this profile
    (depth, budget), _ = choose_depth_and_budget({(4, 16): 2.0, (6, 60): 2.6, (6, 16): 2.1}, profile)
    assert (depth, budget) == (4, 16)


def test_profile_saves_loads_and_reports_bad_files(tmp_path):
    profile = LatencyProfile([1, 8], [0.05, 0.07], draft_s_per_level=0.01, device="cpu", model="m")
    profile.save(tmp_path / "p.json")
    assert LatencyProfile.load(tmp_path / "p.json") == profile
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json' is not JSON .*expected a LatencyProfile JSON"):
        LatencyProfile.load(tmp_path / "bad.json")
    (tmp_path / "garbage.npz").write_bytes(b"PK\x03\x04\xff\xfe\x00binary")  # plan --profile garbage.npz
    with pytest.raises(ValueError, match="garbage.npz' is not text .*expected a LatencyProfile JSON"):
        LatencyProfile.load(tmp_path / "garbage.npz")
    for missing, what in ((tmp_path / "nope.json", "no such file"), (tmp_path, "a folder")):
        with pytest.raises(ValueError, match=f"latency profile .*: {what}; expected"):
            LatencyProfile.load(missing)
    with pytest.raises(ValueError, match="one time per size"):
        LatencyProfile([1, 2], [0.1])
    calls = []
    got = LatencyProfile.load_or_measure(tmp_path / "q.json", lambda: calls.append(1) or profile)
    assert got == profile and LatencyProfile.load_or_measure(tmp_path / "q.json", lambda: 1 / 0) == profile
    assert calls == [1]


def simulate(seed, steps, vocab=8):
    """Overconfident drafter vs a synthetic target, verified by the real acceptance rule at T=1."""
    g = torch.Generator().manual_seed(seed)
    target = lambda path: torch.softmax(
        torch.randn(vocab, generator=torch.Generator().manual_seed(hash(path) % 2**31)) * 1.5, -1
    )  # noqa: E731
    draft = lambda path: torch.softmax(torch.log(target(path)) * 2.5, -1).double()  # noqa: E731
    logged = []
    for s in range(steps):
        root = (s % vocab,)
        tree = eagle2_tree(lambda p: draft(root + p), root[0], budget=10, depth=4, top_k=3)
        logits = torch.stack(
            [torch.log(target(root + tuple(tree.tokens[tree.path_to(v)][1:].tolist()))) for v in range(len(tree))]
        )
        accepted, _ = accept_tree(tree, logits, temperature=1.0, generator=g)
        logged.append((tree, accepted))
    return logged


def test_calibration_makes_predicted_tokens_per_pass_match_measured():
    train, test = simulate(0, 600), simulate(1, 600)
    probs, hits = [], []
    for tree, accepted in train:
        q, y = acceptance_pairs(tree, accepted)
        probs += q
        hits += y
    raw = calibration_report(test, Calibrator.fit(probs, hits, "identity"))
    assert raw["error_raw"] > 0.10  # the overconfident drafter over-predicts
    for method in ("isotonic", "temperature"):
        report = calibration_report(test, Calibrator.fit(probs, hits, method))
        assert abs(report["error_calibrated"]) < 0.05, report
        assert abs(report["error_calibrated"]) < abs(report["error_raw"]) / 2
    with pytest.raises(ValueError, match="not one of"):
        Calibrator.fit(probs, hits, "platt")


def test_a_static_tree_cut_near_the_end_keeps_exactly_its_shallow_nodes():
    """Near the end of a generation a static shape is cut to the depth still wanted; the cut takes a prefix,
    so the shape's nodes must come by depth (Sequoia's came depth first: the cut kept deep nodes)."""
    from eagletree.search.searchers import make_searcher

    for shape in (sequoia_tree([0.6, 0.2, 0.1], budget=16, depth=5), make_searcher("sequoia", 16, 5).shape):
        depth = [0] * len(shape.parents)
        for i in range(1, len(depth)):
            depth[i] = depth[shape.parents[i]] + 1
        assert depth == sorted(depth) and shape.depth >= 3
    searcher = make_searcher("sequoia", budget=16, depth=5)
    expand = path_expand(drafter(7, vocab=30))
    full = searcher.search(expand, 3, 5)
    for d in (1, 2):
        cut = searcher.search(path_expand(drafter(7, vocab=30)), 3, d)
        assert len(cut.tokens) == 1 + sum(1 for x in depth[1:] if x <= d)
        assert paths_of(cut) == {p for p in paths_of(full) if len(p) <= d + 1}  # (paths hold the root)


@pytest.mark.parametrize("mapped", [False, True])
def test_a_batch_reads_its_top_k_back_at_once_and_draws_the_same_trees(mapped):
    """drive_batch(top_k=...) checks, ranks and reads back a level's distributions for every search together; the
    trees are those each search draws from its own distributions, with a draft vocabulary mapped alike."""
    from eagletree.search.batched import SearchSpec, drive_batch, search_steps

    vocab = 7
    token_map = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:vocab] if mapped else None
    expands = [path_expand(drafter(seed, vocab)) for seed in range(3)]

    def expand_batch(requests):
        return [expands[i](*rest).float() for i, *rest in requests]

    def trees(**batched):
        searches = [
            search_steps(True, 0, SearchSpec(budget, depth, 3, budget - 1, "cpu", token_map))
            for budget, depth in ((8, 3), (12, 4), (2, 1))
        ]
        return drive_batch(searches, expand_batch, **batched)

    for alone, together in zip(trees(), trees(top_k=3, token_map=token_map)):
        assert torch.equal(alone.tokens, together.tokens) and torch.equal(alone.parents, together.parents)
        assert torch.equal(alone.values, together.values)
        if mapped:  # drafted ids became target ids
            assert set(together.tokens[1:].tolist()) <= set(token_map.tolist())

    def nan_batch(requests):
        probs = expand_batch(requests)
        probs[-1][0, 0] = float("nan")
        return probs

    searches = [search_steps(True, 0, SearchSpec(8, 3, 3, 7, "cpu")) for _ in range(2)]
    with pytest.raises(ValueError, match="drafter output at level 1 contains NaN"):
        drive_batch(searches, nan_batch, top_k=3)


def test_softmax_rows_are_checked_for_nan_on_the_read_back():
    """The batch drafter's levels (`SoftmaxRows`) skip the two passes of check_distribution: the same top-k lists
    as the checked path, and a NaN anywhere in a row still raises, named as the check names it."""
    from eagletree.draft.batch_drafter import SoftmaxRows
    from eagletree.search.readback import top_k_lists

    g = torch.Generator().manual_seed(0)
    probs = [torch.softmax(torch.randn(n, 50, generator=g), -1) for n in (3, 1, 2)]
    token_map = torch.randperm(200, generator=g)[:50]
    checked = top_k_lists(list(probs), 4, 2, token_map)
    fast = top_k_lists(SoftmaxRows(probs), 4, 2, token_map)
    assert [t.lists for t in checked] == [t.lists for t in fast]
    probs[1][0, 17] = float("nan")
    with pytest.raises(ValueError, match="drafter output at level 2 contains NaN"):
        top_k_lists(SoftmaxRows(probs), 4, 2)
    bad = [torch.tensor([[0.5, 0.2, 0.1]])]  # unmarked rows get the full check
    with pytest.raises(ValueError, match="sums to 0.800000"):
        top_k_lists(bad, 2, 1)


def test_a_level_broadcast_from_one_row_is_ranked_once(monkeypatch):
    """A block or Medusa head's level is one distribution after every node (an expanded view, stride 0): the same
    top-k lists as the rows materialized, from one top-k over that row (and a NaN in it still raises)."""
    from eagletree.draft.batch_drafter import SoftmaxRows
    from eagletree.search.readback import top_k_lists

    g = torch.Generator().manual_seed(1)
    level = torch.softmax(torch.randn(50, generator=g), -1)
    other = torch.softmax(torch.randn(3, 50, generator=g), -1)
    token_map = torch.randperm(200, generator=g)[:50]
    requests = [level.expand(4, -1), other, level.expand(1, -1), level[None].expand(6, -1)]
    want = top_k_lists([r.contiguous() for r in requests], 5, 2, token_map)
    ranked = []
    original = torch.topk
    monkeypatch.setattr(torch, "topk", lambda x, *a, **k: ranked.append(x.shape[0]) or original(x, *a, **k))
    for marked in (list, SoftmaxRows):
        got = top_k_lists(marked(requests), 5, 2, token_map)
        assert [t.lists for t in got] == [t.lists for t in want]
        assert ranked.pop() == 1 + 3 + 1 + 1  # one row for each broadcast request
    broken = level.clone()
    broken[7] = float("nan")
    with pytest.raises(ValueError, match="contains NaN"):
        top_k_lists(SoftmaxRows([broken.expand(3, -1)]), 5, 1)


def test_search_trees_built_unchecked_pass_the_checks():
    """The searches and DraftTree.prefix build their trees with DraftTree.trusted (no checks, for speed); every
    such tree is one the checked constructor accepts, with the same depths."""
    from eagletree.verify import DraftTree

    child_probs = drafter(3, 6)
    for tree in (
        eagle2_search(path_expand(child_probs), 0, 20, 4, 3),
        optimal_search(path_expand(child_probs), 0, 20, 4, 3),
    ):
        for t in (tree, tree.prefix(7)):
            checked = DraftTree(t.tokens, t.parents, draft_probs=t.draft_probs)
            assert torch.equal(checked.depths, t.depths) and checked.depth == t.depth
            assert torch.equal(checked.draft_probs, t.draft_probs)

import pytest
import torch

from eagletree.verify import DraftTree, TreeError

from helpers import random_tree


def brute_force_mask(parents, prefix_len):
    n = len(parents)
    mask = torch.zeros(n, prefix_len + n, dtype=torch.bool)
    for v in range(n):
        mask[v, :prefix_len] = True
        u = v
        while u != -1:
            mask[v, prefix_len + u] = True
            u = parents[u]
    return mask


def brute_force_depth(parents):
    depth = []
    for v in range(len(parents)):
        d, u = 0, parents[v]
        while u != -1:
            d, u = d + 1, parents[u]
        depth.append(d)
    return depth


@pytest.mark.parametrize("seed", range(6))
def test_mask_and_positions_match_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    for n, depth in [(1, 0), (2, 1), (10, 9), (64, 8), (64, 3), (40, 1)]:
        tree = random_tree(n, depth, 50, g)
        parents = tree.parents.tolist()
        assert torch.equal(tree.attention_mask(7), brute_force_mask(parents, 7))
        assert tree.position_ids(7).tolist() == [7 + d for d in brute_force_depth(parents)]
        assert tree.depth == max(brute_force_depth(parents))


def test_paths_children_and_expected_tokens():
    tree = DraftTree([5, 1, 2, 3, 4], [-1, 0, 0, 1, 1], draft_probs=[1.0, 0.5, 0.25, 0.5, 0.1])
    assert tree.paths() == [[0, 2], [0, 1, 3], [0, 1, 4]]
    assert tree.children() == [[1, 2], [3, 4], [], [], []]
    assert tree.path_products().tolist() == pytest.approx([1.0, 0.5, 0.25, 0.25, 0.05])
    assert tree.expected_tokens == pytest.approx(1 + 0.5 + 0.25 + 0.25 + 0.05)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokens=[], parents=[]), "empty tree"),
        (dict(tokens=[1, 2], parents=[-1]), "tokens has 2 nodes but parents has 1"),
        (dict(tokens=[1, 2], parents=[0, 0]), "node 0 is the root and must have parent -1, got 0"),
        (dict(tokens=[1, 2, 3], parents=[-1, 0, -1]), "node 2 has parent -1: a tree has one root"),
        (dict(tokens=[1, 2, 3], parents=[-1, 2, 0]), r"node 1 has parent 2; expected a node index in \[0, 0\]"),
        (dict(tokens=[1, 2, 3], parents=[-1, 0, 7]), r"node 2 has parent 7; expected a node index in \[0, 1\]"),
        (dict(tokens=[1, -4], parents=[-1, 0]), "node 1 has token id -4"),
        (dict(tokens=[1, 99], parents=[-1, 0], vocab_size=50), "node 1 has token id 99; expected 0 <= id < 50"),
        (
            dict(tokens=[1, 2], parents=[-1, 0], draft_probs=[1.0, 1.5]),
            r"node 1 has draft probability 1.5; expected a value in \[0, 1\]",
        ),
        (dict(tokens=[1, 2], parents=[-1, 0], draft_probs=[1.0, float("nan")]), "node 1 has draft probability nan"),
        (dict(tokens=[1, 2], parents=[-1, 0], draft_probs=[1.0]), "draft_probs has 1 entries for 2 nodes"),
        (dict(tokens=[1, 2, 2], parents=[-1, 0, 0]), "node 2 repeats token 2 of a sibling under parent 0"),
        (dict(tokens=[1, 2], parents=[-1, 0], sampled=True), "a sampled tree needs draft_dists"),
        (
            dict(tokens=[1, 2], parents=[-1, 0], sampled=True, draft_dists=torch.tensor([[0.5, 0.5, 0.0]] * 2)),
            "node 1 \\(token 2\\) has draft probability 0",
        ),
        (dict(tokens=[1, 2], parents=[-1, 0], draft_dists=torch.ones(3, 4) / 4), r"draft_dists must be \[N=2, vocab\]"),
        (dict(tokens=[[1, 2]], parents=[-1, 0]), "tokens must be 1-D"),
        (
            dict(tokens=[0, 1, 1], parents=[-1, 0, 0], sampled=True, draft_dists=torch.tensor([[0.2, 0.8]] * 3)),
            "node 2 repeats token 1 of a sibling under parent 0",
        ),
        (
            dict(tokens=[0, 1], parents=[-1, 0], sampled=True, draft_dists=torch.tensor([[0.2, float("inf")]] * 2)),
            "draft_dists holds NaN, infinite or negative",
        ),
    ],
)
def test_validation_errors(kwargs, message):
    with pytest.raises(TreeError, match=message):
        DraftTree(**kwargs)


def test_sampled_trees_may_repeat_sibling_tokens():
    dists = torch.tensor([[0.2, 0.8], [0.5, 0.5], [0.5, 0.5]])
    tree = DraftTree([0, 1, 1], [-1, 0, 0], draft_dists=dists, sampled=True, with_replacement=True)
    assert len(tree) == 3

"""DraftTree: the nodes one target pass verifies, with their tree-attention mask and positions."""

from __future__ import annotations

import torch

from ..errors import EagletreeError


class TreeError(EagletreeError, ValueError):
    """A draft tree that is not a valid rooted tree (the message names the node and value)."""


def _as_tensor(x, dtype, name) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=dtype)
    if t.dim() != 1:
        raise TreeError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t


class DraftTree:
    """A rooted tree of draft tokens in topological order.

    Node 0 is the root: the last emitted token, not yet in the target's cache. `parents[0] == -1`
    and `parents[i] < i`. `draft_probs[i]` is the drafter's probability of node i's token given its
    parent; for `sampled=True` trees `draft_dists[u]` is the distribution u's children were drawn
    from (without replacement unless `with_replacement`).

    Set by the tree searches, None otherwise: `values` ([N] float64, each node's path value in the
    search), `node_ids` (the search's id of each node, the ids its drafter saw) and `copy_info`
    (per node: (match bin, position along the span) when a copied span proposed the node, with a third
    entry True when the head proposed it too, else None).
    """

    values: torch.Tensor | None
    node_ids: list[int] | None
    copy_info: list[tuple | None] | None

    def __init__(
        self,
        tokens,
        parents,
        draft_probs=None,
        draft_dists=None,
        sampled: bool = False,
        with_replacement: bool = False,
        vocab_size: int | None = None,
    ):
        self.tokens = _as_tensor(tokens, torch.long, "tokens")
        self.parents = _as_tensor(parents, torch.long, "parents").to(self.tokens.device)
        self.sampled = bool(sampled)
        self.with_replacement = bool(with_replacement)
        self.draft_probs = None if draft_probs is None else _as_tensor(draft_probs, torch.float64, "draft_probs")
        self.draft_dists = None if draft_dists is None else torch.as_tensor(draft_dists, dtype=torch.float32)
        self._validate(vocab_size)
        self.values = self.node_ids = self.copy_info = None
        self.depths = self._depths()  # [N] root = 0
        self.depth = int(self.depths.max())

    @classmethod
    def trusted(cls, tokens, parents, draft_probs, depths) -> DraftTree:
        """A deterministic tree whose maker guarantees what `__init__` checks (a search's selection, a prefix of a
        checked tree): built without the checks, which cost tens of microseconds of small tensor operations per
        tree, paid for every sequence of every pass. depths: each node's depth (root 0)."""
        tree = cls.__new__(cls)
        tree.tokens = torch.as_tensor(tokens, dtype=torch.long)
        tree.parents = torch.as_tensor(parents, dtype=torch.long, device=tree.tokens.device)
        tree.sampled = tree.with_replacement = False
        tree.draft_probs = None if draft_probs is None else torch.as_tensor(draft_probs, dtype=torch.float64)
        tree.draft_dists = None
        tree.values = tree.node_ids = tree.copy_info = None
        tree.depths = torch.as_tensor(depths, dtype=torch.long, device=tree.parents.device)
        tree.depth = int(tree.depths.max())
        return tree

    # -- validation ---------------------------------------------------------------------------

    def _validate(self, vocab_size):
        """Raise TreeError, naming the node and value, for the first thing wrong with the tree."""
        self._check_links()
        self._check_tokens(vocab_size)
        self._check_probs(vocab_size)
        self._check_siblings()

    def _check_links(self) -> None:
        """One root, node 0, and every other node's parent before it."""
        n = self.tokens.numel()
        if n == 0:
            raise TreeError("empty tree: a draft tree needs at least the root node")
        if self.parents.numel() != n:
            raise TreeError(f"tokens has {n} nodes but parents has {self.parents.numel()}")
        parents = self.parents.cpu()
        if int(parents[0]) != -1:
            raise TreeError(f"node 0 is the root and must have parent -1, got {int(parents[0])}")
        idx = torch.arange(n)
        roots = (parents[1:] == -1).nonzero()
        if roots.numel():
            raise TreeError(f"node {int(roots[0]) + 1} has parent -1: a tree has one root (node 0)")
        bad = ((parents[1:] < 0) | (parents[1:] >= idx[1:])).nonzero()
        if bad.numel():
            v = int(bad[0]) + 1
            raise TreeError(
                f"node {v} has parent {int(parents[v])}; expected a node index in [0, {v - 1}] (parent before child)"
            )

    def _check_tokens(self, vocab_size) -> None:
        """Token ids in [0, vocab_size)."""
        tokens = self.tokens.cpu()
        if (tokens < 0).any() or (vocab_size is not None and (tokens >= vocab_size).any()):
            v = int(((tokens < 0) | (tokens >= (vocab_size or 1 << 62))).nonzero()[0])
            raise TreeError(f"node {v} has token id {int(tokens[v])}; expected 0 <= id < {vocab_size or 'vocab size'}")

    def _check_probs(self, vocab_size) -> None:
        """draft_probs in [0, 1], draft_dists [N, vocab] of finite non-negative values, and a sampled tree's
        tokens possible under their parents' draft_dists."""
        n = self.tokens.numel()
        if self.draft_probs is not None:
            p = self.draft_probs
            if p.numel() != n:
                raise TreeError(f"draft_probs has {p.numel()} entries for {n} nodes")
            bad = (~((p >= 0) & (p <= 1))).nonzero()  # also catches NaN
            if bad.numel():
                v = int(bad[0])
                raise TreeError(f"node {v} has draft probability {float(p[v])}; expected a value in [0, 1]")
        if self.draft_dists is not None:
            d = self.draft_dists
            if d.dim() != 2 or d.shape[0] != n:
                raise TreeError(f"draft_dists must be [N={n}, vocab], got shape {tuple(d.shape)}")
            if vocab_size is not None and d.shape[1] != vocab_size:
                raise TreeError(f"draft_dists has vocab {d.shape[1]}, expected {vocab_size}")
            if not torch.isfinite(d).all() or (d < 0).any():
                raise TreeError("draft_dists holds NaN, infinite or negative probabilities")
        if self.sampled:
            if self.draft_dists is None:
                raise TreeError(
                    "a sampled tree needs draft_dists: the distribution each node's children were drawn from"
                )
            tokens, parents = self.tokens.cpu(), self.parents.cpu()
            child = torch.arange(1, n)
            q = self.draft_dists.cpu()[parents[1:], tokens[1:]]
            zero = (q <= 0).nonzero()
            if zero.numel():
                v = int(child[int(zero[0])])
                raise TreeError(
                    f"node {v} (token {int(tokens[v])}) has draft probability 0 under its parent's draft_dists"
                )

    def _check_siblings(self) -> None:
        # Top-k siblings, and siblings drawn without replacement, are distinct: a repeat would be tried twice.
        n = self.tokens.numel()
        if n > 1 and not (self.sampled and self.with_replacement):
            tokens, parents = self.tokens.cpu(), self.parents.cpu()
            key = parents[1:] * (int(tokens.max()) + 1) + tokens[1:]
            uniq, counts = torch.unique(key, return_counts=True)
            if (counts > 1).any():
                k = int(uniq[counts > 1][0])
                v = int((key == k).nonzero()[1]) + 1
                raise TreeError(
                    f"node {v} repeats token {int(tokens[v])} of a sibling under parent {int(parents[v])}; "
                    "siblings must be distinct unless sampled with replacement"
                )

    # -- structure ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.tokens.numel()

    def prefix(self, n: int) -> DraftTree:
        """The first n nodes (the searches emit them best first, and parents always come first, so it stays a
        tree), with the search's fields cut alike; the tree itself when it has at most n nodes."""
        if n >= len(self):
            return self
        if n < 1:
            raise TreeError(f"a tree prefix needs at least the root: n must be >= 1, got {n}")
        if self.sampled:
            raise TreeError("a sampled tree cannot be cut: its nodes' draws depend on their siblings")
        probs = None if self.draft_probs is None else self.draft_probs[:n]
        cut = DraftTree.trusted(self.tokens[:n], self.parents[:n], probs, self.depths[:n])  # (a checked tree's)
        cut.node_ids = (self.node_ids or list(range(len(self))))[:n]
        cut.values = None if self.values is None else self.values[:n]
        cut.copy_info = None if self.copy_info is None else self.copy_info[:n]
        return cut

    def _hop(self) -> torch.Tensor:
        hop = self.parents.clone()
        hop[0] = 0  # the root is its own parent so repeated hops stay in range
        return hop

    def _depths(self) -> torch.Tensor:
        # Repeated parent gathers: one hop per level, no per-node Python loop.
        hop, cur = self._hop(), torch.arange(len(self), device=self.parents.device)
        depths = torch.zeros(len(self), dtype=torch.long, device=self.parents.device)
        while True:
            moved = cur != 0
            if not moved.any():
                return depths
            depths += moved
            cur = hop[cur]

    def ancestors(self) -> torch.Tensor:
        """[N, N] bool: [v, u] is True when u is v or one of v's ancestors (computed once per tree)."""
        cached = self.__dict__.get("_ancestors")
        if cached is not None:
            return cached
        self._ancestors = self._build_ancestors()
        return self._ancestors

    def _build_ancestors(self) -> torch.Tensor:
        n, device = len(self), self.parents.device
        hop, cur = self._hop(), torch.arange(n, device=device)
        anc = torch.zeros(n, n, dtype=torch.bool, device=device)
        rows = torch.arange(n, device=device)
        anc[rows, cur] = True
        for _ in range(self.depth):
            cur = hop[cur]
            anc[rows, cur] = True
        return anc

    def attention_mask(self, prefix_len: int) -> torch.Tensor:
        """[N, prefix_len + N] bool: row v sees the prefix, v's root-path ancestors and v."""
        anc = self.ancestors()
        prefix = torch.ones(len(self), prefix_len, dtype=torch.bool, device=anc.device)
        return torch.cat([prefix, anc], dim=1)

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """[N] rotary positions: prefix_len + depth."""
        return self.depths + prefix_len

    def path_to(self, v: int) -> list[int]:
        """Node indices from the root to v."""
        parents = self.parents.tolist()
        path = [v]
        while parents[path[-1]] != -1:
            path.append(parents[path[-1]])
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node index paths, one per leaf, in leaf order."""
        is_parent = torch.zeros(len(self), dtype=torch.bool)
        is_parent[self.parents[1:].cpu()] = True
        return [self.path_to(v) for v in (~is_parent).nonzero().flatten().tolist()]

    def children(self) -> list[list[int]]:
        """children()[u] = u's children in draft order."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for v, u in enumerate(self.parents.tolist()[1:], start=1):
            kids[u].append(v)
        return kids

    def path_products(self) -> torch.Tensor:
        """[N] product of draft probabilities along each node's root path (root = 1)."""
        if self.draft_probs is None:
            raise TreeError("path products need draft_probs")
        logp = torch.log(self.draft_probs.clamp_min(1e-30)).to(self.parents.device)
        logp[0] = 0.0
        return torch.exp(self.ancestors().double() @ logp)

    @property
    def expected_tokens(self) -> float:
        """Predicted tokens per pass: 1 + sum of the non-root path products (`path_products`' values, multiplied
        along the parents on the host: the decoding loop asks once per pass, for a tree of tens of nodes)."""
        if self.draft_probs is None:
            raise TreeError("path products need draft_probs")
        return 1.0 + sum(self.products_along(self.draft_probs.clamp_min(1e-30).tolist())[1:])

    def products_along(self, factors: list[float]) -> list[float]:
        """Per node, the product of `factors` (one per node, host floats) over its root path, the root's left out
        (1.0 at the root): multiplied along the parents, which precede their children."""
        parents, products = self.parents.tolist(), [1.0] * len(factors)
        for v in range(1, len(factors)):
            products[v] = products[parents[v]] * factors[v]
        return products

    def to(self, device) -> DraftTree:
        """The same tree with its tensors on `device` (validation is not repeated)."""
        clone = object.__new__(DraftTree)
        clone.__dict__.update(self.__dict__)
        clone.__dict__.pop("_ancestors", None)
        for name in ("tokens", "parents", "depths", "draft_probs", "draft_dists"):
            value = getattr(self, name)
            setattr(clone, name, None if value is None else value.to(device))
        return clone

    def __repr__(self) -> str:
        return f"DraftTree(nodes={len(self)}, depth={self.depth}, sampled={self.sampled})"

"""Copy candidates: continuations of earlier text (prompt lookup) as draft-tree nodes.

Answers repeat spans of their prompt and of themselves (code restating a signature, extraction,
lists, a small model's own loops). `NgramIndex` keeps every n-gram of the committed tokens
(prompt and emitted text) with where it occurred, updated as tokens commit, so a lookup costs
the same however long the context. `CopyTrie` holds the continuations that followed the most
recent, longest matches of the context's last tokens, merged into a trie (matches that agree
share nodes, siblings are distinct), each node valued by `CopyCalibration`: the measured rate at
which a copied token was accepted given its parent was, by match length and position along the
span, learned as decoding goes.

A `store.TokenStore` (a corpus such as the target's own earlier answers) adds the continuation of the
context's longest match there to the same trie, valued like a copied span of that match length.

The tree search (`batched.search_steps` with `copies=`) grafts the trie onto the head's candidates:
a copied token equal to a head candidate is one node, and the search chooses among all of them
under the one node budget. With `copy_trie(at_nodes=True)` copies also start under the head's
best nodes: the context extended by such a node's path is looked up the same way, and what
followed is grafted under that node. Copied nodes are deterministic drafts (a point mass), which the
acceptance rules already treat exactly, so the output stays the target's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidValue

# Match-length bins: 1, 2, 3, 4-7 and 8+ tokens of context agreeing before the copied span. (A separate
# 16+ bin, matches extended to 32 tokens, measured no better: docs/results.md.)
MATCH_BINS = (1, 2, 3, 4, 8)
COPY_CALIBRATION = "copy_calibration.json"
# measured with a head drafting over the target's whole vocabulary instead of its own draft vocabulary
# (`DraftHead.widen_vocab`, `--draft-vocab full`; a GPU's auto): kept apart, so that measuring one never
# replaces the table the other drafting uses
COPY_CALIBRATION_FULL_VOCAB = "copy_calibration.full-vocab.json"


def copy_calibration_names(widened: bool) -> tuple[str, str]:
    """(the table a head drafting over its own vocabulary (widened=False) or the target's whole one reads and
    writes, the other one: the fallback when the first is missing)."""
    names = (COPY_CALIBRATION, COPY_CALIBRATION_FULL_VOCAB)
    return names[::-1] if widened else names


def copy_only(info) -> bool:
    """Whether a node's `DraftTree.copy_info` entry says a copied span alone proposed it: (match bin, position);
    a copy the head proposed too carries a third entry, and a node no span proposed has None."""
    return info is not None and len(info) == 2


def match_bin(length: int) -> int:
    """Index into MATCH_BINS of a match of `length` >= 1 tokens."""
    return sum(length >= b for b in MATCH_BINS) - 1


def bin_labels() -> list[str]:
    """MATCH_BINS as match-length ranges: '1', '2', '3', '4-7', '8+'."""
    ends = [b - 1 for b in MATCH_BINS[1:]]
    return [str(b) if e == b else f"{b}-{e}" for b, e in zip(MATCH_BINS, ends)] + [f"{MATCH_BINS[-1]}+"]


class NgramIndex:
    """Every 1..max_ngram-gram of a growing token sequence -> the positions right after it."""

    def __init__(self, tokens=(), max_ngram: int = 3, max_match: int = 16):
        if max_ngram < 1:
            raise InvalidValue(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram, self.max_match = max_ngram, max_match
        self.tokens: list[int] = []
        self.table: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens (O(max_ngram) each)."""
        for t in tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.table.setdefault(tuple(self.tokens[end - n :]), []).append(end)

    def matches(self, per_ngram: int = 8, suffix=()) -> list[tuple[int, int]]:
        """(match length, position after the match) of earlier occurrences of the context's last tokens.

        Longest first, then most recent; the length is extended backwards past max_ngram (up to
        max_match) so that calibration can tell a 3-token match from a 12-token one. `suffix`:
        tokens not committed yet (a draft node's path) that extend the context for this lookup.
        """
        tokens, n_tok, suffix = self.tokens, len(self.tokens), list(suffix)
        n_all = n_tok + len(suffix)

        def at(i):
            return tokens[i] if i < n_tok else suffix[i - n_tok]

        found: dict[int, int] = {}
        for n in range(min(self.max_ngram, n_all), 0, -1):
            ends = self.table.get(tuple(at(i) for i in range(n_all - n, n_all)), ())
            seen = 0
            for end in reversed(ends):
                if end >= n_all or end in found:
                    continue
                length = n
                while (
                    length < self.max_match and end - 1 - length >= 0 and at(end - 1 - length) == at(n_all - 1 - length)
                ):
                    length += 1
                found[end] = length
                seen += 1
                if seen >= per_ngram:
                    break
        return sorted(((length, end) for end, length in found.items()), key=lambda m: (-m[0], -m[1]))

    def continuation(self, end: int, length: int, suffix=()) -> list[int]:
        """The `length` tokens that followed position `end` (of the context extended by `suffix`);
        running into the present, the copy repeats itself."""
        tokens, n_tok, suffix, span = self.tokens, len(self.tokens), list(suffix), []
        n_all = n_tok + len(suffix)
        for pos in range(end, end + length):
            span.append((tokens[pos] if pos < n_tok else suffix[pos - n_tok]) if pos < n_all else span[pos - n_all])
        return span


class CopyCalibration:
    """P(copied token accepted | its parent accepted) by match-length bin and position along the span.

    Beta-smoothed counts: `prior` is the measured table a later run starts from (e.g. measured on
    held-out prompts and saved next to the head), worth `strength` observations per cell; each
    decoding step's outcomes are added with `update`, so the values follow the text at hand.
    The last position's cell stands for every later one too, so spans may be longer than the table.
    """

    def __init__(self, max_len: int = 16, prior=None, strength: float = 8.0, draft_vocab_size: int | None = None):
        if not strength > 0:
            raise InvalidValue(
                f"copy calibration strength must be > 0 (observations the prior is worth), got {strength!r}"
            )
        self.max_len, self.strength = max_len, float(strength)
        shape = (len(MATCH_BINS), max_len)
        self.prior = (
            torch.full(shape, 0.5, dtype=torch.float64)
            if prior is None
            else torch.as_tensor(prior, dtype=torch.float64).clone()
        )
        if self.prior.shape != shape:
            raise InvalidValue(
                f"copy calibration prior must be {list(shape)} (match bins x positions), got {list(self.prior.shape)}"
            )
        if not ((self.prior > 0) & (self.prior < 1)).all():
            raise InvalidValue("copy calibration prior values must lie in (0, 1)")
        if draft_vocab_size is not None and (
            not isinstance(draft_vocab_size, int) or isinstance(draft_vocab_size, bool) or draft_vocab_size < 1
        ):
            raise InvalidValue(
                f"copy calibration draft_vocab_size must be a token count >= 1 or None (not recorded), "
                f"got {draft_vocab_size!r}"
            )
        self.tried = torch.zeros(shape, dtype=torch.float64)
        self.accepted = torch.zeros(shape, dtype=torch.float64)
        # how many tokens the head drafted over while this was measured (None: not recorded); with more, the head
        # proposes more of the copied tokens itself, and the copies left alone are the ones it doubts
        self.draft_vocab_size = draft_vocab_size

    def rate(self) -> torch.Tensor:
        """[bins, positions] smoothed acceptance rates."""
        return (self.accepted + self.strength * self.prior) / (self.tried + self.strength)

    def update(self, tree, accepted: list[int]) -> None:
        """Count every copied node of a verified tree that was tried (its parent was accepted).

        Copies the head proposed too (merged nodes) are left out: agreeing with the head, they are
        accepted far more often than copies alone, which the table values.
        """
        if tree.copy_info is None:
            return
        on_path = set(accepted)
        parents = tree.parents.tolist()
        for v, info in enumerate(tree.copy_info):
            if not copy_only(info) or parents[v] not in on_path:
                continue
            b, j = info
            self.tried[b, j] += 1
            self.accepted[b, j] += v in on_path

    def cell(self, position: int) -> int:
        """The table's column for a copied token `position` tokens into its span."""
        return min(position, self.max_len - 1)

    def measured(self) -> torch.Tensor:
        """[bins, positions] rates for a later run's prior: each position's counts smoothed toward the
        previous position's rate (the first toward the prior), not toward a flat prior.

        Deeper positions are tried less often (their parents must be accepted first); next to each
        other they are accepted at similar rates, so a cell with few counts takes its neighbour's."""
        rate = torch.empty_like(self.prior)
        for j in range(self.max_len):
            toward = self.prior[:, 0] if j == 0 else rate[:, j - 1]
            rate[:, j] = (self.accepted[:, j] + self.strength * toward) / (self.tried[:, j] + self.strength)
        return rate

    def save(self, path) -> None:
        """Write the measured rates (`measured`: the next run's prior) with the counts behind them, atomically."""
        from ..files import write_text_atomic

        rate = self.measured().clamp(0.01, 0.99)
        write_text_atomic(
            Path(path),
            json.dumps(
                {
                    "match_bins": list(MATCH_BINS),
                    "rate": rate.tolist(),
                    "tried": self.tried.tolist(),
                    "accepted": self.accepted.tolist(),
                    "draft_vocab_size": self.draft_vocab_size,
                }
            ),
        )

    @classmethod
    def load(cls, path, strength: float = 8.0) -> CopyCalibration:
        try:
            data = json.loads(Path(path).read_text())
            rate, bins = data["rate"], data["match_bins"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidValue(
                f"{path}: not a copy calibration file (expected JSON with match_bins and rate): {e}"
            ) from None
        if not isinstance(bins, list) or bins != list(MATCH_BINS):
            raise InvalidValue(
                f"{path}: match bins {bins!r}, expected {list(MATCH_BINS)}; measure a new table with "
                "`eagletree calibrate-copy`"
            )
        if not (isinstance(rate, list) and rate and all(isinstance(row, list) and row for row in rate)):
            raise InvalidValue(
                f"{path}: rate must be a table of match bins x span positions (at least one position), "
                f"got {json.dumps(rate)[:80]}; measure a new table with `eagletree calibrate-copy`"
            )
        try:
            return cls(
                max_len=len(rate[0]), prior=rate, strength=strength, draft_vocab_size=data.get("draft_vocab_size")
            )
        except (ValueError, TypeError, RuntimeError) as e:
            raise InvalidValue(f"{path}: {e}") from None


@dataclass
class CopyTrie:
    """Copied continuations as a trie under the draft root (node 0 = the root, never a copy)."""

    tokens: list[int]
    parents: list[int]
    factors: list[float]  # calibrated P(accept | parent accepted)
    info: list[tuple[int, int] | None]  # (match bin, calibration column: `CopyCalibration.cell`) per node
    depths: list[int]
    # path (tokens after the root) -> the CopyTrie of the continuations of the context extended by
    # that path, or None; the searches graft it under the head's best nodes (`copy_trie(at_nodes=True)`).
    lookup: Callable[[tuple], CopyTrie | None] | None = None

    @property
    def depth(self) -> int:
        return max(self.depths)

    def by_level(self, level: int) -> list[int]:
        """The trie's nodes at depth `level`, in creation order."""
        if "_levels" not in self.__dict__:
            self._levels: dict[int, list[int]] = {}
            for v in range(1, len(self.tokens)):
                self._levels.setdefault(self.depths[v], []).append(v)
        return self._levels.get(level, [])

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for v in range(1, len(self.tokens)):
            kids[self.parents[v]].append(v)
        return kids


def copy_trie(
    index: NgramIndex,
    calibration: CopyCalibration,
    max_spans: int = 3,
    max_len: int | None = None,
    at_nodes: bool = False,
    store=None,
) -> CopyTrie | None:
    """The continuations (max_len tokens, default the calibration's length) of the `max_spans` best
    matches as one trie, or None when nothing matches.

    `store` (a `store.TokenStore`): the continuation of the context's longest match in that corpus is
    added too (a retrieved span), valued like a copied span of the same match length.

    at_nodes=True: the trie also looks up, for a draft node's path, the continuations of the context
    extended by it (`CopyTrie.lookup`), so copies start under head-drafted nodes too, with spans
    reaching at most max_len tokens below the root; the trie is then returned even when empty.
    """
    max_len = max_len or calibration.max_len
    rate = calibration.rate().tolist()  # (host lists: a span's nodes read it one cell at a time)
    trie = _matches_trie(index, calibration, rate, max_spans, max_len, (), store)
    if at_nodes:

        def lookup(path: tuple) -> CopyTrie | None:
            if len(path) >= max_len:
                return None
            below = _matches_trie(index, calibration, rate, max_spans, max_len - len(path), path, store)
            return below if len(below) > 1 else None

        trie.lookup = lookup
        return trie
    return trie if len(trie) > 1 else None


def _matches_trie(
    index: NgramIndex,
    calibration: CopyCalibration,
    rate: list[list[float]],
    max_spans: int,
    max_len: int,
    suffix: tuple,
    store=None,
) -> CopyTrie:
    """The trie of the continuations (up to max_len tokens) of the context + `suffix`'s best matches, and of its
    longest match in `store` (a `store.TokenStore`)."""
    trie = CopyTrie([-1], [-1], [1.0], [None], [0])
    child: dict[tuple[int, int], int] = {}

    def add(span: list[int], length: int) -> bool:
        """Insert a span whose context matched `length` tokens; whether it added a node."""
        b, u, new = match_bin(length), 0, False
        for j, t in enumerate(span):
            v = child.get((u, t))
            if v is None:
                v = len(trie.tokens)
                child[(u, t)] = v
                trie.tokens.append(t)
                trie.parents.append(u)
                trie.factors.append(rate[b][calibration.cell(j)])
                trie.info.append((b, calibration.cell(j)))
                trie.depths.append(j + 1)
                new = True
            u = v
        return new

    spans = 0
    for length, end in index.matches(suffix=suffix):
        if spans >= max_spans:
            break
        spans += add(index.continuation(end, max_len, suffix), length)  # a repeat of an earlier span adds nothing
    if store is not None:
        found = store.match(index.tokens[-store.max_match :] + list(suffix))
        if found is not None:
            add(store.continuation(found[1], max_len), found[0])
    return trie

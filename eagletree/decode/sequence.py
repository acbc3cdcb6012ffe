"""One sequence being decoded: its prompt and cache row, the committed positions its drafter has not read yet
(the backlog), its copy index and calibration, and how many tokens its trees have bought."""

from __future__ import annotations

import time

import torch

from ..search.copy import CopyCalibration, NgramIndex, copy_only
from ..verify import DraftTree


class SequenceState:
    """One sequence being decoded: its prompt, cache row, what the drafter has not read yet, and its copy index.

    Committed (features, next tokens) wait in `pending` until the drafter drafts: it catches up right before
    (one call for every sequence that drafts), so steps that do not draft (tree="auto" pausing) cost it nothing.
    Past the prompt, only the last MAX_BACKLOG committed positions wait: after a long pause (hundreds of steps in a
    large batch) the drafter sees the prompt and the recent tokens, at their positions, and a catch-up costs about
    a level's call rather than one row per step paused. Drafts only: the target verifies them.
    """

    MAX_BACKLOG = 64

    def __init__(self, key, ids: torch.Tensor, stats, generator, copy_calibration: CopyCalibration | None, store):
        self.key, self.ids, self.stats, self.generator = key, ids, stats, generator
        self.row = -1
        self.root = int(ids[-1])
        self.emitted = 0
        self.pending: list[tuple] = []  # (features [m, F], next tokens [m], position of the first)
        self.fed = 0  # committed positions so far: the next one's position
        self.backlog = 0  # positions pending past the prompt's
        self.prompt_pending = False  # pending[0] is the prompt's
        self.calibration = copy_calibration
        self.index = NgramIndex(ids.tolist()) if copy_calibration is not None else None  # prompt + emitted tokens
        self.store = store  # a corpus copied from too (retrieved spans), or None
        self.started = time.perf_counter()
        self.tree_passes = self.tree_tokens = 0  # passes that verified drafted nodes, and the tokens they emitted
        self.done = False
        self.error: str | None = None  # why the sequence ended before finishing (the tokens so far are kept)

    @property
    def tree_rate(self) -> float:
        """Tokens per pass of this sequence's passes with drafted nodes, with a prior of 2 worth one pass (a
        sequence that has not drafted yet is expected to gain what trees usually gain)."""
        return (self.tree_tokens + 2.0) / (self.tree_passes + 1.0)

    def learn(self, draft: DraftTree, accepted: list[int]) -> int:
        """Update the copy calibration with a verified tree; returns the accepted tokens only a copy proposed."""
        if draft.copy_info is None:
            return 0
        self.calibration.update(draft, accepted)
        return sum(copy_only(draft.copy_info[v]) for v in accepted[1:])

    def commit(self, step, layers, drafting: bool) -> None:
        """A verified pass's tokens reach the drafter (at its next catch-up) and the copy index."""
        if drafting:
            device = step.hidden.device
            self.feed(head_features(step.hidden, step.layer_hidden, layers), torch.tensor(step.tokens, device=device))
        if self.index is not None:
            self.index.extend(step.tokens)
        self.root = step.tokens[-1]

    def feed(self, features: torch.Tensor, next_tokens: torch.Tensor, prompt: bool = False) -> None:
        """Committed positions (features [m, F] and the token after each) for the drafter's next catch-up; past the
        prompt's, the oldest beyond MAX_BACKLOG are dropped."""
        self.pending.append((features, next_tokens, self.fed))
        self.fed += features.shape[0]
        if prompt:
            self.prompt_pending = True
            return
        self.backlog += features.shape[0]
        first = 1 if self.prompt_pending else 0
        over = self.backlog - self.MAX_BACKLOG
        while over > 0:
            f, n, start = self.pending[first]
            if f.shape[0] <= over:
                del self.pending[first]
                over -= f.shape[0]
                self.backlog -= f.shape[0]
            else:
                self.pending[first] = (f[over:], n[over:], start + over)
                self.backlog -= over
                over = 0

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features, next tokens, positions) of every pending position, in order; none is pending after."""
        feats = torch.cat([f for f, _, _ in self.pending])
        tokens = torch.cat([n for _, n, _ in self.pending])
        positions = torch.cat([torch.arange(start, start + f.shape[0]) for f, _, start in self.pending])
        self.pending.clear()
        self.prompt_pending = False
        self.backlog = 0
        return feats, tokens, positions


def head_features(hidden, layer_hidden, layers):
    """The head's input features from a target pass: the last hidden state, or the concatenated fused layers
    (EAGLE-3)."""
    return hidden if not layers else torch.cat([layer_hidden[i] for i in layers], dim=-1)

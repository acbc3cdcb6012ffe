"""What decoding reports: a `Step` per target pass, `GenerationStats` over a prompt's passes, and a
`GenerationResult` per prompt (its text, tokens, statistics, and why it ended early if it did)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..target.loading import TargetError
from ..verify import DraftTree


@dataclass
class Step:
    """One target pass: what it emitted, the tree it verified, and where its time went."""

    tokens: list[int]  # emitted by this pass (cut at max_new_tokens)
    draft: DraftTree
    accepted: list[int]  # accepted node indices, root first
    times: dict[str, float]  # seconds: draft, search, verify, accept, commit
    length: int = 0  # tokens the pass produced, before the max_new_tokens cut
    copied: int = 0  # accepted draft tokens that only a copied span proposed
    stopped: bool = False  # a stop token was emitted


@dataclass
class GenerationStats:
    """What decoding one prompt did: its tokens and passes, each pass's predicted and accepted tokens, and where
    the time went (seconds per stage)."""

    new_tokens: int = 0
    passes: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per pass
    predicted: list[float] = field(default_factory=list)  # the tree's E[tokens/pass] per pass
    times: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("prefill", "draft", "search", "verify", "accept", "commit"), 0.0)
    )
    seconds: float = 0.0
    steps: list | None = None  # (DraftTree, accepted node indices) per pass, when asked for (calibration)
    copied_tokens: int = 0  # accepted draft tokens that only a copied span proposed (not the head too)

    def record(self, step) -> None:
        """Count one decoding Step."""
        self.passes += 1
        self.new_tokens += len(step.tokens)
        self.accepted_lengths.append(step.length)
        self.predicted.append(step.draft.expected_tokens)
        for k, v in step.times.items():
            self.times[k] += v
        self.copied_tokens += step.copied
        if self.steps is not None:
            self.steps.append((step.draft, step.accepted))

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per target pass."""
        return self.new_tokens / self.passes if self.passes else 0.0

    @property
    def predicted_tokens_per_pass(self) -> float:
        """The trees' expected tokens per pass, averaged over the passes."""
        return sum(self.predicted) / len(self.predicted) if self.predicted else 0.0

    def histogram(self) -> dict[int, int]:
        """{tokens a pass emitted: passes that emitted that many}."""
        hist: dict[int, int] = {}
        for n in self.accepted_lengths:
            hist[n] = hist.get(n, 0) + 1
        return dict(sorted(hist.items()))

    def as_dict(self) -> dict:
        """The statistics as plain JSON-ready values."""
        return {
            "new_tokens": self.new_tokens,
            "passes": self.passes,
            "tokens_per_pass": self.tokens_per_pass,
            "predicted_tokens_per_pass": self.predicted_tokens_per_pass,
            "accepted_histogram": self.histogram(),
            "copied_tokens": self.copied_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds else 0.0,
            "times": dict(self.times),
        }


@dataclass
class GenerationResult:
    """One prompt's answer. `error`: why decoding that sequence ended early (e.g. its answer reached a
    sliding-window target's window), with the tokens decoded before it kept; None when it finished."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    error: str | None = None


def whole_answers(results: list[GenerationResult]) -> list[GenerationResult]:
    """`results` (in prompt order) when every answer finished; else a TargetError naming the first prompt whose
    decoding ended early and why: for measurements and comparisons that need whole answers (a cut one would pass
    for the target's answer, its tokens/s and tokens/pass counted), as decoding one prompt alone raises it."""
    for i, result in enumerate(results):
        if result.error is not None:
            raise TargetError(f"prompt {i}: {result.error}")
    return results

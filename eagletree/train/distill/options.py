"""How `distill` answers: one options object, validated once (the CLI's `eagletree distill` builds it)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ...errors import EagletreeError
from ..data import TURNS

DECODERS = ("hf", "eagletree", "vllm")  # the answerers, one per engine (`answerers.ANSWERERS`)


class DistillError(EagletreeError, ValueError):
    """Bad distillation settings or output file; the message names the value."""


def default_decoder(temperature: float) -> str:
    """The answerer used unless one is named: greedy answers come faster from eagletree's batched decoding with the
    head, sampled ones from HF generate."""
    return "hf" if temperature else "eagletree"


def default_batch_size(decoder: str) -> int:
    """Prompts answered together unless told: vLLM batches each call's prompts itself, and larger calls keep it
    busy."""
    return 64 if decoder == "vllm" else 16


def check_match(match: str) -> re.Pattern:
    """distill's `match`, compiled; a DistillError naming it when it is not a regular expression."""
    try:
        return re.compile(match)
    except (re.error, TypeError) as e:
        raise DistillError(f"match must be a regular expression, got {match!r} ({e})") from None


@dataclass(frozen=True)
class DistillOptions:
    """Which prompts `distill` answers and how (see `distill` for each field's meaning); a DistillError naming the
    first value outside its range when built."""

    max_new_tokens: int = 320
    max_prompt_tokens: int = 256
    batch_size: int = 16
    temperature: float = 0.0
    limit: int = 0
    seed: int = 0
    skip_answered: tuple = ()  # paths of other distillation files (a single path is taken as one)
    progress: bool = True
    turns: str = "first"
    min_prompt_tokens: int = 0
    match: str | None = None
    decoder: str = "hf"

    def __post_init__(self):
        if isinstance(self.skip_answered, (str, os.PathLike)):
            object.__setattr__(self, "skip_answered", (self.skip_answered,))
        self._check_ranges()
        self._check_decoder()
        if self.turns not in TURNS:
            raise DistillError(f"turns must be one of {', '.join(TURNS)}, got {self.turns!r}")
        if self.match is not None:
            check_match(self.match)

    def _check_ranges(self) -> None:
        """DistillError naming the first count outside its range, or a prompt range that admits nothing."""
        for name, low in (
            ("max_new_tokens", 1),
            ("max_prompt_tokens", 1),
            ("batch_size", 1),
            ("limit", 0),
            ("min_prompt_tokens", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise DistillError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.min_prompt_tokens > self.max_prompt_tokens:
            raise DistillError(
                f"min_prompt_tokens ({self.min_prompt_tokens}) must not exceed max_prompt_tokens "
                f"({self.max_prompt_tokens}): no prompt would be answered"
            )
        if not self.temperature >= 0:
            raise DistillError(f"temperature must be >= 0, got {self.temperature!r}")

    def _check_decoder(self) -> None:
        """DistillError unless `decoder` is one of DECODERS and answers as asked."""
        if self.decoder not in DECODERS:
            raise DistillError(f"decoder must be one of {', '.join(DECODERS)}, got {self.decoder!r}")
        if self.decoder == "eagletree" and self.temperature > 0:
            raise DistillError(
                f"decoder='eagletree' answers greedily (temperature 0), got temperature {self.temperature:g}: its "
                "sampled answers would be other draws than HF's for the same seed; use decoder='hf' to sample"
            )

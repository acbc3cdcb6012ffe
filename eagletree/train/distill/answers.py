"""What every answerer shares: the stop tokens, an answer cut at the first one, and the prompts a decoder accepts.

An answerer turns prompts into answers for one engine (`answer_hf`, `answer_decoder`, `answer_vllm`): `prepare`
checks the prompts and starts what it needs, `answer` yields groups of (prompt, `Answer` or None), each group
written together by the record store.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from ...decode import stop_token_ids
from ...target.ragged import sliding_window
from .options import DistillError
from .records import Answer
from .selection import Batch, Prompt


class Answerer(Protocol):
    def prepare(self, prompts: list[Prompt]) -> dict:
        """Check `prompts` (all a run answers) and start the engine; the counts of that start (may be empty)."""

    def answer(self, todo: list[Batch]) -> Iterator[list[tuple[Prompt, Answer | None]]]:
        """The batches' answers, a group at a time (None: not answered; the answerer warned why)."""


def stops_of(model, tok) -> list[int]:
    """The answers' stop tokens; DistillError when there are none (answers would never end)."""
    stops = stop_token_ids(model, tok)
    if not stops:
        raise DistillError(
            f"{getattr(tok, 'name_or_path', 'the tokenizer')}: no EOS token and no eos_token_id in the "
            "model's generation_config: answers would never end"
        )
    return stops


def answer_of(tok, token_ids: list[int], stops) -> Answer:
    """The answer of generated tokens: cut before the first stop token ("eos"), else "length"."""
    n = next((i for i, t in enumerate(token_ids) if t in stops), None)
    if n is None:
        return Answer(tok.decode(token_ids, skip_special_tokens=True), len(token_ids), "length")
    return Answer(tok.decode(token_ids[:n], skip_special_tokens=True), n, "eos")


def check_prompts_fit(model, prompts: list[Prompt], max_new_tokens: int, sliding: bool = True) -> None:
    """DistillError naming the first of `prompts` that eagletree's decoder (or vLLM) refuses: one whose tokens +
    max_new_tokens pass the target's context, or (`sliding`: eagletree's decoder) that is longer than its sliding
    window."""
    limit = getattr(model.config, "max_position_embeddings", None)
    window = sliding_window(model) if sliding else None
    for conv_id, _, ids in prompts:
        if limit is not None and len(ids) + max_new_tokens > limit:
            raise DistillError(
                f"{conv_id}: its prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"target's context of {limit} tokens; lower max_prompt_tokens or max_new_tokens"
            )
        if window is not None and len(ids) > window:
            raise DistillError(
                f"{conv_id}: its prompt ({len(ids)} tokens) is longer than the target's sliding window of {window} "
                "tokens, past which --engine eagletree does not decode; lower max_prompt_tokens or use --engine hf"
            )

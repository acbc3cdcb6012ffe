"""Which prompts `distill` answers: the user turns of the training conversations, filtered, in batches.

Batches are made from every prompt the options pick, answered or not, so a resumed run makes the same batches (and
draws the same seeds) as a straight one; the answers already written are left out of them afterwards.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

from ...decode import encode_prompt
from ...prompts import humaneval_prompts, humaneval_range
from ..data import TURNS, Conversation, load_dataset, split
from .options import DistillError, DistillOptions, check_match


class Prompt(NamedTuple):
    """One prompt to answer: its record id, its messages, and the token ids decoding starts from."""

    id: str
    messages: list[dict]
    ids: list[int]


@dataclass
class Batch:
    """The prompts of one batch still to answer; `key`, its first prompt's id (answered or not), fixes its seed."""

    key: str
    prompts: list[Prompt]


@dataclass
class Selection:
    """The batches of every prompt picked, and how many prompts were left out: too long, too short, no match."""

    batches: list[list[Prompt]]
    skipped_long: int
    skipped_short: int
    skipped_no_match: int

    def todo(self, left_out: set[str]) -> list[Batch]:
        """The batches that hold a prompt not in `left_out`, each with only such prompts."""
        kept = [Batch(b[0].id, [p for p in b if p.id not in left_out]) for b in self.batches]
        return [b for b in kept if b.prompts]

    def count(self, ids: set[str]) -> int:
        """How many of the picked prompts `ids` holds."""
        return sum(p.id in ids for b in self.batches for p in b)


def distill_prompts(dataset: str, heldout_fraction: float) -> list[Conversation]:
    """The conversations `distill` answers: a dataset's training split, or the HumanEval problems `humaneval:A-B`
    names, all of them (problem ids `HumanEval/<A-1>` ..), for a head that sees the evaluation's wording of code
    questions; the evaluation must then use other problems (the README's code rows use problems 1-80)."""
    if dataset == "humaneval" or dataset.startswith("humaneval:"):
        count, offset = humaneval_range(dataset, flag="--dataset")  # ValueError naming the spec
        return [
            Conversation(f"HumanEval/{offset + i}", messages)
            for i, messages in enumerate(humaneval_prompts(count, offset))
        ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_convs, _ = split(load_dataset(dataset), heldout_fraction)  # a bad fraction: ValueError
    return train_convs


def first_turns(conversations) -> list[tuple[str, list[dict]]]:
    """(id, messages through the first non-empty user turn) of each conversation that has one.

    The same prompts as evaluation takes from held-out conversations (`evaluate.heldout_prompts`).
    """
    return user_turns(conversations, "first")


def user_turns(conversations, turns: str = "first") -> list[tuple[str, list[dict]]]:
    """(id, messages through a user turn) for the conversations' first user turns, their later ones, or all.

    A later turn's prompt is the conversation up to it, earlier answers included as the dataset has
    them; its id is the conversation's with `@turn<k>` (k = 2, 3, ...), which the held-out split
    reads as the same conversation (`data.base_id`). Empty user turns are left out.
    """
    if turns not in TURNS:
        raise DistillError(f"turns must be one of {', '.join(TURNS)}, got {turns!r}")
    out = []
    for conv in conversations:
        msgs, k = [], 0
        for m in conv.messages:
            msgs.append(m)
            if m["role"] != "user":
                continue
            k += 1
            if m["content"].strip() and (turns == "all" or (k == 1) == (turns == "first")):
                out.append((conv.id if k == 1 else f"{conv.id}@turn{k}", list(msgs)))
            if turns == "first":
                break
    return out


def select(conversations, tok, options: DistillOptions) -> Selection:
    """The prompts `options` picks from `conversations` (turns, match, limit, prompt length), in batches."""
    items, no_match = _prompts_to_answer(conversations, options.turns, options.match, options.limit)
    batches, long, short = _batches(
        items, tok, options.batch_size, options.max_prompt_tokens, options.min_prompt_tokens
    )
    return Selection(batches, long, short, no_match)


def _prompts_to_answer(conversations, turns: str, match: str | None, limit: int) -> tuple[list, int]:
    """(id, messages) of the user turns `turns` picks whose text `match` finds something in, the first `limit`
    of them (0: all), and how many `match` left out."""
    pattern = None if match is None else check_match(match)
    items = user_turns(conversations, turns)
    no_match = 0
    if pattern is not None:
        kept = [item for item in items if pattern.search(item[1][-1]["content"])]
        no_match, items = len(items) - len(kept), kept
    return (items[:limit] if limit else items), no_match


def _batches(items, tok, batch_size: int, max_prompt_tokens: int, min_prompt_tokens: int = 0):
    """Prompts of similar length together (less padding), in a fixed order; prompts longer than
    max_prompt_tokens or shorter than min_prompt_tokens are skipped (counted: long, short)."""
    rendered, long, short = [], 0, 0
    for conv_id, msgs in items:
        ids = encode_prompt(tok, msgs).tolist()  # the prompt tokens decoding itself starts from
        if len(ids) > max_prompt_tokens or len(ids) < min_prompt_tokens:
            long += len(ids) > max_prompt_tokens
            short += len(ids) < min_prompt_tokens
            continue
        rendered.append(Prompt(conv_id, msgs, ids))
    # Sorted within windows of 16 batches: similar lengths per batch, yet the file fills in dataset order.
    window = batch_size * 16
    batches = []
    for w in range(0, len(rendered), window):
        chunk = sorted(rendered[w : w + window], key=lambda r: len(r.ids))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches, long, short

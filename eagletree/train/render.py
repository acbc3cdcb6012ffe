"""Render conversations with the target tokenizer's own chat template, with an assistant-only loss mask.

The mask comes from the rendering itself: the text of the conversation up to each assistant turn
(with the generation prompt) and through it are both prefixes of the full rendering, so the
characters between them are that assistant turn (a conversation that opens with an assistant turn:
from that turn's text on, not the system prompt or header the template puts before it; assistant turns of
weight 0 are context). Token offsets map characters to tokens. No separator strings are hard-coded, so any
tokenizer with a chat template works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import EagletreeError

# Bumped when the loss masks change (2: an opening assistant turn's mask starts at its text; 3: assistant turns of
# weight 0 are left out), so that caches holding masks (the features cache) are made again rather than mixed.
MASK_VERSION = 3


class RenderError(EagletreeError, ValueError):
    """A conversation the chat template cannot render consistently (counted and skipped by the trainer)."""


@dataclass
class Rendered:
    input_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool: token belongs to an assistant turn (not one of weight 0)
    truncated: bool


def _render(tokenizer, messages, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _first_turn_start(tokenizer, through: str, message: dict) -> int:
    """Where an assistant turn that opens the conversation starts in its rendering: at its text, after whatever
    the template puts before it (a default system prompt, the assistant header), which is not the answer's.
    Templates refuse an empty conversation, so there is no rendering "up to" this turn to compare with; the turn
    rendered with a placeholder for its text shows where the text goes."""
    content = message.get("content")
    text = content.strip() if isinstance(content, str) else ""
    if not text:
        return len(through)  # nothing to learn from an empty turn
    marker = "\u2063eagletree-turn-text\u2063"  # (invisible separators: no template writes this itself)
    at = _render(tokenizer, [dict(message, content=marker)], False).find(marker)
    if at < 0 or not through[at:].lstrip().startswith(text):
        raise RenderError("the chat template does not render the opening assistant turn's text where its content goes")
    return at


def render(tokenizer, messages: list[dict], max_len: int | None = None) -> Rendered:
    """Token ids and assistant mask of one conversation, cut to `max_len` tokens if given."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RenderError("the tokenizer has no chat template")
    try:
        full = _render(tokenizer, messages, False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or m.get("weight", 1) == 0:  # weight 0: context, not trained on
                continue
            through = _render(tokenizer, messages[: i + 1], False)
            if not full.startswith(through):
                raise RenderError(f"the chat template does not render turn {i} as a prefix of the conversation")
            if i:
                before = _render(tokenizer, messages[:i], True)
                if not through.startswith(before):
                    raise RenderError(f"the chat template does not render turn {i} as a prefix of the conversation")
                start = len(before)
            else:
                start = _first_turn_start(tokenizer, through, m)
            spans.append((start, len(through)))
    except RenderError:
        raise
    except Exception as e:  # templates raise their own errors (e.g. roles out of order)
        raise RenderError(f"the chat template rejected the conversation: {e}") from e
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long)
    starts = torch.tensor([a for a, _ in enc["offset_mapping"]], dtype=torch.long)
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    truncated = max_len is not None and ids.numel() > max_len
    if truncated:
        ids, mask = ids[:max_len], mask[:max_len]
    return Rendered(ids, mask, truncated)


def render_item(tokenizer, item, max_len: int | None = None) -> Rendered:
    """A conversation (anything with `.messages`) rendered, or a pre-tokenized `Rendered` record, cut to `max_len`."""
    if not isinstance(item, Rendered):
        return render(tokenizer, item.messages, max_len)
    if max_len is None or item.input_ids.numel() <= max_len:
        return item
    return Rendered(item.input_ids[:max_len], item.loss_mask[:max_len], True)

"""Prompts in: chat messages, a string or token ids encoded to ids, checked against the target's vocabulary,
context and sliding window, and the stop tokens that end an answer."""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable

import torch

from ..errors import InvalidType, InvalidValue


def is_token_ids(prompt) -> bool:
    """Whether `prompt` is one prompt of token ids: a list or tuple of integers."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(_is_int(t) for t in prompt)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def encode_prompt(tokenizer, prompt) -> torch.Tensor:
    """Chat messages (through the chat template), a plain string, or token ids (a 1-D or [1, n] integer tensor, a
    list of ints) -> 1-D ids."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise InvalidType(f"a prompt tensor holds token ids: expected an integer dtype, got {prompt.dtype}")
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise InvalidValue(
                f"a prompt tensor is one sequence of token ids, shape [n] or [1, n], got "
                f"{list(prompt.shape)}; decode a batch as a list of prompts"
            )
        ids = prompt.flatten().long()
    elif is_token_ids(prompt):
        ids = torch.tensor([int(t) for t in prompt], dtype=torch.long)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        ids = _chat_ids(tokenizer, check_messages(prompt))
    elif isinstance(prompt, str):
        ids = tokenizer(check_utf8(prompt, "the prompt"), return_tensors="pt").input_ids[0]
    else:
        raise InvalidType(f"prompt must be chat messages, a string or token ids, got {type(prompt).__name__}")
    if ids.numel() == 0:
        raise InvalidValue("the prompt is empty")
    return ids


def _chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """The ids of `messages` through the tokenizer's chat template; InvalidValue with the template's own message
    when it refuses them (some templates raise on, e.g., roles that do not alternate)."""
    from jinja2 import TemplateError  # (transformers' chat templates are jinja2's)

    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    except TemplateError as e:
        raise InvalidValue(f"the chat template refuses these messages: {e}") from e
    return out["input_ids"][0]


def check_utf8(text: str, what: str) -> str:
    """`text` unchanged, or InvalidValue naming the character when it is not UTF-8 text: a byte that was not UTF-8
    (Python keeps it as a surrogate, U+DC80..U+DCFF) or a lone surrogate (as JSON's "\\ud800" reads)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        bad = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise InvalidValue(f"{what} is not valid UTF-8 text ({bad} at character {e.start}); give UTF-8 text") from None
    return text


# The roles chat templates know: the turns of a conversation, and tool use (a tool's result is answered too).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
ANSWERED_ROLES = ("user", "tool", "ipython")  # a conversation ending with one of these asks for the assistant's turn
MESSAGE = '{"role": system|developer|user|assistant|tool|ipython, "content": str or a list of parts}'


def _content_ok(message: dict) -> bool:
    """Text, a list of content parts (dicts: the template reads them), or none for an assistant's tool calls."""
    content = message.get("content")
    if isinstance(content, str):
        return True
    if isinstance(content, list):
        return all(isinstance(part, dict) for part in content)
    return content is None and message.get("role") == "assistant" and bool(message.get("tool_calls"))


def _texts(content) -> list[str]:
    """The text strings of a message's content."""
    if isinstance(content, str):
        return [content]
    parts = content if isinstance(content, list) else []
    return [v for part in parts for v in part.values() if isinstance(v, str)]


def check_messages(messages) -> list[dict]:
    """Chat messages to answer, as a list: each {"role", "content"} of a role chat templates know (other keys go to
    the chat template) in UTF-8, the last one a turn to answer (the user's, or a tool's result); InvalidValue or
    InvalidType naming the message."""
    messages = list(messages)
    for j, message in enumerate(messages):
        ok = isinstance(message, dict) and message.get("role") in CHAT_ROLES and _content_ok(message)
        if not ok:
            shown = json.dumps(message, ensure_ascii=False, default=repr)[:80]
            error = InvalidType if not isinstance(message, dict) else InvalidValue
            raise error(f"message {j}: expected {MESSAGE}, got {shown}")
        for text in _texts(message["content"]):
            check_utf8(text, f"message {j}'s content")
    if not messages:
        raise InvalidValue(f"the messages are empty; expected a list of {MESSAGE} ending with the user's turn")
    if messages[-1]["role"] not in ANSWERED_ROLES:
        raise InvalidValue(
            f"message {len(messages) - 1}: the messages must end with the user's turn (or a tool's result) to "
            f"answer, not the {messages[-1]['role']}'s"
        )
    return messages


def prompt_list(prompts) -> list:
    """The prompts of a batch (a list, tuple or other ordered iterable of them) as a list; InvalidType naming what
    was given for a string, bytes, a dict, a set, a tensor, None, one conversation or one prompt of token ids."""
    given = None
    if isinstance(prompts, (str, bytes, bytearray, dict, set, frozenset, torch.Tensor)) or not isinstance(
        prompts, Iterable
    ):
        given = "None" if prompts is None else f"{type(prompts).__name__} {_shown(prompts)}"
    else:
        prompts = list(prompts)
        if prompts and all(isinstance(p, dict) for p in prompts):
            given = "one conversation (a list of messages)"
        elif is_token_ids(prompts):
            given = "one prompt of token ids (a list of integers)"
    if given is not None:
        raise InvalidType(
            f"expected a list of prompts (strings, chat-message lists or token-id lists), got {given}; "
            "pass [prompt] to decode one"
        )
    return prompts


def _shown(value) -> str:
    """The start of `value` as an error message shows it."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_token_ids(target, ids: torch.Tensor) -> None:
    """ValueError unless every id is a row of the target's embedding."""
    vocab = target.get_input_embeddings().num_embeddings
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise InvalidValue(
            f"prompt token ids must lie in [0, {vocab}) (the target's vocabulary), got {low if low < 0 else high}"
        )


def stop_token_ids(target, tokenizer, stop=None) -> list[int]:
    """The target's end-of-sequence ids and the tokenizer's, plus `stop`: token ids, or strings that are one token
    each (a token as the tokenizer writes it, e.g. "<|im_end|>", or text that encodes to one token, e.g. "\\n")."""
    ids = set()
    eos = target.generation_config.eos_token_id
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if stop is None:
        return sorted(ids)
    if isinstance(stop, (str, int)) or not isinstance(stop, (list, tuple, set)):
        raise InvalidType(f"stop must be a list of token ids or token strings, got {stop!r}")
    vocab = target.get_input_embeddings().num_embeddings
    for s in stop:
        if _is_int(s):
            if not 0 <= int(s) < vocab:
                raise InvalidValue(f"stop token id {s} is outside the target's vocabulary [0, {vocab})")
            ids.add(int(s))
        elif isinstance(s, str) and s:
            ids.add(_one_token(tokenizer, s))
        else:
            raise InvalidType(f"stop entries must be token ids or non-empty token strings, got {s!r}")
    return sorted(ids)


def _one_token(tokenizer, text: str) -> int:
    """The id of the token `text` (as the vocabulary writes it, or as text that encodes to exactly one token)."""
    if tokenizer is None:
        raise InvalidValue(f"stop {text!r}: a stop string needs the tokenizer; pass token ids instead")
    token = tokenizer.convert_tokens_to_ids(text)
    if token is not None and (token != tokenizer.unk_token_id or text == tokenizer.unk_token):
        return int(token)
    encoded = tokenizer(text, add_special_tokens=False).input_ids
    if len(encoded) != 1:
        raise InvalidValue(
            f"stop {text!r} is {len(encoded)} tokens ({encoded}), not one; stop takes single tokens "
            f"(a stop on longer text needs a check on the decoded text)"
        )
    return int(encoded[0])


def fit_context(ids: torch.Tensor, context: int | None, max_new_tokens: int, truncate: bool) -> torch.Tensor:
    """`ids`, or their last tokens that leave `max_new_tokens` of room in the model's `context` (`truncate`);
    ValueError when prompt and answer do not fit and `truncate` is off (or cannot help)."""
    if context is not None and ids.numel() + max_new_tokens > context:
        if not truncate or max_new_tokens >= context:
            raise InvalidValue(
                f"prompt ({ids.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context of {context} tokens; shorten the prompt or ask for fewer new tokens (in "
                "Python, truncate_prompt=True keeps the prompt's last tokens)"
            )
        ids = ids[-(context - max_new_tokens) :]
    return ids


def fit_window(ids: torch.Tensor, window: int | None, max_new_tokens: int, truncate: bool) -> torch.Tensor:
    """`ids`, or ValueError when the prompt is longer than the target's sliding window: eagletree verifies
    trees over the full cache, so it decodes no token past the window (`truncate` keeps the prompt's last
    tokens that leave max_new_tokens of room in it). An answer that reaches the window ends there
    (`BatchRows.overflow`)."""
    if window is None:
        return ids
    if truncate and max_new_tokens < window and ids.numel() + max_new_tokens > window:
        return ids[-(window - max_new_tokens) :]
    if ids.numel() > window:
        raise InvalidValue(
            f"prompt ({ids.numel()} tokens) is longer than the target's sliding window of {window} tokens, "
            "past which eagletree does not decode (tree verification needs the whole cache); shorten the "
            "prompt (in Python, truncate_prompt=True keeps the prompt's last tokens)"
        )
    return ids

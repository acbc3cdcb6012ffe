"""Prompts in: chat messages, a string or token ids encoded to ids, checked against the target's vocabulary,
context and sliding window, and the stop tokens that end an answer."""

from __future__ import annotations

import numbers

import torch


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
            raise TypeError(f"a prompt tensor holds token ids: expected an integer dtype, got {prompt.dtype}")
        if prompt.dim() > 2 or (prompt.dim() == 2 and prompt.shape[0] != 1):
            raise ValueError(
                f"a prompt tensor is one sequence of token ids, shape [n] or [1, n], got "
                f"{list(prompt.shape)}; decode a batch as a list of prompts"
            )
        ids = prompt.flatten().long()
    elif is_token_ids(prompt):
        ids = torch.tensor([int(t) for t in prompt], dtype=torch.long)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        for j, message in enumerate(prompt):
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                check_utf8(message["content"], f"message {j}'s content")
        ids = tokenizer.apply_chat_template(
            list(prompt), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"][0]
    elif isinstance(prompt, str):
        ids = tokenizer(check_utf8(prompt, "the prompt"), return_tensors="pt").input_ids[0]
    else:
        raise TypeError(f"prompt must be chat messages, a string or token ids, got {type(prompt).__name__}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty")
    return ids


def check_utf8(text: str, what: str) -> str:
    """`text` unchanged, or ValueError when it holds bytes that are not UTF-8 (Python keeps them as surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start].encode("utf-8", "surrogateescape")
        raise ValueError(
            f"{what} is not valid UTF-8 text (byte 0x{bad.hex()} at character {e.start}); give UTF-8 text"
        ) from None
    return text


def check_token_ids(target, ids: torch.Tensor) -> None:
    """ValueError unless every id is a row of the target's embedding."""
    vocab = target.get_input_embeddings().num_embeddings
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(
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
        raise TypeError(f"stop must be a list of token ids or token strings, got {stop!r}")
    vocab = target.get_input_embeddings().num_embeddings
    for s in stop:
        if _is_int(s):
            if not 0 <= int(s) < vocab:
                raise ValueError(f"stop token id {s} is outside the target's vocabulary [0, {vocab})")
            ids.add(int(s))
        elif isinstance(s, str) and s:
            ids.add(_one_token(tokenizer, s))
        else:
            raise TypeError(f"stop entries must be token ids or non-empty token strings, got {s!r}")
    return sorted(ids)


def _one_token(tokenizer, text: str) -> int:
    """The id of the token `text` (as the vocabulary writes it, or as text that encodes to exactly one token)."""
    if tokenizer is None:
        raise ValueError(f"stop {text!r}: a stop string needs the tokenizer; pass token ids instead")
    token = tokenizer.convert_tokens_to_ids(text)
    if token is not None and (token != tokenizer.unk_token_id or text == tokenizer.unk_token):
        return int(token)
    encoded = tokenizer(text, add_special_tokens=False).input_ids
    if len(encoded) != 1:
        raise ValueError(
            f"stop {text!r} is {len(encoded)} tokens ({encoded}), not one; stop takes single tokens "
            f"(a stop on longer text needs a check on the decoded text)"
        )
    return int(encoded[0])


def fit_context(ids: torch.Tensor, context: int | None, max_new_tokens: int, truncate: bool) -> torch.Tensor:
    """`ids`, or their last tokens that leave `max_new_tokens` of room in the model's `context` (`truncate`);
    ValueError when prompt and answer do not fit and `truncate` is off (or cannot help)."""
    if context is not None and ids.numel() + max_new_tokens > context:
        if not truncate or max_new_tokens >= context:
            raise ValueError(
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
        raise ValueError(
            f"prompt ({ids.numel()} tokens) is longer than the target's sliding window of {window} tokens, "
            "past which eagletree does not decode (tree verification needs the whole cache); shorten the "
            "prompt (in Python, truncate_prompt=True keeps the prompt's last tokens)"
        )
    return ids

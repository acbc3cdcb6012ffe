"""Answers out: token ids decoded to text whole, or streamed in pieces as the passes emit them."""

from __future__ import annotations


def decode_text(tokenizer, ids) -> str:
    """Text of token ids, without special tokens and without clean-up (so streamed pieces add up to it); "" without
    a tokenizer (a decoder given token ids alone, as `hf.decoding`'s)."""
    if tokenizer is None:
        return ""
    try:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except TypeError:  # a minimal tokenizer without that option
        return tokenizer.decode(ids, skip_special_tokens=True)


def stream_text(tokenizer, steps):
    """Text pieces as tokens arrive; held back while the decoded text ends in an incomplete character."""
    ids, sent = [], ""
    for tokens in steps:
        ids += tokens
        text = decode_text(tokenizer, ids)
        if text.endswith("\ufffd") or not text.startswith(sent):
            continue
        if len(text) > len(sent):
            yield text[len(sent) :]
        sent = text
    text = decode_text(tokenizer, ids)
    if text.startswith(sent) and len(text) > len(sent):
        yield text[len(sent) :]

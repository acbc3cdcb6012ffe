"""Chat messages from dataset records: ShareGPT's `conversations` (from/value) or OpenAI's `messages` (role/content).

Every record becomes OpenAI-style messages ({"role": "system" | "user" | "assistant", "content": str}; an assistant
turn may carry "weight": 0, as in OpenAI's fine-tuning format: context, not trained on). Below both training data
(`train.data`) and the datastore of retrieved spans (`search.store`), which read the same records.
"""

from __future__ import annotations

from .errors import EagletreeError

ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}


class DataError(EagletreeError, ValueError):
    """Input data that cannot be read as conversations; the message names file and record."""


def to_messages(record, where: str) -> list[dict] | None:
    """One record (ShareGPT `conversations` or OpenAI `messages`) -> messages; None when it has no turns."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    else:
        raise DataError(
            f"{where}: record has no 'conversations' (ShareGPT: from/value) or 'messages' (role/content) "
            f"field; its keys are {sorted(record)}"
        )
    if not isinstance(turns, list):
        raise DataError(f"{where}: the turns must be a list, got {type(turns).__name__}")
    if not turns:
        return None
    messages = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise DataError(
                f"{where}, turn {t}: expected an object with {role_key!r} and {text_key!r}, got {turn!r:.120}"
            )
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise DataError(f"{where}, turn {t}: unknown role {turn[role_key]!r}; known roles: {sorted(ROLE_ALIASES)}")
        content = turn[text_key]
        if not isinstance(content, str):
            raise DataError(f"{where}, turn {t}: {text_key!r} must be a string, got {type(content).__name__}")
        message = {"role": role, "content": content}
        if "weight" in turn:  # OpenAI's fine-tuning convention: an assistant turn of weight 0 is context only
            weight = turn["weight"]
            if isinstance(weight, bool) or weight not in (0, 1):
                raise DataError(f"{where}, turn {t}: 'weight' must be 0 (not trained on) or 1, got {weight!r}")
            if weight == 0 and role == "assistant":  # (other turns are never trained on)
                message["weight"] = 0
        messages.append(message)
    return messages

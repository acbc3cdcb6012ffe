"""Retrieved spans: what followed the context's last tokens in a fixed corpus (retrieval drafting, as REST).

Copied spans (`copy.NgramIndex`) come from the context itself. A `TokenStore` indexes a corpus written
before decoding starts, e.g. the target's own greedy answers to training prompts (`eagletree distill`):
a small model repeats its phrasing from answer to answer, so where the context's last few tokens occurred
in its earlier answers, what followed there is a draft worth verifying. The index is sorted arrays of
n-gram hashes (numpy), built in about a second for half a million tokens; a lookup is a binary search per
n-gram length, whatever the corpus size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import InvalidValue
from ..messages import to_messages
from ..records import is_header

DATASTORE = "datastore.npz"  # a head folder's store, read by default when copying
FORMAT, VERSION = "eagletree-datastore", 1
SEPARATOR = -1  # between the corpus's texts: never in a context, so no match or span crosses it
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd: the rolling hash below wraps modulo 2**64
_MASK = (1 << 64) - 1


def vocab_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id): a datastore's ids mean the same tokens only under
    it (the chat template does not matter here, unlike for pre-tokenized training data)."""
    import hashlib

    blob = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


_MULT_INT = int(_MULT)


def _hash(tokens) -> int:
    """The hash `TokenStore` gives an n-gram (Python ints, wrapped as numpy's uint64 arithmetic wraps)."""
    h = 0
    for t in tokens:
        h = (h * _MULT_INT + int(t) + 1) & _MASK
    return h


class TokenStore:
    """n-grams of min_match..max_ngram tokens of a corpus -> the positions right after them."""

    def __init__(self, tokens, min_match: int = 5, max_ngram: int = 8, max_match: int = 16):
        if not 1 <= min_match <= max_ngram <= max_match:
            raise InvalidValue(
                f"token store needs 1 <= min_match <= max_ngram <= max_match, got {min_match}, {max_ngram}, {max_match}"
            )
        self.tokens = np.asarray(tokens, dtype=np.int64)
        if self.tokens.ndim != 1:
            raise InvalidValue(f"token store tokens must be one sequence, got shape {self.tokens.shape}")
        if self.tokens.size and int(self.tokens.min()) < SEPARATOR:
            raise InvalidValue(
                f"token store tokens must be ids >= 0 or the separator {SEPARATOR}, got {int(self.tokens.min())}"
            )
        self.min_match, self.max_ngram, self.max_match = min_match, max_ngram, max_match
        self._list = self.tokens.tolist()
        self.keys: dict[int, np.ndarray] = {}  # n -> sorted hashes of the n-grams
        self.ends: dict[int, np.ndarray] = {}  # n -> the position after each, ascending within equal hashes
        t = self.tokens.astype(np.uint64) + np.uint64(1)
        sep = self.tokens == SEPARATOR
        h = np.zeros(len(t), dtype=np.uint64)
        bad = np.zeros(len(t), dtype=bool)  # the n-gram ending here holds a separator or starts before the corpus
        with np.errstate(over="ignore"):
            for n in range(1, max_ngram + 1):
                shifted = np.zeros(len(t), dtype=np.uint64)
                shifted[1:] = h[:-1]
                h = shifted * _MULT + t  # the n-gram ending at each position
                reach = np.ones(len(t), dtype=bool)
                reach[n - 1 :] = False
                bad = (np.concatenate([[True], bad[:-1]]) if n > 1 else np.zeros(len(t), dtype=bool)) | sep | reach
                if n >= min_match:
                    ok = np.flatnonzero(~bad)
                    order = np.lexsort((ok, h[ok]))
                    self.keys[n], self.ends[n] = h[ok][order], (ok[order] + 1).astype(np.int64)

    def __len__(self) -> int:
        return len(self._list)

    def match(self, context, candidates: int = 8) -> tuple[int, int] | None:
        """(match length, position after it) for the longest suffix of `context` that occurs in the corpus
        (min_match..max_ngram tokens), or None: of its `candidates` latest occurrences the one that extends
        furthest back (up to max_match tokens; the latest among equals)."""
        context = list(context[-self.max_match :])
        for n in range(min(self.max_ngram, len(context)), self.min_match - 1, -1):
            gram = context[-n:]
            key = np.uint64(_hash(gram))
            keys = self.keys[n]
            lo, hi = int(keys.searchsorted(key, "left")), int(keys.searchsorted(key, "right"))
            best, seen = None, 0
            for end in self.ends[n][lo:hi][::-1].tolist():  # the latest first
                if self._list[end - n : end] != gram:  # a hash collision
                    continue
                length = n
                while (
                    length < len(context)
                    and end - 1 - length >= 0
                    and self._list[end - 1 - length] == context[-1 - length]
                ):
                    length += 1
                if best is None or length > best[0]:
                    best = (length, end)
                seen += 1
                if seen >= candidates:
                    break
            if best is not None:
                return best
        return None

    def continuation(self, end: int, length: int) -> list[int]:
        """Up to `length` tokens from position `end`, stopping at the end of that text."""
        span = []
        for t in self._list[end : end + length]:
            if t == SEPARATOR:
                break
            span.append(t)
        return span

    @classmethod
    def from_chat_file(cls, path, tokenizer, **kw) -> TokenStore:
        """The last assistant turn of each record of one or more chat JSONL files (a path or a list of them),
        tokenized, a separator after each: in `eagletree distill`'s files the target's own answer (the turns before
        it are the dataset's, the context). A record whose "id" an earlier record had replaces it when it has an
        answer (the same prompt answered again, e.g. at a longer length), so no answer is indexed twice. A last line
        without its newline that is not a whole record (what a distill run killed mid-write leaves) is skipped with
        a warning; any other bad line is a ValueError naming the file and line."""
        import warnings

        paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
        answers: dict = {}  # record id (or, without one, the file and line) -> the answer's text
        for path in paths:
            lines = path.read_bytes().split(b"\n")
            for n, raw in enumerate(lines, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                    if is_header(record):  # a record file's header (distill's): no answer
                        continue
                    # ShareGPT (conversations: from/value) or OpenAI (messages: role/content), as training reads them
                    messages = to_messages(record, f"{path}:{n}") or []
                    turns = [
                        m["content"]
                        for m in messages
                        if m["role"] == "assistant" and m["content"] and m.get("weight", 1) != 0
                    ]
                    key = record.get("id")
                except (ValueError, KeyError, TypeError, AttributeError) as e:  # (UnicodeDecodeError is a ValueError)
                    if n == len(lines):
                        warnings.warn(
                            f"{path}:{n}: the last line is not a whole record (a run stopped mid-write?); skipped"
                        )
                        continue
                    raise InvalidValue(f"{path}:{n}: not a chat record ({e})") from None
                if isinstance(key, (str, int)) and not isinstance(key, bool) and str(key):
                    key = ("id", str(key))  # (as the training data reads ids)
                else:
                    key = ("line", str(path.resolve()), n)
                if turns:
                    answers.pop(key, None)  # the replacement takes the replaced answer's place at the end
                    answers[key] = turns[-1]
        if not answers:
            raise InvalidValue(f"{', '.join(map(str, paths))}: no assistant turns to index")
        tokens = []
        for ids in tokenizer(list(answers.values()), add_special_tokens=False)["input_ids"]:
            tokens += ids + [SEPARATOR]
        return cls(tokens, **kw)

    def save(self, path, tokenizer_id: str, replace: bool = True, **info) -> dict:
        """Write the corpus (int32 ids, separators kept) with a JSON header naming the tokenizer (`tokenizer_id`,
        e.g. `pretokenized.tokenizer_fingerprint`) and the lookup settings, atomically; returns the header.
        replace=False: `path` must still be absent when the file is written (`files.writing`)."""
        from ..files import writing

        header = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": tokenizer_id,
            "tokens": len(self),
            "texts": int((self.tokens == SEPARATOR).sum()),
            "min_match": self.min_match,
            "max_ngram": self.max_ngram,
            "max_match": self.max_match,
            **info,
        }
        with writing(Path(path), replace=replace) as tmp, open(tmp, "wb") as f:
            np.savez_compressed(f, tokens=self.tokens.astype(np.int32), header=np.array(json.dumps(header)))
        return header

    @classmethod
    def load(cls, path, tokenizer_id: str | None = None, vocab_size: int | None = None) -> tuple[TokenStore, dict]:
        """(store, header) from a file `save` wrote; with `tokenizer_id`, refuse one made with another tokenizer, with
        `vocab_size`, one holding ids the target does not have. Every problem is a ValueError naming the file."""
        from ..reading import read_npz

        header, arrays = read_npz(
            path,
            ("tokens",),
            what="datastore",
            kind=FORMAT,
            version=VERSION,
            remedy="make one with `eagletree datastore`",
        )
        tokens = arrays["tokens"]
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or len(tokens) != header.get("tokens"):
            raise InvalidValue(
                f"{path}: {tokens.shape} {tokens.dtype} tokens, the header says {header.get('tokens')}; make it again"
            )
        if tokenizer_id is not None and header.get("tokenizer") != tokenizer_id:
            raise InvalidValue(
                f"{path}: made with tokenizer {header.get('tokenizer')}, but the target's is {tokenizer_id}; "
                "make it again with this target (`eagletree datastore`)"
            )
        if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
            raise InvalidValue(
                f"{path}: token id {int(tokens.max())} is past the target's vocabulary of {vocab_size}; "
                "make it again with this target (`eagletree datastore`)"
            )
        try:
            store = cls(tokens, **{k: header[k] for k in ("min_match", "max_ngram", "max_match")})
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidValue(f"{path}: bad lookup settings in the header ({e!r}); make it again") from None
        return store, header


def index_answers(sources: list[Path], tokenizer, out, min_match: int = 5, replace: bool = False) -> dict:
    """`eagletree datastore`: the assistant turns of the chat JSONL files `sources` (`TokenStore.from_chat_file`),
    indexed for retrieved spans whose match needs `min_match`+ context tokens, saved at `out` under the tokenizer's
    fingerprint (`replace`: over a store already there). Returns the saved header."""
    store = TokenStore.from_chat_file(
        sources, tokenizer, min_match=min_match, max_ngram=max(8, min_match), max_match=max(16, min_match)
    )
    names = [f.name for f in sources]
    source = names[0] if len(names) == 1 else names
    return store.save(out, vocab_fingerprint(tokenizer), replace=replace, source=source)

"""The batch's rows: the live sequences' shared target KV cache (ragged, one row each) and the batch drafter's
rows, reserved once, prefilled as sequences join and compacted as they finish."""

from __future__ import annotations

import time

from ..target.ragged import RaggedCache, use_ragged
from ..verify.batch import prefill_rows
from .sequence import SequenceState, head_features


class BatchRows:
    """The live sequences' shared state: the target's ragged KV cache and the batch drafter, one row each."""

    def __init__(self, decoder):
        """The rows of a decoding run of `decoder` (a Decoder): its target's cache and its batch drafter."""
        self.target = decoder.target
        head = decoder.head
        self.layers = head.feature_spec.layers if head is not None else None  # EAGLE-3 reads these target layers
        use_ragged(self.target)
        self.window = decoder.window  # (None: attention over the whole context)
        self.cache = RaggedCache()
        self.drafter = decoder.batch_drafter()
        self.draft_s = 0.0  # the drafter's seconds in the current step
        # the most entries a row holds past its prompt: the answer, and a pass's tree on top (a very long answer's
        # room past RESERVED_ANSWER is made as it grows)
        answer = min(decoder.config.max_new_tokens, self.RESERVED_ANSWER)
        self.beyond_prompt = answer + (decoder.searcher.budget if decoder.searcher else 1)
        self.limit = getattr(self.target.config, "max_position_embeddings", None)

    RESERVED_ANSWER = 2048

    def reserve(self, longest: int) -> None:
        """Room in every cache row for a prompt of `longest` tokens and its answer: allocated once, where growing
        the rows during decoding would copy the whole cache (and a pass would wait for it)."""
        if longest > 0:
            need = longest + self.beyond_prompt
            if self.limit is not None:  # (prompt and answer fit the context: `prompts.fit_context`)
                need = min(need, self.limit + self.beyond_prompt)
            self.cache.reserve(need, exact=True)
            if self.drafter is not None:
                self.drafter.reserve(need)

    def admit(self, new: list[SequenceState], live: list[SequenceState]) -> None:
        """Give each new sequence a row and prefill its prompt (all of them in one pass)."""
        self.reserve(max(seq.ids.numel() for seq in new))
        for seq in new:
            seq.row = self.cache.add_row()
            seq.done = False
            if self.drafter is not None:
                self.drafter.add_row()
        t = time.perf_counter()
        features = prefill_rows(self.target, self.cache, [s.row for s in new], [s.ids for s in new], self.layers)
        for seq, out in zip(new, features):
            if self.drafter is not None and out is not None:
                seq.feed(head_features(out[0], out[1], self.layers), seq.ids[1:], prompt=True)
            seq.stats.times["prefill"] += time.perf_counter() - t

    def room(self, seq: SequenceState) -> int:
        """How many entries `seq`'s next pass may add to its cache row: up to a sliding-window target's window
        (eagletree verifies over the whole cache); without a window, more than any pass adds."""
        if self.window is None:
            return 2**62
        return self.window - self.cache.lengths[seq.row]

    def overflow(self, seq: SequenceState) -> str | None:
        """Why `seq` cannot go on (its cache row holds the whole sliding window), or None."""
        if self.room(seq) >= 1:
            return None
        return (
            f"the answer reached the target's sliding window of {self.window} tokens (prompt {seq.ids.numel()} + "
            f"{seq.emitted} new tokens); eagletree verifies trees over the whole cache and does not decode past "
            "the window, so this answer ends here"
        )

    def release(self, done: list[SequenceState], live: list[SequenceState]) -> None:
        """Drop finished sequences' rows: the live ones take rows 0..n-1, those past n moving into the freed rows
        (the fewest rows' caches are copied), and `live` is put in row order (a pass's rows ascend)."""
        if not done:
            return
        n = len(live)
        staying = {seq.row for seq in live if seq.row < n}
        holes = (r for r in range(n) if r not in staying)
        new_row = {id(seq): seq.row if seq.row < n else next(holes) for seq in sorted(live, key=lambda s: s.row)}
        keep = [0] * n
        for seq in live:
            keep[new_row[id(seq)]] = seq.row
        self.cache.keep_rows(keep)
        if self.drafter is not None:
            self.drafter.keep_rows(keep)
        for seq in live:
            seq.row = new_row[id(seq)]
        live.sort(key=lambda seq: seq.row)

    def catch_up(self, seqs: list[SequenceState]) -> None:
        """The drafter reads the committed tokens of every sequence that drafts this step, in one call."""
        if not seqs:
            return
        t = time.perf_counter()
        feats, tokens, positions = zip(*(s.take_pending() for s in seqs))
        self.drafter.extend([s.row for s in seqs], list(feats), list(tokens), list(positions))
        self.draft_s += time.perf_counter() - t

    def expand_for(self, rows: list[int]):
        """The searches' expand_batch: job i drafts in row rows[i]; timed into draft_s."""

        def expand(requests):
            t = time.perf_counter()
            probs = self.drafter.expand([(rows[i], *rest) for i, *rest in requests])
            self.draft_s += time.perf_counter() - t
            return probs

        return expand

"""One decoding step for every live sequence in one target pass, as named stages (`Decoder._pass` runs them in
order): budget, choose who drafts, catch up, search, verify, book.

Terms, per live sequence: `left` is the tokens it still wants; `room` the entries its cache row may still take (up
to a sliding-window target's window); `reach` the most nodes its tree may have (the smaller of the two); `depth`
how deep drafting may go; `late` whether it may draft (`schedule.worth_drafting`); `drafts` whether the head drafts
for it this pass. A tree is the searcher's (from the head's drafts and copied spans), or the root alone.
"""

from __future__ import annotations

import time

from ..search.copy import copy_trie
from ..search.searchers import Job
from ..verify import DraftTree
from ..verify.batch import verify_rows
from .schedule import drafting_sequences, end_progress, worth_drafting
from .stats import Step


class Pass:
    """One target pass over `live` (the batch's sequences in row order) of a Decoder's run in `batch` (BatchRows)."""

    def __init__(self, decoder, batch, live: list):
        self.config, self.searcher, self.depth = decoder.config, decoder.searcher, decoder.depth
        self.target, self.stops = decoder.target, decoder.stops
        self.batch, self.live = batch, live
        self.started = time.perf_counter()
        batch.draft_s = 0.0

    def budget(self) -> None:
        """Each sequence's tokens left, room, reach and drafting depth."""
        config, searcher, live = self.config, self.searcher, self.live
        self.lefts = [config.max_new_tokens - seq.emitted for seq in live]
        # the nodes a tree may have: the tokens still wanted, and the room left in a sliding-window target's cache
        self.rooms = [self.batch.room(seq) for seq in live]
        self.reach = [min(left, room) for left, room in zip(self.lefts, self.rooms)]
        # drafting deeper than that, or than a tree of the budget's nodes reaches, is wasted
        top = min(self.depth, searcher.budget - 1) if searcher is not None else 0
        self.depths = [min(top, n - 1) for n in self.reach]

    def choose_drafting(self, waiting: bool) -> None:
        """Which sequences may draft (with tree "auto" and several sequences, unless a prompt is `waiting` for a
        place, only those that would end the batch last) and which the head drafts for this pass."""
        self.late = worth_drafting(self.live, self.reach, self.searcher, waiting)
        has_drafter = self.batch.drafter is not None
        self.drafts, self.drafting = drafting_sequences(self.live, self.depths, self.late, has_drafter, self.searcher)

    def catch_up(self, inspect_step) -> None:
        """The drafter reads the committed tokens of the sequences it drafts for (one call); `inspect_step` sees
        the first sequence's drafter before it drafts (its tree is reset after)."""
        batch, live = self.batch, self.live
        batch.catch_up([seq for seq, d in zip(live, self.drafts) if d])
        if inspect_step is not None and self.drafts[0]:
            inspect_step(batch.drafter.view(live[0].row), live[0].root)
            batch.drafter.begin_tree(live[0].row)

    def search(self) -> None:
        """The tree each sequence verifies: the head's drafts and copied spans of earlier text (also looked up
        after the head's best nodes' paths), searched to the budget; the root alone where there is nothing to
        draft from or the tree would run past the window."""
        live, searcher = self.live, self.searcher
        jobs, searched, self.copy_s = self._jobs()
        self.searched_any = bool(jobs)
        self.trees = [DraftTree.trusted([seq.root], [-1], [1.0], [0]) for seq in live]
        if jobs:
            if self.drafting:
                searcher.observe_catch_up(self.batch.draft_s)  # (what the catch-up just cost)
            rows = [live[i].row for i in searched]
            found = searcher.search_batch(self.batch.expand_for(rows), jobs, rows=len(live))
            for i, tree in zip(searched, found):
                if len(tree) <= self.rooms[i]:  # (else the root alone: the tree would run past the window)
                    self.trees[i] = tree
        draft_s = self.batch.draft_s
        self.times = {"draft": draft_s, "search": time.perf_counter() - self.started - draft_s}

    def _jobs(self) -> tuple[list[Job], list[int], float]:
        """The search jobs of the pass (the head's drafts and each sequence's copied spans, where `late`), the
        indices of the sequences they are for, and the seconds the copy lookups took."""
        config, searcher, live = self.config, self.searcher, self.live
        jobs, searched, looked_up = [], [], False
        copy_t = time.perf_counter()
        for i, (seq, n, d) in enumerate(zip(live, self.reach, self.depths)):
            copies = None
            if seq.index is not None and n > 1 and self.late[i] and searcher.takes_copies():
                looked_up = True
                copies = copy_trie(
                    seq.index,
                    seq.calibration,
                    config.copy.spans,
                    min(config.copy.length, searcher.budget - 1, n - 1),
                    at_nodes=self.drafts[i],
                    store=seq.store,
                )
            if self.drafts[i] or copies is not None:
                jobs.append(Job(self.drafts[i], seq.root, max(d, 1), copies))
                searched.append(i)
        copy_s = time.perf_counter() - copy_t
        if looked_up:
            searcher.observe_lookups(len(live), any(job.copies is not None for job in jobs))
        return jobs, searched, copy_s

    def verify(self) -> None:
        """Verify every tree in one target pass, accept each top-down, commit each accepted path's KV entries."""
        sampling, live = self.config.sampling, self.live
        self.results = verify_rows(
            self.target,
            self.batch.cache,
            [seq.row for seq in live],
            self.trees,
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            [seq.generator for seq in live],
            self.stops,
            layers=self.batch.layers,
        )

    def book(self):
        """Yield (sequence, Step) for each sequence once the searcher has learned what the pass cost and gave:
        its copy calibration learns, its tokens count (cut at max_new_tokens), and unless a stop token or
        max_new_tokens ends it, its tokens go to its drafter and copy index."""
        if self.searcher is not None:
            self._observe()
        config, batch = self.config, self.batch
        for seq, tree, result, left in zip(self.live, self.trees, self.results, self.lefts):
            copied = seq.learn(tree, result.accepted)
            tokens = result.tokens[:left]
            seq.emitted += len(tokens)
            if len(tree) > 1:
                seq.tree_passes += 1
                seq.tree_tokens += len(tokens)
            seq.done = result.stopped or seq.emitted >= config.max_new_tokens
            if not seq.done:
                seq.commit(result, batch.layers, batch.drafter is not None)
            step_times = dict(self.times, **result.times)
            yield seq, Step(tokens, tree, result.accepted, step_times, len(result.tokens), copied, result.stopped)

    def _observe(self) -> None:
        """The searcher learns the pass's cost and what it did for the batch's end (tree "auto"'s cost rule)."""
        searcher, live, results = self.searcher, self.live, self.results
        emitted = end_progress([min(len(r.tokens), left) for r, left in zip(results, self.lefts)], self.late)
        searcher.observe(
            sum(len(tree) for tree in self.trees),
            results[0].times["verify"] + sum(r.times["accept"] + r.times["commit"] for r in results),
            sum(len(r.accepted) - 1 for r in results),
            len(live),
            self.copy_s,
        )
        seconds = time.perf_counter() - self.started
        searcher.observe_step(len(live), emitted, seconds, self.searched_any, self.drafting)

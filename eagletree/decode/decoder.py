"""The Decoder: one target, tokenizer, head and DecodeConfig, and what they resolve to once (the tree kind's
searcher, the device's latency profile, the head's calibrations and datastore).

`Decoder.steps` runs the decoding step of docs/design.md in a loop, one `Step` per target pass; `Decoder.results`
decodes many prompts together (continuous batching: `schedule`); `Decoder.generate` returns the text and the
statistics people tune with (tokens per pass, predicted vs measured, where the time went). Each pass is
`step.Pass`'s stages over the batch's rows (`rows.BatchRows`), one `sequence.SequenceState` per prompt.
"""

from __future__ import annotations

import time
from copy import deepcopy

import torch

from ..draft import HeadError
from ..draft.base import check_loaded
from ..draft.batch_drafter import drafter_key, make_batch_drafter
from ..errors import InvalidType, InvalidValue
from ..search.copy import CopyCalibration
from ..search.searchers import AutoSearcher, make_searcher
from ..search.store import TokenStore
from ..target.loading import TargetError
from ..target.ragged import sliding_window, use_ragged
from .config import DecodeConfig, TreeKind
from .prompts import check_token_ids, encode_prompt, fit_context, fit_window, prompt_list, stop_token_ids
from .resources import (
    add_batch_times,
    head_calibrator,
    head_copy_calibration,
    latency_profile,
    profile_path,
    resolve_store,
)
from .rows import BatchRows
from .schedule import PromptQueue
from .sequence import SequenceState
from .stats import GenerationResult, GenerationStats
from .step import Pass
from .text import decode_text, stream_text


class Decoder:
    """Lossless speculative decoding of prompts with one target, tokenizer, head and DecodeConfig.

    Built once, it checks the head against the target, resolves the stop tokens, the tree kind's searcher,
    and what the config's tree and copying read (the device's latency profile for `auto`, the head's
    calibration, copy table and datastore); each `steps` or `generate` call then decodes one prompt.
    head is a loaded DraftHead (`eagletree.loading.load_head` reads a folder) or None, which decodes without a head:
    plain decoding, or copied spans alone when copying is on; config a DecodeConfig (`DecodeConfig.from_options`
    builds one from keyword options) or None for the defaults; anything else is refused (InvalidType).
    profile: a LatencyProfile for `auto` (default: measured on this device once and cached); calibrator and
    copy_calibration: instead of the ones saved next to the head (a given copy_calibration keeps learning across
    prompts; the head's is reloaded for each prompt).
    """

    def __init__(
        self,
        target,
        tokenizer,
        head,
        config: DecodeConfig | None = None,
        *,
        profile=None,
        calibrator=None,
        copy_calibration: CopyCalibration | None = None,
    ):
        check_parts(head, config)
        self.target, self.tokenizer, self.head = target, tokenizer, head
        self.device = next(target.parameters()).device
        self.config = config = (config or DecodeConfig()).for_device(self.device)
        if head is not None:
            check_head(head, target, config)
        self.stops = stop_token_ids(target, tokenizer, config.stop)
        copies = config.copies
        if config.tree is TreeKind.AUTO and head is not None and calibrator is None:
            calibrator = head_calibrator(head)
        self._shared_copy_calibration = copy_calibration is not None
        self.copy_calibration = (
            None
            if not copies
            else (copy_calibration if copy_calibration is not None else head_copy_calibration(head, config.copy.length))
        )
        self.store: TokenStore | None = resolve_store(
            config.copy.datastore, head, tokenizer, copies, target.get_input_embeddings().num_embeddings
        )
        self.window = sliding_window(target)  # a sliding-window target's: no prompt or answer goes past it
        self._drafter, self._drafter_key = None, None  # the batch drafter, kept across runs (`batch_drafter`)
        self._drafter_busy = False
        self._profile_path = None  # the cached profile's file (batch sizes measured later are added to it)
        # the deepest level drafted: the config's, as deep as the head drafts
        self.depth = min(config.depth, (head.drafting.max_depth if head is not None else None) or config.depth)
        self.searcher = self._make_searcher(profile, calibrator) if head is not None or copies else None
        if self.searcher is not None and head is not None:
            self.searcher.set_drafting(head.drafting)

    def _make_searcher(self, profile, calibrator):
        """The tree kind's searcher; `auto`'s with `profile` (default: this device's, measured once and cached)."""
        config = self.config
        if config.tree is TreeKind.AUTO:
            if profile is None:
                use_ragged(self.target)  # (the cached profile's name says which attention it measured)
                self._profile_path = profile_path(self.target)
            profile = deepcopy(profile) if profile is not None else latency_profile(self.target)
        return make_searcher(
            config.tree.value,
            config.budget,
            self.depth,
            config.top_k_draft,
            self.device,
            None,
            config.accept_by_rank,
            config.tree_paths,
            profile,
            calibrator,
        )

    def steps(self, prompt, stats: GenerationStats | None = None, inspect_step=None):
        """Yield one Step per target pass decoding `prompt` (chat messages, a string or token ids); each is
        recorded in `stats`. The prompt is checked at the call; the work happens as the steps are read.

        `inspect_step(drafter, root)` is called before each step's drafting (analysis: e.g. build other trees
        from the same drafter state); the drafter's tree is reset after it.
        """
        ids = self._prompt_ids(prompt)
        stats = stats if stats is not None else GenerationStats()
        if self.config.max_new_tokens == 0:
            return iter(())
        return self._steps_of(ids, stats, inspect_step)

    def _steps_of(self, ids: torch.Tensor, stats: GenerationStats, inspect_step):
        """`steps`' decoding of one prompt: its Steps; a TargetError when the sequence cannot go on (its answer
        reached the target's sliding window), after the Steps that fit."""
        for seq, step in self._run(iter([(0, ids, stats)]), 1, inspect_step):
            if step is not None:
                yield step
            elif seq.error is not None:
                raise TargetError(seq.error)

    def generate(self, prompt, stream: bool = False, inspect_step=None):
        """A GenerationResult for `prompt`, or with stream=True an iterator of its text pieces."""
        stats = GenerationStats()
        tokens = (step.tokens for step in self.steps(prompt, stats, inspect_step))
        if stream:
            return stream_text(self.tokenizer, tokens)
        ids = [t for pass_tokens in tokens for t in pass_tokens]
        return GenerationResult(decode_text(self.tokenizer, ids), ids, stats)

    def generate_batch(self, prompts, batch_size: int = 8) -> list[GenerationResult]:
        """One GenerationResult per prompt (in order), decoded `batch_size` at a time in shared target passes."""
        prompts = prompt_list(prompts)
        results: list = [None] * len(prompts)
        for i, result in self.results(prompts, batch_size):
            results[i] = result
        return results

    def results(self, prompts, batch_size: int = 8, keys=None):
        """Yield (index, GenerationResult) for each of `prompts` as it finishes, decoding up to `batch_size` of
        them together: every pass verifies all live sequences' trees, and a finished sequence's place goes to
        the next prompt (continuous batching). `prompts` is a list of them (`prompt_list`); every prompt is checked
        before decoding starts (a bad one is an InvalidType or InvalidValue naming its index, and nothing is
        decoded); a sequence that cannot go on found
        later (its answer reached a sliding-window target's window) ends with its `error` set and the tokens it
        had, and the others decode on as they would alone. `keys`: each prompt's key (default: its position), yielded
        in place of its index and seeding its sampling, so that a run resumed without its answered prompts draws
        what the whole run would have."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise InvalidValue(f"batch_size must be an integer >= 1, got {batch_size!r}")
        checked, prompts = [], prompt_list(prompts)
        keys = list(range(len(prompts))) if keys is None else list(keys)
        if len(keys) != len(prompts) or len(set(keys)) != len(keys):
            raise InvalidValue(f"keys must be {len(prompts)} distinct keys, one per prompt, got {len(keys)}")
        for i, prompt in enumerate(prompts):
            try:
                checked.append((keys[i], self._prompt_ids(prompt), GenerationStats()))
            except (TypeError, ValueError) as e:  # (the tokenizer's own too: a UnicodeError takes other arguments)
                raise (InvalidType if isinstance(e, TypeError) else InvalidValue)(f"prompt {i}: {e}") from e
        if self.config.max_new_tokens == 0:
            for i, _, stats in checked:
                yield i, GenerationResult("", [], stats)
            return
        tokens: dict[int, list[int]] = {i: [] for i, _, _ in checked}
        longest = max((ids.numel() for _, ids, _ in checked), default=0)
        for seq, step in self._run(iter(checked), min(batch_size, max(len(checked), 1)), None, longest):
            i = seq.key
            if step is not None:
                tokens[i] += step.tokens
                continue
            yield i, GenerationResult(decode_text(self.tokenizer, tokens[i]), tokens.pop(i), seq.stats, seq.error)

    def prepare(self, batch_size: int) -> None:
        """Measure what decoding `batch_size` sequences at a time needs and this device's profile lacks (tree
        "auto": the passes of 2 .. batch_size sequences, seconds on a CPU; saved with the cached profile), so
        that the first batch does not pay for it. Decoding calls it too."""
        if isinstance(self.searcher, AutoSearcher) and batch_size > 1:
            add_batch_times(self.target, self.searcher.initial_profile, batch_size, self._profile_path)

    def batch_drafter(self):
        """A batch drafter of the head with no rows for a decoding run (None without a head); hand it back with
        `drafter_done`. One is kept across runs (its lean layer and kernel choice cost milliseconds, a few percent
        of a short answer) while the head and the target's embedding and lm_head are the same modules with the
        same weights; a run that starts while another is unfinished (two `steps` iterators read in turns) gets
        one of its own."""
        if self.head is None:
            return None
        if self._drafter_busy:
            return make_batch_drafter(self.head, self.target)
        if self._drafter is None or drafter_key(self.head, self.target) != self._drafter_key:
            self._drafter = None
            self._drafter = make_batch_drafter(self.head, self.target)
            self._drafter_key = drafter_key(self.head, self.target)  # (building may swap the head's Linears)
        self._drafter_busy = True  # (a kept drafter was emptied when its last run ended: `drafter_done`)
        return self._drafter

    def drafter_done(self, drafter) -> None:
        """A run is over with `drafter` (from `batch_drafter`)."""
        if drafter is not None and drafter is self._drafter:
            drafter.reset()  # (its cache's memory goes now, not at the next run)
            self._drafter_busy = False

    def _prompt_ids(self, prompt) -> torch.Tensor:
        """The prompt's ids, checked against the vocabulary, the context and a sliding window (cut to its end with
        truncate_prompt)."""
        ids = encode_prompt(self.tokenizer, prompt)
        check_token_ids(self.target, ids)
        wanted, truncate = self.config.max_new_tokens, self.config.truncate_prompt
        ids = fit_context(ids, getattr(self.target.config, "max_position_embeddings", None), wanted, truncate)
        return fit_window(ids, self.window, wanted, truncate).to(self.device)

    def _new_sequence(self, key, ids, stats) -> SequenceState:
        """A sequence of the prompt `ids` under `key`, with its own seeded generator and copy calibration."""
        seed = self.config.sampling.seed
        generator = torch.Generator().manual_seed((seed + key) % 2**64) if seed is not None else None
        copy_calibration = self.copy_calibration
        if copy_calibration is not None and not self._shared_copy_calibration:
            copy_calibration = deepcopy(copy_calibration)  # each prompt starts from the head's table
        return SequenceState(key, ids, stats, generator, copy_calibration, self.store)

    def _run(self, jobs, batch_size: int, inspect_step, longest: int = 0):
        """The decoding loop over (key, ids, stats) jobs, `batch_size` sequences at a time: yields (sequence, Step)
        per sequence and pass (recorded in its stats), and (sequence, None) when a sequence is done: finished, or
        ended by `error` (its answer reached the target's sliding window; the others go on). `longest`: the
        longest prompt of the jobs, when known (the cache's rows get their room once)."""
        self.prepare(batch_size)
        if self.searcher is not None:
            self.searcher.start()
        batch = BatchRows(self)
        try:
            batch.reserve(longest)
            if self.searcher is not None and batch.drafter is not None:
                self.searcher.token_map = batch.drafter.token_map  # the drafter's draft ids -> target ids
            yield from self._loop(jobs, batch, batch_size, inspect_step)
        finally:
            self.drafter_done(batch.drafter)

    def _loop(self, jobs, batch: BatchRows, batch_size: int, inspect_step):
        """`_run`'s loop: admit jobs into free places, one pass over the live sequences, release the done ones."""
        live: list[SequenceState] = []
        queue = PromptQueue(jobs)  # whether a prompt waits for a place decides what `_pass` drafts
        queued = queue.waiting
        while True:
            admitted = [self._new_sequence(*job) for job in queue.take(batch_size - len(live))]
            if admitted:
                batch.admit(admitted, live)
                live += admitted
            if queued and not queue.waiting:  # the last prompt has joined: from now on the batch's end is what counts
                queued = False
                if isinstance(self.searcher, AutoSearcher):
                    self.searcher.batch_end()
            if not live:
                return
            for seq in live:
                seq.error = batch.overflow(seq)
                seq.done = seq.error is not None
            if not any(seq.done for seq in live):
                for seq, step in self._pass(batch, live, inspect_step, waiting=queue.waiting):
                    seq.stats.record(step)
                    seq.stats.seconds = time.perf_counter() - seq.started
                    yield seq, step
            done = [seq for seq in live if seq.done]
            live = [seq for seq in live if not seq.done]
            batch.release(done, live)
            for seq in done:
                seq.stats.seconds = time.perf_counter() - seq.started
                yield seq, None

    def _pass(self, batch: BatchRows, live: list[SequenceState], inspect_step, waiting: bool = True):
        """The decoding step of docs/design.md for every live sequence, in one target pass: `step.Pass`'s stages
        in order. Yields (sequence, Step). With tree="auto" and several sequences, unless a prompt is `waiting` for
        a place, only the sequences that would end the batch last draft (`schedule.late_sequences`)."""
        step = Pass(self, batch, live)
        step.budget()
        step.choose_drafting(waiting)
        step.catch_up(inspect_step)
        step.search()
        step.verify()
        yield from step.book()


def check_parts(head, config) -> None:
    """InvalidType unless `head` is a loaded DraftHead (or None) and `config` a DecodeConfig (or None)."""
    check_loaded(head)
    if config is not None and not isinstance(config, DecodeConfig):
        raise InvalidType(
            f"config must be a DecodeConfig or None, got {type(config).__name__} {config!r:.60}; build one with "
            "DecodeConfig(...) or DecodeConfig.from_options(**options), or pass the options to eagletree.generate"
        )


def check_head(head, target, config: DecodeConfig) -> None:
    """HeadError unless the head drafts for this target, on its device, in a float dtype."""
    head.check_target(target.config)
    head_dtype, head_device = next(head.parameters()).dtype, next(head.parameters()).device
    if not head_dtype.is_floating_point:
        raise HeadError(f"the head's dtype {head_dtype} is not a floating-point type")
    target_device = next(target.parameters()).device
    if head_device != target_device:
        raise HeadError(
            f"the head is on {head_device} but the target on {target_device}; move the head there "
            f"(head.to({str(target_device)!r}))"
        )
    paths = config.tree_paths
    deepest = head.drafting.max_depth
    if paths is not None and deepest is not None and max(len(p) for p in paths) > deepest:
        raise HeadError(
            f"tree_paths reach depth {max(len(p) for p in paths)}, but this {head.head_type!r} head drafts "
            f"{deepest} levels deep at most"
        )
    if paths is not None and max(max(p) for p in paths) >= head.drafted_vocab_size():
        raise HeadError(
            f"tree_paths rank {max(max(p) for p in paths)} is past the head's draft vocabulary "
            f"of {head.drafted_vocab_size()} tokens"
        )

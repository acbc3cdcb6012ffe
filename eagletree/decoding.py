"""Speculative generation: draft a tree with the head, verify it in one target pass, accept, commit.

A `Decoder` holds one target, tokenizer, head and `DecodeConfig`, and what they resolve to once (the tree
kind's searcher, the device's latency profile, the head's calibrations and datastore); `Decoder.steps`
runs the decoding step of docs/design.md in a loop, one `Step` per target pass, and `Decoder.generate`
returns the text and the statistics people tune with (tokens per pass, predicted vs measured, where the
time went). `generate` and `decode_steps` are the one-call forms.
"""

from __future__ import annotations

import numbers
import statistics
import time
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .decode_config import DecodeConfig, TreeKind
from .decode_resources import (
    COMPANION_FILES,
    add_batch_times,
    head_calibrator,
    head_copy_calibration,
    latency_profile,
    profile_path,
    resolve_store,
)
from .draft_heads.batch_drafter import drafter_key, make_batch_drafter
from .target.loading import TargetError
from .target.ragged import RaggedCache, sliding_window, use_ragged
from .tree_search.copy import CopyCalibration, NgramIndex, copy_only, copy_trie
from .tree_search.searchers import AutoSearcher, Job, make_searcher
from .tree_search.store import TokenStore
from .verify import DraftTree
from .verify.batch import prefill_rows, verify_rows


@dataclass
class GenerationStats:
    new_tokens: int = 0
    passes: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per pass
    predicted: list[float] = field(default_factory=list)  # the tree's E[tokens/pass] per pass
    times: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("prefill", "draft", "search", "verify", "accept", "commit"), 0.0)
    )
    seconds: float = 0.0
    steps: list | None = None  # (DraftTree, accepted node indices) per pass, when asked for (calibration)
    copied_tokens: int = 0  # accepted draft tokens that only a copied span proposed (not the head too)

    def record(self, step) -> None:
        """Count one decoding Step."""
        self.passes += 1
        self.new_tokens += len(step.tokens)
        self.accepted_lengths.append(step.length)
        self.predicted.append(step.draft.expected_tokens)
        for k, v in step.times.items():
            self.times[k] += v
        self.copied_tokens += step.copied
        if self.steps is not None:
            self.steps.append((step.draft, step.accepted))

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.passes if self.passes else 0.0

    @property
    def predicted_tokens_per_pass(self) -> float:
        return sum(self.predicted) / len(self.predicted) if self.predicted else 0.0

    def histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for n in self.accepted_lengths:
            hist[n] = hist.get(n, 0) + 1
        return dict(sorted(hist.items()))

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "passes": self.passes,
            "tokens_per_pass": self.tokens_per_pass,
            "predicted_tokens_per_pass": self.predicted_tokens_per_pass,
            "accepted_histogram": self.histogram(),
            "copied_tokens": self.copied_tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.new_tokens / self.seconds if self.seconds else 0.0,
            "times": dict(self.times),
        }


@dataclass
class GenerationResult:
    """One prompt's answer. `error`: why decoding that sequence ended early (e.g. its answer reached a
    sliding-window target's window), with the tokens decoded before it kept; None when it finished."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    error: str | None = None


def whole_answers(results: list[GenerationResult]) -> list[GenerationResult]:
    """`results` (in prompt order) when every answer finished; else a TargetError naming the first prompt whose
    decoding ended early and why: for measurements and comparisons that need whole answers (a cut one would pass
    for the target's answer, its tokens/s and tokens/pass counted), as decoding one prompt alone raises it."""
    for i, result in enumerate(results):
        if result.error is not None:
            raise TargetError(f"prompt {i}: {result.error}")
    return results


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


def hf_generation_config(max_new_tokens: int, temperature: float, eos_token_id, top_k=None, top_p=None, **extra):
    """A transformers GenerationConfig for plain decoding as eagletree decodes: every logits-shaping value set
    (`generate` fills the unset ones from the model's own generation_config, where a repetition_penalty or a
    top_k would make "plain decoding" another decoder than the one compared against)."""
    from transformers import GenerationConfig

    sample = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        do_sample=sample,
        temperature=temperature if sample else 1.0,
        top_k=(top_k or 0) if sample else 50,
        top_p=(top_p or 1.0) if sample else 1.0,
        typical_p=1.0,
        min_p=None,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        **extra,
    )


@dataclass
class Step:
    """One target pass: what it emitted, the tree it verified, and where its time went."""

    tokens: list[int]  # emitted by this pass (cut at max_new_tokens)
    draft: DraftTree
    accepted: list[int]  # accepted node indices, root first
    times: dict[str, float]  # seconds: draft, search, verify, accept, commit
    length: int = 0  # tokens the pass produced, before the max_new_tokens cut
    copied: int = 0  # accepted draft tokens that only a copied span proposed
    stopped: bool = False  # a stop token was emitted


class _Sequence:
    """One sequence being decoded: its prompt, cache row, what the drafter has not read yet, and its copy index.

    Committed (features, next tokens) wait in `pending` until the drafter drafts: it catches up right before
    (one call for every sequence that drafts), so steps that do not draft (tree="auto" pausing) cost it nothing.
    Past the prompt, only the last MAX_BACKLOG committed positions wait: after a long pause (hundreds of steps in a
    large batch) the drafter sees the prompt and the recent tokens, at their positions, and a catch-up costs about
    a level's call rather than one row per step paused. Drafts only: the target verifies them.
    """

    MAX_BACKLOG = 64

    def __init__(self, key, ids: torch.Tensor, stats, generator, copy_calibration: CopyCalibration | None, store):
        self.key, self.ids, self.stats, self.generator = key, ids, stats, generator
        self.row = -1
        self.root = int(ids[-1])
        self.emitted = 0
        self.pending: list[tuple] = []  # (features [m, F], next tokens [m], position of the first)
        self.fed = 0  # committed positions so far: the next one's position
        self.backlog = 0  # positions pending past the prompt's
        self.prompt_pending = False  # pending[0] is the prompt's
        self.calibration = copy_calibration
        self.index = NgramIndex(ids.tolist()) if copy_calibration is not None else None  # prompt + emitted tokens
        self.store = store  # a corpus copied from too (retrieved spans), or None
        self.started = time.perf_counter()
        self.tree_passes = self.tree_tokens = 0  # passes that verified drafted nodes, and the tokens they emitted
        self.done = False
        self.error: str | None = None  # why the sequence ended before finishing (the tokens so far are kept)

    @property
    def tree_rate(self) -> float:
        """Tokens per pass of this sequence's passes with drafted nodes, with a prior of 2 worth one pass (a
        sequence that has not drafted yet is expected to gain what trees usually gain)."""
        return (self.tree_tokens + 2.0) / (self.tree_passes + 1.0)

    def learn(self, draft: DraftTree, accepted: list[int]) -> int:
        """Update the copy calibration with a verified tree; returns the accepted tokens only a copy proposed."""
        if draft.copy_info is None:
            return 0
        self.calibration.update(draft, accepted)
        return sum(copy_only(draft.copy_info[v]) for v in accepted[1:])

    def commit(self, step, layers, drafting: bool) -> None:
        """A verified pass's tokens reach the drafter (at its next catch-up) and the copy index."""
        if drafting:
            device = step.hidden.device
            self.feed(_features(step.hidden, step.layer_hidden, layers), torch.tensor(step.tokens, device=device))
        if self.index is not None:
            self.index.extend(step.tokens)
        self.root = step.tokens[-1]

    def feed(self, features: torch.Tensor, next_tokens: torch.Tensor, prompt: bool = False) -> None:
        """Committed positions (features [m, F] and the token after each) for the drafter's next catch-up; past the
        prompt's, the oldest beyond MAX_BACKLOG are dropped."""
        self.pending.append((features, next_tokens, self.fed))
        self.fed += features.shape[0]
        if prompt:
            self.prompt_pending = True
            return
        self.backlog += features.shape[0]
        first = 1 if self.prompt_pending else 0
        over = self.backlog - self.MAX_BACKLOG
        while over > 0:
            f, n, start = self.pending[first]
            if f.shape[0] <= over:
                del self.pending[first]
                over -= f.shape[0]
                self.backlog -= f.shape[0]
            else:
                self.pending[first] = (f[over:], n[over:], start + over)
                self.backlog -= over
                over = 0

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features, next tokens, positions) of every pending position, in order; none is pending after."""
        feats = torch.cat([f for f, _, _ in self.pending])
        tokens = torch.cat([n for _, n, _ in self.pending])
        positions = torch.cat([torch.arange(start, start + f.shape[0]) for f, _, start in self.pending])
        self.pending.clear()
        self.prompt_pending = False
        self.backlog = 0
        return feats, tokens, positions


def late_sequences(lefts: list[int], rates: list[float]) -> list[bool]:
    """Which sequences of a batch that no prompt waits to join are worth drafting for: those that would finish
    after the batch's estimated end (the most passes any sequence needs drafting) if they decoded plainly.

    Once nothing waits for a place, the batch takes as long as its longest-running answer: a sequence that
    finishes early leaves its place empty. A pass costs a fixed part (reading the weights) plus a part per row,
    and a tree adds rows for fewer extra tokens than rows (at most one accepted token a node), so drafted nodes
    pay only where they cut the number of passes the batch still needs. The batch's end is estimated as the most
    passes any sequence needs drafting (`lefts[i] / rates[i]`: tokens left over its tokens per drafted pass);
    a sequence with at most that many tokens left finishes by then even one token a pass, so it decodes plainly
    (its rows leave the passes cheaper), and the others draft, which brings their ends together."""
    if len(lefts) != len(rates) or min(rates, default=1.0) <= 0:
        raise ValueError(f"need one positive rate per sequence, got lefts {lefts} and rates {rates}")
    end = max((left / rate for left, rate in zip(lefts, rates)), default=0.0)
    return [left > end for left in lefts]


def end_progress(emitted: list[int], late: list[bool]) -> float:
    """What a pass did for a batch's end, in tokens of a plain pass's worth (one a sequence): the late sequences'
    mean tokens, once per sequence of the pass, when some decoded plainly (`late_sequences`); else the tokens."""
    if any(late) and not all(late):
        return statistics.mean(n for n, k in zip(emitted, late) if k) * len(emitted)
    return float(sum(emitted))


def _features(hidden, layer_hidden, layers):
    """The head's input features: the last hidden state, or the concatenated fused layers (EAGLE-3)."""
    return hidden if not layers else torch.cat([layer_hidden[i] for i in layers], dim=-1)


class Decoder:
    """Lossless speculative decoding of prompts with one target, tokenizer, head and DecodeConfig.

    Built once, it checks the head against the target, resolves the stop tokens, the tree kind's searcher,
    and what the config's tree and copying read (the device's latency profile for `auto`, the head's
    calibration, copy table and datastore); each `steps` or `generate` call then decodes one prompt.
    head=None decodes without a head: plain decoding, or copied spans alone when copying is on.
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
        self.target, self.tokenizer, self.head = target, tokenizer, head
        self.device = next(target.parameters()).device
        self.config = config = (config or DecodeConfig()).for_device(self.device)
        if head is not None:
            _check_head(head, target, config)
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
        self.searcher = None
        self._profile_path = None  # the cached profile's file (batch sizes measured later are added to it)
        if head is not None or copies:
            if config.tree is TreeKind.AUTO:
                if profile is None:
                    use_ragged(target)  # (the cached profile's name says which attention it measured)
                    self._profile_path = profile_path(target)
                profile = deepcopy(profile) if profile is not None else latency_profile(target)
            self.searcher = make_searcher(
                config.tree.value,
                config.budget,
                config.depth,
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
        results: list = [None] * len(prompts)
        for i, result in self.results(prompts, batch_size):
            results[i] = result
        return results

    def results(self, prompts, batch_size: int = 8):
        """Yield (index, GenerationResult) for each of `prompts` as it finishes, decoding up to `batch_size` of
        them together: every pass verifies all live sequences' trees, and a finished sequence's place goes to
        the next prompt (continuous batching). Every prompt is checked before decoding starts (a bad one is a
        TypeError or ValueError naming its index, and nothing is decoded); a sequence that cannot go on found
        later (its answer reached a sliding-window target's window) ends with its `error` set and the tokens it
        had, and the others decode on as they would alone."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        checked = []
        for i, prompt in enumerate(prompts):
            try:
                checked.append((i, self._prompt_ids(prompt), GenerationStats()))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompt {i}: {e}") from e
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
        """The prompt's ids, checked against the vocabulary and the context (cut to its end with truncate_prompt)."""
        ids = encode_prompt(self.tokenizer, prompt)
        check_token_ids(self.target, ids)
        limit, wanted = getattr(self.target.config, "max_position_embeddings", None), self.config.max_new_tokens
        if limit is not None and ids.numel() + wanted > limit:
            if not self.config.truncate_prompt or wanted >= limit:
                raise ValueError(
                    f"prompt ({ids.numel()} tokens) + max_new_tokens ({wanted}) exceeds the model's "
                    f"context of {limit} tokens; shorten the prompt or ask for fewer new tokens (in "
                    "Python, truncate_prompt=True keeps the prompt's last tokens)"
                )
            ids = ids[-(limit - wanted) :]
        return self._fit_window(ids).to(self.device)

    def _fit_window(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids`, or ValueError when the prompt is longer than the target's sliding window: eagletree verifies
        trees over the full cache, so it decodes no token past the window (truncate_prompt keeps the prompt's last
        tokens that leave max_new_tokens of room in it). An answer that reaches the window ends there (`_run`)."""
        window, wanted = self.window, self.config.max_new_tokens
        if window is None:
            return ids
        if self.config.truncate_prompt and wanted < window and ids.numel() + wanted > window:
            return ids[-(window - wanted) :]
        if ids.numel() > window:
            raise ValueError(
                f"prompt ({ids.numel()} tokens) is longer than the target's sliding window of {window} tokens, "
                "past which eagletree does not decode (tree verification needs the whole cache); shorten the "
                "prompt (in Python, truncate_prompt=True keeps the prompt's last tokens)"
            )
        return ids

    def _new_sequence(self, key, ids, stats) -> _Sequence:
        seed = self.config.sampling.seed
        generator = torch.Generator().manual_seed((seed + key) % 2**64) if seed is not None else None
        copy_calibration = self.copy_calibration
        if copy_calibration is not None and not self._shared_copy_calibration:
            copy_calibration = deepcopy(copy_calibration)  # each prompt starts from the head's table
        return _Sequence(key, ids, stats, generator, copy_calibration, self.store)

    def _run(self, jobs, batch_size: int, inspect_step, longest: int = 0):
        """The decoding loop over (key, ids, stats) jobs, `batch_size` sequences at a time: yields (sequence, Step)
        per sequence and pass (recorded in its stats), and (sequence, None) when a sequence is done: finished, or
        ended by `error` (its answer reached the target's sliding window; the others go on). `longest`: the
        longest prompt of the jobs, when known (the cache's rows get their room once)."""
        self.prepare(batch_size)
        if self.searcher is not None:
            self.searcher.start()
        batch = _Batch(self)
        try:
            batch.reserve(longest)
            if self.searcher is not None and batch.drafter is not None:
                self.searcher.token_map = batch.drafter.token_map  # the drafter's draft ids -> target ids
            yield from self._loop(jobs, batch, batch_size, inspect_step)
        finally:
            self.drafter_done(batch.drafter)

    def _loop(self, jobs, batch: _Batch, batch_size: int, inspect_step):
        """`_run`'s loop: admit jobs into free places, one pass over the live sequences, release the done ones."""
        live: list[_Sequence] = []
        jobs = iter(jobs)
        ahead = next(jobs, None)  # the next job, if any: whether one waits for a place decides what `_pass` drafts
        queued = ahead is not None
        while True:
            admitted = []
            while ahead is not None and len(live) + len(admitted) < batch_size:
                admitted.append(self._new_sequence(*ahead))
                ahead = next(jobs, None)
            if admitted:
                batch.admit(admitted, live)
                live += admitted
            if queued and ahead is None:  # the last prompt has joined: from now on the batch's end is what counts
                queued = False
                if isinstance(self.searcher, AutoSearcher):
                    self.searcher.batch_end()
            if not live:
                return
            for seq in live:
                seq.error = batch.overflow(seq)
                seq.done = seq.error is not None
            if not any(seq.done for seq in live):
                for seq, step in self._pass(batch, live, inspect_step, waiting=ahead is not None):
                    seq.stats.record(step)
                    seq.stats.seconds = time.perf_counter() - seq.started
                    yield seq, step
            done = [seq for seq in live if seq.done]
            live = [seq for seq in live if not seq.done]
            batch.release(done, live)
            for seq in done:
                seq.stats.seconds = time.perf_counter() - seq.started
                yield seq, None

    def _pass(self, batch: _Batch, live: list[_Sequence], inspect_step, waiting: bool = True):
        """The decoding step of docs/design.md for every live sequence, in one target pass: draft, search,
        verify, accept, commit. Yields (sequence, Step). With tree="auto" and several sequences, unless a prompt is
        `waiting` for a place, only the sequences that would end the batch last draft (`late_sequences`)."""
        config, searcher = self.config, self.searcher
        t = time.perf_counter()
        batch.draft_s = 0.0
        lefts = [config.max_new_tokens - seq.emitted for seq in live]
        # the nodes a tree may have: the tokens still wanted, and the room left in a sliding-window target's cache
        rooms = [batch.room(seq) for seq in live]
        reach = [min(left, room) for left, room in zip(lefts, rooms)]
        # drafting deeper than that, or than a tree of the budget's nodes reaches, is wasted
        top = min(config.depth, searcher.budget - 1) if searcher is not None else 0
        depths = [min(top, n - 1) for n in reach]
        late = [True] * len(live)
        if not waiting and len(live) > 1 and isinstance(searcher, AutoSearcher):
            late = late_sequences(reach, [seq.tree_rate for seq in live])
        # 1. Draft: the head, when it drafts this step (one catch-up call for all that do), and copied spans of
        #    earlier text, also looked up after the head's best nodes' paths.
        could = [d >= 1 and bool(s.pending) and batch.drafter is not None and k for s, d, k in zip(live, depths, late)]
        drafting = any(could) and searcher.drafts(len(live))
        drafts = [c and drafting for c in could]
        batch.catch_up([seq for seq, d in zip(live, drafts) if d])
        if inspect_step is not None and drafts[0]:
            inspect_step(batch.drafter.view(live[0].row), live[0].root)
            batch.drafter.begin_tree(live[0].row)
        jobs, searched, copy_s = self._jobs(live, reach, depths, drafts, late)
        # 2. Search: the nodes this pass verifies (the root alone where there is nothing to draft from).
        trees = [DraftTree.trusted([seq.root], [-1], [1.0], [0]) for seq in live]
        if jobs:
            rows = [live[i].row for i in searched]
            found = searcher.search_batch(batch.expand_for(rows), jobs, rows=len(live))
            for i, tree in zip(searched, found):
                if len(tree) <= rooms[i]:  # (else the root alone: the tree would run past the window)
                    trees[i] = tree
        times = {"draft": batch.draft_s, "search": time.perf_counter() - t - batch.draft_s}
        # 3-5. Verify every tree in one target pass, accept each top-down, commit each accepted path's KV entries.
        sampling = config.sampling
        results = verify_rows(
            self.target,
            batch.cache,
            [seq.row for seq in live],
            trees,
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
            [seq.generator for seq in live],
            self.stops,
            layers=batch.layers,
        )
        if searcher is not None:
            emitted = end_progress([min(len(r.tokens), left) for r, left in zip(results, lefts)], late)
            searcher.observe(
                sum(len(tree) for tree in trees),
                results[0].times["verify"] + sum(r.times["accept"] + r.times["commit"] for r in results),
                sum(len(r.accepted) - 1 for r in results),
                len(live),
                copy_s,
            )
            searcher.observe_step(len(live), emitted, time.perf_counter() - t, bool(jobs), drafting)
        for seq, tree, result, left in zip(live, trees, results, lefts):
            copied = seq.learn(tree, result.accepted)
            tokens = result.tokens[:left]
            seq.emitted += len(tokens)
            if len(tree) > 1:
                seq.tree_passes += 1
                seq.tree_tokens += len(tokens)
            seq.done = result.stopped or seq.emitted >= config.max_new_tokens
            if not seq.done:
                seq.commit(result, batch.layers, batch.drafter is not None)
            step_times = dict(times, **result.times)
            yield seq, Step(tokens, tree, result.accepted, step_times, len(result.tokens), copied, result.stopped)

    def _jobs(self, live, reach, depths, drafts, late) -> tuple[list[Job], list[int], float]:
        """The search jobs of a pass (the head's drafts and each sequence's copied spans, where `late`), the indices
        of the sequences they are for, and the seconds the copy lookups took."""
        config, searcher = self.config, self.searcher
        jobs, searched, looked_up = [], [], False
        copy_t = time.perf_counter()
        for i, (seq, n, d) in enumerate(zip(live, reach, depths)):
            copies = None
            if seq.index is not None and n > 1 and late[i] and searcher.takes_copies():
                looked_up = True
                copies = copy_trie(
                    seq.index,
                    seq.calibration,
                    config.copy.spans,
                    min(config.copy.length, searcher.budget - 1, n - 1),
                    at_nodes=drafts[i],
                    store=seq.store,
                )
            if drafts[i] or copies is not None:
                jobs.append(Job(drafts[i], seq.root, max(d, 1), copies))
                searched.append(i)
        copy_s = time.perf_counter() - copy_t
        if looked_up:
            searcher.observe_lookups(len(live), any(job.copies is not None for job in jobs))
        return jobs, searched, copy_s


class _Batch:
    """The live sequences' shared state: the target's ragged KV cache and the batch drafter, one row each."""

    def __init__(self, decoder: Decoder):
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
            if self.limit is not None:  # (prompt and answer fit the context: `_prompt_ids`)
                need = min(need, self.limit + self.beyond_prompt)
            self.cache.reserve(need, exact=True)
            if self.drafter is not None:
                self.drafter.reserve(need)

    def admit(self, new: list[_Sequence], live: list[_Sequence]) -> None:
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
                seq.feed(_features(out[0], out[1], self.layers), seq.ids[1:], prompt=True)
            seq.stats.times["prefill"] += time.perf_counter() - t

    def room(self, seq: _Sequence) -> int:
        """How many entries `seq`'s next pass may add to its cache row: up to a sliding-window target's window
        (eagletree verifies over the whole cache); without a window, more than any pass adds."""
        if self.window is None:
            return 2**62
        return self.window - self.cache.lengths[seq.row]

    def overflow(self, seq: _Sequence) -> str | None:
        """Why `seq` cannot go on (its cache row holds the whole sliding window), or None."""
        if self.room(seq) >= 1:
            return None
        return (
            f"the answer reached the target's sliding window of {self.window} tokens (prompt {seq.ids.numel()} + "
            f"{seq.emitted} new tokens); eagletree verifies trees over the whole cache and does not decode past "
            "the window, so this answer ends here"
        )

    def release(self, done: list[_Sequence], live: list[_Sequence]) -> None:
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

    def catch_up(self, seqs: list[_Sequence]) -> None:
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


def _check_head(head, target, config: DecodeConfig) -> None:
    """ValueError (or HeadError) unless the head drafts for this target, on its device, in a float dtype."""
    head.check_target(target.config)
    head_dtype, head_device = next(head.parameters()).dtype, next(head.parameters()).device
    if not head_dtype.is_floating_point:
        raise ValueError(f"the head's dtype {head_dtype} is not a floating-point type")
    target_device = next(target.parameters()).device
    if head_device != target_device:
        raise ValueError(
            f"the head is on {head_device} but the target on {target_device}; move the head there "
            f"(head.to({str(target_device)!r}))"
        )
    paths = config.tree_paths
    if paths is not None and max(max(p) for p in paths) >= head.drafted_vocab_size():
        raise ValueError(
            f"tree_paths rank {max(max(p) for p in paths)} is past the head's draft vocabulary "
            f"of {head.drafted_vocab_size()} tokens"
        )


def decode_steps(
    target,
    tokenizer,
    head,
    prompt,
    stats: GenerationStats | None = None,
    profile=None,
    calibrator=None,
    copy_calibration=None,
    inspect_step=None,
    config: DecodeConfig | None = None,
    **options,
):
    """Yield the tokens each target pass emits (a list per pass) decoding one prompt; records every pass in
    `stats`. `config`, or `options` (DecodeConfig's fields, or the flat names `generate` takes); the other
    arguments are `Decoder`'s and `Decoder.steps`'."""
    decoder = Decoder(
        target,
        tokenizer,
        head,
        _config(config, options),
        profile=profile,
        calibrator=calibrator,
        copy_calibration=copy_calibration,
    )
    return (step.tokens for step in decoder.steps(prompt, stats, inspect_step))


def generate(
    target,
    tokenizer,
    head,
    prompt_or_messages,
    stream: bool = False,
    config: DecodeConfig | None = None,
    profile=None,
    calibrator=None,
    inspect_step=None,
    batch_size: int = 8,
    **options,
):
    """Lossless speculative generation. Returns a GenerationResult, or with stream=True an iterator of text pieces.

    `config` (a DecodeConfig), or `options`: its fields (tree, budget, depth, top_k_draft, max_new_tokens, stop,
    truncate_prompt, ...) or the flat names temperature, top_k, top_p, seed, copy, copy_spans, copy_len, store.
    The defaults are chosen by device (DecodeConfig: the cost-aware `auto` tree, 60 nodes on a GPU, 8 on a CPU).
    A prompt is chat messages, a string or token ids (a list of ints, or an integer tensor of shape [n] or [1, n]).
    A list of prompts (strings, message lists, token-id lists) returns a list of results, decoded `batch_size` at a
    time in shared target passes (`Decoder.results`: one budget for the batch's trees, continuous batching), and a
    call like the last one (same models and options, not streamed) reuses its Decoder:
    building one (the latency profile's probe, the datastore's index) costs a share of a short answer's time.
    profile, calibrator: as `Decoder` takes them; inspect_step: as `Decoder.steps` takes it.
    """
    config = _config(config, options)
    if stream or profile is not None or calibrator is not None:
        decoder = Decoder(target, tokenizer, head, config, profile=profile, calibrator=calibrator)
    else:
        decoder = _LAST.decoder_for(target, tokenizer, head, config)
    if (
        isinstance(prompt_or_messages, list)
        and prompt_or_messages
        and not isinstance(prompt_or_messages[0], dict)
        and not is_token_ids(prompt_or_messages)
    ):
        if stream:
            raise ValueError("stream=True takes one prompt at a time")
        if inspect_step is not None:  # (it inspects one sequence's drafter at a time)
            return [decoder.generate(p, inspect_step=inspect_step) for p in prompt_or_messages]
        return decoder.generate_batch(prompt_or_messages, batch_size)
    return decoder.generate(prompt_or_messages, stream=stream, inspect_step=inspect_step)


class _LastDecoder:
    """The Decoder of `generate`'s last call, for the next call with the same target (on the same device, in the
    same dtype), tokenizer, head (its vocabulary and device too), config and files (the head's companion files and
    a datastore file, as they are on disk now). One slot: it keeps at most one set of models alive. A streamed call
    builds its own, so two interleaved streams never share a searcher."""

    def __init__(self):
        self.key, self.decoder = None, None

    def decoder_for(self, target, tokenizer, head, config: DecodeConfig) -> Decoder:
        weight = next(target.parameters())
        head_state = None
        if head is not None:
            head_weight = next(head.parameters())
            head_state = (id(head), head_weight.device, head_weight.dtype, head.drafted_vocab_size())
        key = (id(target), weight.device, weight.dtype, id(tokenizer), head_state, config, _files_read(head, config))
        try:
            hash(key)
        except TypeError:  # a config holding an unhashable value: not kept
            return Decoder(target, tokenizer, head, config)
        if key != self.key:
            self.key, self.decoder = None, None  # (a failed build keeps nothing)
            self.decoder = Decoder(target, tokenizer, head, config)
            self.key = key
        return self.decoder


_LAST = _LastDecoder()


def _files_read(head, config: DecodeConfig) -> tuple:
    """The files a Decoder of `head` and `config` may read, each with its size and time of change (None: absent)."""
    paths = [] if head is None or head.folder is None else [head.folder / name for name in COMPANION_FILES]
    if isinstance(config.copy.datastore, (str, Path)) and config.copy.datastore != "auto":
        paths.append(Path(config.copy.datastore))
    stamps = []
    for path in paths:
        try:
            stat = path.stat()
            stamps.append((str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino))
        except OSError:
            stamps.append((str(path), None))
    return tuple(stamps)


def _config(config: DecodeConfig | None, options: dict) -> DecodeConfig:
    """`config`, or one built from keyword options (not both)."""
    if config is not None and options:
        raise TypeError(f"pass a DecodeConfig or keyword options, not both (got config and {sorted(options)})")
    return config if config is not None else DecodeConfig.from_options(**options)


def decode_text(tokenizer, ids) -> str:
    """Text of token ids, without special tokens and without clean-up (so streamed pieces add up to it)."""
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

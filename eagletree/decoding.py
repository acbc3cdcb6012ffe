"""Speculative generation: draft a tree with the head, verify it in one target pass, accept, commit.

`speculative_steps` is the decoding step of docs/design.md in a loop (one Step per target pass);
`decode_steps` prepares it (options, prompt, prefill, the tree kind's searcher) and records each
Step; `generate` returns the text and the statistics people tune with (tokens per pass, predicted
vs measured, where the time went).
"""

from __future__ import annotations

import json
import math
import numbers
import time
import warnings
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .draft_heads import make_drafter, target_identity
from .packing import kernels_tag, machine_key
from .target import GQA_SDPA, cache_dir, new_cache
from .tree_search import Calibrator, LatencyProfile
from .tree_search.copy import CopyCalibration, NgramIndex, copy_calibration_names, copy_only, copy_trie
from .tree_search.store import DATASTORE, TokenStore, vocab_fingerprint
from .tree_search.searchers import KINDS as TREES
from .tree_search.searchers import make_searcher
from .tree_search.static import choices_shape
from .verify import DraftTree, prefill, verify_step
from .verify.profile import measure_verify
# name: (kind, smallest, largest, may be None); a float range's lower end is exclusive where marked
_OPTION_RANGES = {"max_new_tokens": (int, 0, None, False), "temperature": (float, 0.0, None, False),
                  "top_k": (int, 0, None, True), "top_p": (float, "> 0", 1.0, True), "budget": (int, 1, None, False),
                  "depth": (int, 1, None, False), "top_k_draft": (int, 1, None, False),
                  "seed": (int, 0, 2**64 - 1, True)}


MIN_TEMPERATURE = 1e-20  # a sampling temperature below this turns float32 logits / T into inf (then NaN)


def check_options(cli: bool = False, **options) -> None:
    """Raise ValueError for a decoding option outside its range, named as given (`cli`: as its --flag)."""
    for name, value in options.items():
        kind, low, high, optional = _OPTION_RANGES[name]
        flag = f"--{name.replace('_', '-')}" if cli else name
        if value is None and optional:
            continue
        ok_type = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
        if not ok_type or (kind is float and not math.isfinite(value)):
            raise ValueError(f"{flag} must be {'a finite number' if kind is float else 'an integer'}, got {value!r}")
        if (low == "> 0" and value <= 0) or (low != "> 0" and value < low) or (high is not None and value > high):
            lower = "> 0" if low == "> 0" else f">= {low}"
            where = f"{lower} and <= {high}" if high is not None else lower
            raise ValueError(f"{flag} must be {where}, got {value!r}"
                             + (" (0 = no top-k filter)" if name == "top_k" else ""))
        if name == "temperature" and 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"{flag} must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {value!r}: below that, logits "
                             "divided by it overflow float32 (use 0 for greedy decoding)")


@dataclass
class GenerationStats:
    new_tokens: int = 0
    passes: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per pass
    predicted: list[float] = field(default_factory=list)  # the tree's E[tokens/pass] per pass
    times: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("prefill", "draft", "search", "verify", "accept", "commit"), 0.0))
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
        return {"new_tokens": self.new_tokens, "passes": self.passes, "tokens_per_pass": self.tokens_per_pass,
                "predicted_tokens_per_pass": self.predicted_tokens_per_pass, "accepted_histogram": self.histogram(),
                "copied_tokens": self.copied_tokens,
                "seconds": self.seconds, "tokens_per_s": self.new_tokens / self.seconds if self.seconds else 0.0,
                "times": dict(self.times)}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats


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
            raise ValueError(f"a prompt tensor is one sequence of token ids, shape [n] or [1, n], got "
                             f"{list(prompt.shape)}; decode a batch as a list of prompts")
        ids = prompt.flatten().long()
    elif is_token_ids(prompt):
        ids = torch.tensor([int(t) for t in prompt], dtype=torch.long)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"][0]
    elif isinstance(prompt, str):
        ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
    else:
        raise TypeError(f"prompt must be chat messages, a string or token ids, got {type(prompt).__name__}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty")
    return ids


def check_token_ids(target, ids: torch.Tensor) -> None:
    """ValueError unless every id is a row of the target's embedding."""
    vocab = target.get_input_embeddings().num_embeddings
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}) (the target's vocabulary), got "
                         f"{low if low < 0 else high}")


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
        raise ValueError(f"stop {text!r} is {len(encoded)} tokens ({encoded}), not one; stop takes single tokens "
                         f"(a stop on longer text needs a check on the decoded text)")
    return int(encoded[0])


def hf_generation_config(max_new_tokens: int, temperature: float, eos_token_id, top_k=None, top_p=None, **extra):
    """A transformers GenerationConfig for plain decoding as eagletree decodes: every logits-shaping value set
    (`generate` fills the unset ones from the model's own generation_config, where a repetition_penalty or a
    top_k would make "plain decoding" another decoder than the one compared against)."""
    from transformers import GenerationConfig

    sample = temperature > 0
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, do_sample=sample,
                            temperature=temperature if sample else 1.0, top_k=(top_k or 0) if sample else 50,
                            top_p=(top_p or 1.0) if sample else 1.0, typical_p=1.0, min_p=None,
                            repetition_penalty=1.0, no_repeat_ngram_size=0, **extra)


# A cached profile whose one-token pass is this many times slower than a fresh probe was measured
# while something else loaded the machine; it would keep `auto` from drafting where trees pay.
STALE_PROFILE = 2.0
# Tree sizes the cached profile measures. 2 and 4 are there because t(N) is not linear between 1 and 8: the
# one-token pass takes the model's causal fast path and, where `--pack auto` chose so, the stock kernels, while
# every tree pays for a mask (and the packed kernels) from N = 2 on; on an Intel Xeon t(2) was 1.2-1.4 t(1), where
# a line from t(1) to t(8) says 1.07, and `auto` drafted two- and three-node trees that lost to plain passes.
PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def latency_profile(target, path=None):
    """The verify-latency profile of this target on this device: loaded from `path`, or from the cache.

    The cached profile (no `path`) is measured once and checked by each process that loads it, against a
    quick probe of the one-token pass (about 0.1-0.5 s): one measured while the machine was busy (t(1)
    more than STALE_PROFILE times the probe's) is measured again and replaced, and `notes` says so. A
    cached profile slower than the probe by less, or faster (this run is the busy one), is kept; one measured
    at other sizes than PROFILE_SIZES (an older version's) is measured again.
    """
    device = next(target.parameters()).device

    def measure(sizes=PROFILE_SIZES, reps=3):
        return LatencyProfile.from_measurements(
            measure_verify(target, sizes=sizes, prefix=128, reps=reps, progress=False),
            device=device.type, model=target.config.model_type)

    if path is not None:  # a profile measured elsewhere (e.g. on a serving GPU) is taken as it is
        return LatencyProfile.load_or_measure(path, measure)
    name = f"{target_identity(target.config)['fingerprint']}-{device.type}-{machine_key(target)}"
    name += kernels_tag(target)  # other kernels, other costs
    if target.config._attn_implementation == GQA_SDPA:
        name += "-gqa"
    path = cache_dir() / "profiles" / f"{name}.json"
    if path not in _CHECKED_PROFILES:  # probed once per process (a chat probes before its first turn only)
        _CHECKED_PROFILES[path] = _checked_profile(path, measure)
    return deepcopy(_CHECKED_PROFILES[path])  # a copy: the auto searcher updates its drafting cost


_CHECKED_PROFILES: dict = {}  # cache path -> the profile this process checked (or measured) there


def _checked_profile(path, measure) -> LatencyProfile:
    """The cached profile at `path` if a probe of the one-token pass says it was not measured on a busy machine,
    else (or when there is none, or it is damaged) a new measurement saved there."""
    try:
        cached = LatencyProfile.load(path) if path.is_file() else None
    except ValueError:  # a damaged cache file is measured again
        cached = None
    if cached is not None and tuple(cached.sizes) != PROFILE_SIZES:
        cached = None
    if cached is not None:
        probe = float(measure(sizes=(1,), reps=2).verify(1))
        if float(cached.verify(1)) <= STALE_PROFILE * probe:
            return cached
        stale = float(cached.verify(1))
    profile = measure()
    if cached is not None:
        profile.notes["remeasured"] = (f"the cached profile's one-token pass took {stale * 1e3:.1f} ms, a probe now "
                                       f"{probe * 1e3:.1f} ms: it was measured on a busy machine")
    profile.save(path)
    return profile


CALIBRATION = "calibration.json"


def head_calibrator(head):
    """The calibration saved next to a head (`calibration.json`, written by its evaluation), if any."""
    folder = getattr(head, "source_dir", None)
    path = Path(folder) / CALIBRATION if folder else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "method" not in data:
            raise ValueError(f"expected a JSON object with a method, got {json.dumps(data)[:60]}")
        calibrator = Calibrator(**{k: data[k] for k in ("method", "xs", "ys", "scale", "bias") if k in data})
        calibrator.check()
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path} is not a valid calibration ({e}); remove it to decode with the head's raw "
                         f"probabilities, or write it again with `python -m eagletree.train.evaluate`") from None
    return calibrator


def _context_limit(target) -> int | None:
    return getattr(target.config, "max_position_embeddings", None)


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
    """One sequence being decoded: the target's KV cache, the drafter and what it has not read yet, the copy index.

    Committed (features, next tokens) wait in `pending` until the drafter drafts: it catches up in one
    call right before, so steps that do not draft (tree="auto" pausing) cost it nothing.
    """

    def __init__(self, target, head, ids: torch.Tensor, copy_calibration: CopyCalibration | None,
                 store: TokenStore | None = None):
        self.layers = getattr(head, "fused_layers", None)  # EAGLE-3 reads these target layers
        self.cache = new_cache(target)
        out = prefill(target, self.cache, ids[:-1], layers=self.layers)
        self.drafter = make_drafter(head, target) if head is not None else None
        self.pending = []
        if self.drafter is not None and out is not None:
            layer_hidden = out.layer_hidden and {k: v[0] for k, v in out.layer_hidden.items()}
            self.pending.append((_features(out.hidden[0], layer_hidden, self.layers), ids[1:]))
        self.calibration = copy_calibration
        self.index = NgramIndex(ids.tolist()) if copy_calibration is not None else None  # prompt + emitted tokens
        self.store = store  # a corpus copied from too (retrieved spans), or None
        self.draft_s = 0.0  # the drafter's seconds in the current step

    def expand(self, root: int, inspect_step=None):
        """The drafter caught up on the committed tokens, as the searches' timed `expand`."""
        t = time.perf_counter()
        self.drafter.extend(torch.cat([f for f, _ in self.pending]), torch.cat([n for _, n in self.pending]))
        self.pending.clear()
        self.draft_s += time.perf_counter() - t
        if inspect_step is not None:
            inspect_step(self.drafter, root)
            self.drafter.begin_tree()

        def expand(nodes, tokens, parents, level):
            t = time.perf_counter()
            probs = self.drafter(nodes, tokens, parents, level)
            self.draft_s += time.perf_counter() - t
            return probs

        return expand

    def learn(self, draft: DraftTree, accepted: list[int]) -> int:
        """Update the copy calibration with a verified tree; returns the accepted tokens only a copy proposed."""
        if draft.copy_info is None:
            return 0
        self.calibration.update(draft, accepted)
        return sum(copy_only(draft.copy_info[v]) for v in accepted[1:])

    def commit(self, step) -> None:
        """A verified pass's tokens reach the drafter (at its next catch-up) and the copy index."""
        if self.drafter is not None:
            device = step.hidden.device
            self.pending.append((_features(step.hidden, step.layer_hidden, self.layers),
                                 torch.tensor(step.tokens, device=device)))
        if self.index is not None:
            self.index.extend(step.tokens)


def speculative_steps(target, seq: _Sequence, searcher, root: int, max_new_tokens: int, depth: int, sampling: tuple,
                      stops, copy_spans: int = 3, copy_len: int = 64, inspect_step=None):
    """The decoding step of docs/design.md, once per target pass: draft, search, verify, accept, commit.

    `sampling` is (temperature, top_k, top_p, generator); yields a Step per pass.
    """
    emitted = 0
    while emitted < max_new_tokens:
        left = max_new_tokens - emitted
        t, seq.draft_s = time.perf_counter(), 0.0
        # drafting deeper than the tokens still wanted, or than a tree of the budget's nodes reaches, is wasted work
        step_depth = min(depth, left - 1, searcher.budget - 1 if searcher is not None else depth)
        # 1. Draft: the head, when it drafts this step, and copied spans of earlier text, also looked up
        #    after the head's best nodes' paths. A span longer than the budget could never be verified whole.
        drafting = step_depth >= 1 and bool(seq.pending) and searcher.drafts()
        expand = seq.expand(root, inspect_step) if drafting else None
        copies = copy_trie(seq.index, seq.calibration, copy_spans, min(copy_len, searcher.budget - 1, left - 1),
                           at_nodes=expand is not None, store=seq.store) \
            if seq.index is not None and left > 1 and searcher.takes_copies() else None
        # 2. Search: the nodes this pass verifies (the root alone when there is nothing to draft from).
        if expand is None and copies is None:
            draft = DraftTree([root], [-1], draft_probs=[1.0])
        else:
            draft = searcher.search(expand, root, max(step_depth, 1), copies)
        times = {"draft": seq.draft_s, "search": time.perf_counter() - t - seq.draft_s}
        # 3-5. Verify every node in one target pass, accept top-down, commit the accepted path's KV entries.
        step = verify_step(target, seq.cache, draft, *sampling, stops, layers=seq.layers)
        times.update(step.times)
        if searcher is not None:
            searcher.observe(len(draft), sum(step.times.values()), len(step.accepted) - 1)
        copied = seq.learn(draft, step.accepted)
        tokens = step.tokens[:left]
        emitted += len(tokens)
        yield Step(tokens, draft, step.accepted, times, len(step.tokens), copied, step.stopped)
        if step.stopped or emitted >= max_new_tokens:
            return
        seq.commit(step)
        root = step.tokens[-1]


def decode_steps(target, tokenizer, head, prompt, max_new_tokens=128, temperature=0.0, top_k=None, top_p=None,
                 tree="eagle2", budget=60, depth=6, top_k_draft=10, stop=None, seed=None, accept_by_rank=None,
                 truncate_prompt=False, stats: GenerationStats | None = None, profile=None, calibrator=None,
                 inspect_step=None, copy=None, copy_spans=3, copy_len=64, copy_calibration=None, tree_paths=None,
                 store="auto"):
    """Yield the tokens each target pass emits (a list per pass); records every pass in `stats`.

    tree: "eagle2" | "optimal" | "chain" | "sequoia" | "auto" (see tree_search.searchers); "auto" keeps
    the prefix of an optimal tree that maximizes expected tokens per second under the device's latency
    `profile` (measured once and cached) and the drafting time measured so far, with acceptance from
    `calibrator` (default: the one saved next to the head). "sequoia" with `tree_paths` (rank paths,
    e.g. [(0,), (1,), (0, 0)]) drafts that static shape instead of Sequoia's.
    copy (default: on for eagle2, optimal and auto) adds copied continuations of earlier text to the
    tree (`copy_spans` matches, up to `copy_len` tokens each, valued by `copy_calibration`, by
    default the one saved next to the head, learning from every verified tree), under the root and
    under the head's best nodes; with head=None the tree is the copies alone (prompt lookup).
    store (with copying): a corpus copied from too, the continuation of the context's longest match there
    (`tree_search.store`): "auto" = the head folder's datastore.npz when it has one, None = none, a TokenStore
    or the path of a datastore file.
    `inspect_step(drafter, root)` is called before each step's drafting (analysis: e.g. build other
    trees from the same drafter state); the drafter's tree is reset after it.
    """
    if tree not in TREES:
        raise ValueError(f"tree must be one of {TREES}, got {tree!r}")
    check_options(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, budget=budget,
                  depth=depth, top_k_draft=top_k_draft, seed=seed)
    copy = resolve_copy(copy, tree, copy_spans, copy_len)
    if tree_paths is not None:
        if tree != "sequoia":
            raise ValueError(f"tree_paths gives the fixed shape of tree='sequoia', got tree={tree!r}")
        nodes = len(choices_shape(tree_paths).parents)  # (checks the paths)
        if nodes > budget:
            raise ValueError(f"tree_paths make a tree of {nodes} nodes with the root, more than budget={budget}")
    stats = stats if stats is not None else GenerationStats()
    ids = encode_prompt(tokenizer, prompt)
    check_token_ids(target, ids)
    limit = _context_limit(target)
    if limit is not None and ids.numel() + max_new_tokens > limit:
        if not truncate_prompt or max_new_tokens >= limit:
            raise ValueError(f"prompt ({ids.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"context of {limit} tokens; shorten the prompt or ask for fewer new tokens (in Python, "
                             "truncate_prompt=True keeps the prompt's last tokens)")
        ids = ids[-(limit - max_new_tokens):]
    if head is not None:
        head.check_target(target.config)
        head_dtype, head_device = next(head.parameters()).dtype, next(head.parameters()).device
        if not head_dtype.is_floating_point:
            raise ValueError(f"the head's dtype {head_dtype} is not a floating-point type")
        target_device = next(target.parameters()).device
        if head_device != target_device:
            raise ValueError(f"the head is on {head_device} but the target on {target_device}; move the head there "
                             f"(head.to({str(target_device)!r}))")
        if tree_paths is not None and max(max(p) for p in tree_paths) >= head.drafted_vocab_size():
            raise ValueError(f"tree_paths rank {max(max(p) for p in tree_paths)} is past the head's draft vocabulary "
                             f"of {head.drafted_vocab_size()} tokens")
    stops = stop_token_ids(target, tokenizer, stop)
    if max_new_tokens == 0:
        return iter(())
    profile = deepcopy(profile)  # the auto searcher updates its drafting cost: never the caller's
    if tree == "auto" and head is not None and calibrator is None:
        calibrator = head_calibrator(head)  # (files: read at the call, so a damaged one is reported there)
    if copy and copy_calibration is None:
        copy_calibration = head_copy_calibration(head, copy_len)
    store = resolve_store(store, head, tokenizer, copy, target.get_input_embeddings().num_embeddings)
    # the checks above run at the call; the work below when the steps are read
    return _decode(target, head, ids, max_new_tokens, temperature, top_k, top_p, tree, budget, depth, top_k_draft,
                   stops, seed, accept_by_rank, stats, profile, calibrator, inspect_step, copy, copy_spans, copy_len,
                   copy_calibration, tree_paths, store)


def _decode(target, head, ids, max_new_tokens, temperature, top_k, top_p, tree, budget, depth, top_k_draft, stops,
            seed, accept_by_rank, stats, profile, calibrator, inspect_step, copy, copy_spans, copy_len,
            copy_calibration, tree_paths, store):
    """decode_steps' generator, once its arguments are checked."""
    device = next(target.parameters()).device
    ids = ids.to(device)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    drafts = head is not None or copy
    if tree == "auto" and drafts:
        profile = profile if profile is not None else latency_profile(target)

    searcher = make_searcher(tree, budget, depth, top_k_draft, device, None, accept_by_rank, tree_paths, profile,
                             calibrator) if drafts else None
    t0 = time.perf_counter()
    seq = _Sequence(target, head, ids, copy_calibration if copy else None, store)
    stats.times["prefill"] += time.perf_counter() - t0
    if searcher is not None and seq.drafter is not None:
        searcher.token_map = seq.drafter.token_map  # the drafter's draft ids -> target ids
    for step in speculative_steps(target, seq, searcher, int(ids[-1]), max_new_tokens, depth,
                                  (temperature, top_k, top_p, generator), stops, copy_spans, copy_len, inspect_step):
        stats.record(step)
        stats.seconds = time.perf_counter() - t0
        yield step.tokens
    stats.seconds = time.perf_counter() - t0


def resolve_copy(copy, tree: str, spans: int, length: int) -> bool:
    """copy=None means on for the dynamic trees (eagle2, optimal, auto), off for static shapes."""
    if copy is not None and not isinstance(copy, bool):
        raise ValueError(f"copy must be True, False or None (the tree's default), got {copy!r}")
    for name, value in (("copy_spans", spans), ("copy_len", length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if copy and tree in ("chain", "sequoia"):
        raise ValueError(f"copy=True needs a searched tree (eagle2, optimal or auto); tree={tree!r} is a fixed shape")
    return tree not in ("chain", "sequoia") if copy is None else copy


_STORES: dict[tuple, list] = {}  # (file, its inode, size and times, id(tokenizer), vocab size) -> [the store or None,
# the tokenizer: kept, so that its id is not reused while the entry lives, why the file was refused or None, whether
# that was warned about]; the most recently used last. A refused file is remembered too: a head's unsuitable datastore
# warns once per process, not on every call (a read that failed on an I/O error is tried again next time).
_STORES_KEPT = 4  # an index is tens of MB


def resolve_store(store, head, tokenizer, copy: bool, vocab_size: int | None = None) -> TokenStore | None:
    """decode_steps' `store`: "auto" = the head folder's datastore.npz when copying (None without one, or, with a
    warning, when it does not suit this target or cannot be read), None = none, a TokenStore, or a datastore file's
    path (an error when it does not suit). Files are indexed once per file and tokenizer, then reused."""
    if store is None or (store == "auto" and not copy):
        return None
    if not copy:
        raise ValueError("store adds retrieved spans to the copied ones, so it needs copying on (copy=True, or the "
                         "default copy=None with an eagle2, optimal or auto tree); copying is off here")
    if isinstance(store, TokenStore):
        return store
    auto = store == "auto"
    if auto:
        folder = getattr(head, "source_dir", None) if head is not None else None
        if not folder or not (Path(folder) / DATASTORE).is_file():
            return None
        store = Path(folder) / DATASTORE
    if not isinstance(store, (str, Path)):
        raise ValueError(f"store must be 'auto', None, a TokenStore or a datastore file's path, got {store!r}")
    path = Path(store).resolve()
    stat = path.stat() if path.is_file() else None
    key = (str(path), stat and (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns), id(tokenizer),
           vocab_size)
    entry = _STORES.pop(key, None)
    if entry is None:
        entry = [None, tokenizer, None, False]
        try:
            entry[0] = TokenStore.load(path, None if tokenizer is None else vocab_fingerprint(tokenizer), vocab_size)[0]
        except ValueError as e:
            entry[2] = str(e)
            if isinstance(e.__cause__, OSError):  # the file may be fine: not remembered
                stat = None
    if stat is not None:  # (a missing file is looked for again next time)
        _STORES[key] = entry  # now the most recently used
        while len(_STORES) > _STORES_KEPT:
            del _STORES[next(iter(_STORES))]
    if entry[2] is not None:
        if not auto:
            raise ValueError(entry[2])
        if not entry[3]:
            entry[3] = True
            warnings.warn(f"the head's {DATASTORE} is not used: {entry[2]}")
    return entry[0]


def head_copy_calibration(head, copy_len: int = 16) -> CopyCalibration:
    """The copy calibration saved next to a head for the vocabulary it drafts over now (`copy_calibration.json`, or
    `copy_calibration.full-vocab.json` for a widened head), else the other one, else an uninformed one (0.5)."""
    folder = getattr(head, "source_dir", None)
    for name in copy_calibration_names(head.is_widened()) if folder else ():
        if (Path(folder) / name).is_file():
            return CopyCalibration.load(Path(folder) / name)  # its last column values the positions past its length
    return CopyCalibration(max_len=copy_len)


def _features(hidden, layer_hidden, layers):
    """The head's input features: the last hidden state, or the concatenated fused layers (EAGLE-3)."""
    return hidden if not layers else torch.cat([layer_hidden[i] for i in layers], dim=-1)


def generate(target, tokenizer, head, prompt_or_messages, stream: bool = False, **options):
    """Lossless speculative generation. Returns a GenerationResult, or with stream=True an iterator of text pieces.

    options: max_new_tokens, temperature, top_k, top_p, tree ("eagle2" | "optimal" | "chain" | "sequoia" | "auto"),
    budget, depth, top_k_draft, stop (extra stop tokens), seed, truncate_prompt.
    A prompt is chat messages, a string or token ids (a list of ints, or an integer tensor of shape [n] or [1, n]).
    A list of prompts (strings, message lists, token-id lists) returns a list of results, decoded one after another.
    """
    if isinstance(prompt_or_messages, list) and prompt_or_messages and not isinstance(prompt_or_messages[0], dict) \
            and not is_token_ids(prompt_or_messages):
        if stream:
            raise ValueError("stream=True takes one prompt at a time")
        return [generate(target, tokenizer, head, p, **options) for p in prompt_or_messages]
    stats = GenerationStats()
    steps = decode_steps(target, tokenizer, head, prompt_or_messages, stats=stats, **options)
    if stream:
        return _stream_text(tokenizer, steps)
    ids = [t for tokens in steps for t in tokens]
    return GenerationResult(decode_text(tokenizer, ids), ids, stats)


def decode_text(tokenizer, ids) -> str:
    """Text of token ids, without special tokens and without clean-up (so streamed pieces add up to it)."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except TypeError:  # a minimal tokenizer without that option
        return tokenizer.decode(ids, skip_special_tokens=True)


def _stream_text(tokenizer, steps):
    """Text pieces as tokens arrive; held back while the decoded text ends in an incomplete character."""
    ids, sent = [], ""
    for tokens in steps:
        ids += tokens
        text = decode_text(tokenizer, ids)
        if text.endswith("\ufffd") or not text.startswith(sent):
            continue
        if len(text) > len(sent):
            yield text[len(sent):]
        sent = text
    text = decode_text(tokenizer, ids)
    if text.startswith(sent) and len(text) > len(sent):
        yield text[len(sent):]

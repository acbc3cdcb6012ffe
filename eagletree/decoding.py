"""Speculative generation: draft a tree with the head, verify it in one target pass, accept, commit.

`generate` is the decoding step of docs/design.md in a loop; it returns the text and the
statistics people tune with (tokens per pass, predicted vs measured, where the time went).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .draft_heads import make_drafter
from .target import new_cache
from .tree_search import (chain_shape, choices_shape, choose_budget, eagle2_search, optimal_search, sequoia_tree,
                          static_search)
from .tree_search.copy import COPY_CALIBRATION, CopyCalibration, NgramIndex, copy_trie
from .verify import DraftTree, prefill, verify_step

TREES = ("eagle2", "optimal", "chain", "sequoia", "auto")
# Per-rank acceptance for the Sequoia shape until a measured one is passed (the shape, not the output, depends on it).
DEFAULT_ACCEPT_BY_RANK = (0.55, 0.12, 0.05, 0.03, 0.02, 0.01)
# name: (kind, smallest, largest, may be None); a float range's lower end is exclusive where marked
_OPTION_RANGES = {"max_new_tokens": (int, 0, None, False), "temperature": (float, 0.0, None, False),
                  "top_k": (int, 0, None, True), "top_p": (float, "> 0", 1.0, True), "budget": (int, 1, None, False),
                  "depth": (int, 1, None, False), "top_k_draft": (int, 1, None, False),
                  "seed": (int, 0, 2**64 - 1, True)}


def check_options(cli: bool = False, **options) -> None:
    """Raise ValueError for a decoding option outside its range, named as given (`cli`: as its --flag)."""
    import math

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


def encode_prompt(tokenizer, prompt) -> torch.Tensor:
    """Chat messages (through the chat template), a plain string, or token ids -> 1-D ids."""
    if isinstance(prompt, torch.Tensor):
        ids = prompt.flatten().long()
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


def stop_token_ids(target, tokenizer, stop=None) -> list[int]:
    ids = set()
    eos = target.generation_config.eos_token_id
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for s in stop or []:
        ids.update([s] if isinstance(s, int) else tokenizer.convert_tokens_to_ids([s]))
    return sorted(ids)


def latency_profile(target, path=None):
    """The verify-latency profile of this target on this device: loaded from `path`/the cache, or measured once."""
    from .draft_heads import target_identity
    from .packing import kernels_tag, machine_key
    from .target import cache_dir
    from .tree_search import LatencyProfile
    from .verify.profile import measure_verify

    device = next(target.parameters()).device
    if path is None:
        name = f"{target_identity(target.config)['fingerprint']}-{device.type}-{machine_key(target)}"
        name += kernels_tag(target)  # other kernels, other costs
        path = cache_dir() / "profiles" / f"{name}.json"
    return LatencyProfile.load_or_measure(path, lambda: LatencyProfile.from_measurements(
        measure_verify(target, sizes=(1, 8, 16, 32, 64), prefix=128, reps=3, progress=False),
        device=device.type, model=target.config.model_type))


CALIBRATION = "calibration.json"


def head_calibrator(head):
    """The calibration saved next to a head (`calibration.json`, written by its evaluation), if any."""
    import json
    from pathlib import Path

    from .tree_search import Calibrator

    folder = getattr(head, "source_dir", None)
    path = Path(folder) / CALIBRATION if folder else None
    if path is None or not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Calibrator(**{k: data[k] for k in ("method", "xs", "ys", "scale", "bias") if k in data})


def prune(tree: DraftTree, n: int) -> DraftTree:
    """The first n nodes of a tree in rank order (parents always come first, so it stays connected)."""
    if n >= len(tree):
        return tree
    pruned = DraftTree(tree.tokens[:n], tree.parents[:n], draft_probs=tree.draft_probs[:n])
    pruned.node_ids = (tree.node_ids or list(range(len(tree))))[:n]
    pruned.values = None if tree.values is None else tree.values[:n]
    pruned.copy_info = None if tree.copy_info is None else tree.copy_info[:n]
    return pruned


def _context_limit(target) -> int | None:
    return getattr(target.config, "max_position_embeddings", None)


def decode_steps(target, tokenizer, head, prompt, max_new_tokens=128, temperature=0.0, top_k=None, top_p=None,
                 tree="eagle2", budget=60, depth=6, top_k_draft=10, stop=None, seed=None, accept_by_rank=None,
                 truncate_prompt=False, stats: GenerationStats | None = None, profile=None, calibrator=None,
                 inspect_step=None, copy=None, copy_spans=3, copy_len=16, copy_calibration=None, tree_paths=None):
    """Yield the tokens each target pass emits (a list per pass); fills `stats` as it goes.

    tree="auto" drafts an optimal tree of up to `budget` nodes and keeps the prefix that maximizes
    expected tokens per second under the device's latency profile (measured once and cached) and
    the drafting time measured so far; `calibrator` maps draft confidence to acceptance.
    copy (default: on for eagle2, optimal and auto) adds copied continuations of earlier text to the
    tree (`copy_spans` matches, up to `copy_len` tokens each, valued by `copy_calibration`, by
    default the one saved next to the head, learning from every verified tree); with head=None
    the tree is the copies alone (prompt lookup).
    `inspect_step(drafter, root)` is called before each step's drafting (analysis: e.g. build other
    trees from the same drafter state); the drafter's tree is reset after it. tree="sequoia" with
    `tree_paths` (rank paths, e.g. [(0,), (1,), (0, 0)]) drafts that static shape instead of Sequoia's.
    """
    if tree not in TREES:
        raise ValueError(f"tree must be one of {TREES}, got {tree!r}")
    check_options(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, budget=budget,
                  depth=depth, top_k_draft=top_k_draft, seed=seed)
    copy = resolve_copy(copy, tree, copy_spans, copy_len)
    stats = stats if stats is not None else GenerationStats()
    ids = encode_prompt(tokenizer, prompt)
    limit = _context_limit(target)
    if limit is not None and ids.numel() + max_new_tokens > limit:
        if not truncate_prompt or max_new_tokens >= limit:
            raise ValueError(f"prompt ({ids.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"context of {limit} tokens; shorten it or pass truncate_prompt=True")
        ids = ids[-(limit - max_new_tokens):]
    if max_new_tokens == 0:
        return
    if head is not None:
        head.check_target(target.config)
        head_dtype = next(head.parameters()).dtype
        if not head_dtype.is_floating_point:
            raise ValueError(f"the head's dtype {head_dtype} is not a floating-point type")
    device = next(target.parameters()).device
    ids = ids.to(device)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    stops = stop_token_ids(target, tokenizer, stop)
    shape = None
    if tree == "sequoia" and tree_paths is not None:
        shape = choices_shape(tree_paths)  # a given static shape, e.g. `eagletree plan`'s
    elif tree in ("chain", "sequoia"):
        shape = chain_shape(depth) if tree == "chain" else sequoia_tree(accept_by_rank or DEFAULT_ACCEPT_BY_RANK,
                                                                          budget, depth)

    auto = None
    if tree == "auto" and (head is not None or copy):
        auto = AutoPolicy(profile if profile is not None else latency_profile(target),
                          calibrator if calibrator is not None else head_calibrator(head), budget)
    index = calibration = None
    if copy:
        index = NgramIndex(ids.tolist())  # the prompt and, as they commit, the emitted tokens
        calibration = copy_calibration if copy_calibration is not None else head_copy_calibration(head, copy_len)
    t0 = time.perf_counter()
    cache = new_cache(target)
    layers = getattr(head, "fused_layers", None)  # EAGLE-3 reads these target layers
    out = prefill(target, cache, ids[:-1], layers=layers)
    drafter = make_drafter(head, target) if head is not None else None
    # Committed (features, next tokens) the drafter has not read yet: it catches up in one call
    # right before it drafts, so steps that do not draft (tree="auto") cost it nothing.
    pending = []
    if drafter is not None and out is not None:
        pending.append((_features(out.hidden[0], out.layer_hidden and {k: v[0] for k, v in out.layer_hidden.items()},
                                  layers), ids[1:]))
    stats.times["prefill"] += time.perf_counter() - t0
    root, emitted = int(ids[-1]), 0
    while emitted < max_new_tokens:
        t_search = time.perf_counter()
        draft_time = [0.0]
        # Near the end, drafting deeper than the tokens still wanted is wasted work.
        step_depth = min(depth, max_new_tokens - emitted - 1)
        # A copied span longer than the budget could never be verified whole; where no tree pays, none is built.
        copies = copy_trie(index, calibration, copy_spans, min(copy_len, budget - 1, max_new_tokens - emitted - 1)) \
            if copy and budget > 1 and max_new_tokens - emitted > 1 and not (auto is not None and auto.never) else None
        drafting = bool(pending) and step_depth >= 1 and (auto is None or auto.should_draft())
        expand = None
        if drafting:
            t = time.perf_counter()
            drafter.extend(torch.cat([f for f, _ in pending]), torch.cat([n for _, n in pending]))
            pending.clear()
            draft_time[0] += time.perf_counter() - t
            if inspect_step is not None:
                inspect_step(drafter, root)
                drafter.begin_tree()

            def expand(nodes, tokens, parents, level):
                t = time.perf_counter()
                probs = drafter(nodes, tokens, parents, level)
                draft_time[0] += time.perf_counter() - t
                return probs

        if expand is None and copies is None:
            draft = DraftTree([root], [-1], draft_probs=[1.0])
        else:
            kwargs = dict(device=device, token_map=drafter.token_map if drafter is not None else None, copies=copies)
            search_depth = max(step_depth, 1)
            if tree == "eagle2":
                draft = eagle2_search(expand, root, budget, search_depth, top_k_draft, **kwargs)
            elif tree == "auto":
                draft = auto.tree(expand, root, search_depth, top_k_draft, kwargs, draft_time)
            elif tree == "optimal":
                draft = optimal_search(expand, root, budget, search_depth, top_k_draft, **kwargs)
            else:
                draft = static_search(expand, root, shape, device=device, token_map=kwargs["token_map"])
                if draft.depth > step_depth:
                    draft = prune(draft, int((draft.depths <= step_depth).sum()))
        stats.times["draft"] += draft_time[0]
        stats.times["search"] += time.perf_counter() - t_search - draft_time[0]
        stats.predicted.append(draft.expected_tokens)
        step = verify_step(target, cache, draft, temperature, top_k, top_p, generator, stops, layers=layers)
        for k in ("verify", "accept", "commit"):
            stats.times[k] += step.times[k]
        tokens = step.tokens[: max_new_tokens - emitted]
        emitted += len(tokens)
        stats.passes += 1
        stats.new_tokens += len(tokens)
        stats.accepted_lengths.append(len(step.tokens))
        if draft.copy_info is not None:
            calibration.update(draft, step.accepted)
            stats.copied_tokens += sum(len(draft.copy_info[v] or ()) == 2 for v in step.accepted[1:])
        if stats.steps is not None:
            stats.steps.append((draft, step.accepted))
        stats.seconds = time.perf_counter() - t0
        yield tokens
        if step.stopped or emitted >= max_new_tokens:
            break
        if drafter is not None:  # also after a one-token prompt's first pass: from then on the head drafts
            pending.append((_features(step.hidden, step.layer_hidden, layers),
                            torch.tensor(step.tokens, device=device)))
        if index is not None:
            index.extend(step.tokens)
        root = step.tokens[-1]
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


def head_copy_calibration(head, copy_len: int = 16) -> CopyCalibration:
    """The copy calibration saved next to a head (`copy_calibration.json`), else an uninformed one (0.5 everywhere)."""
    from pathlib import Path

    folder = getattr(head, "source_dir", None)
    path = Path(folder) / COPY_CALIBRATION if folder else None
    if path is not None and path.is_file():
        return CopyCalibration.load(path)  # spans are cut at its length
    return CopyCalibration(max_len=copy_len)


def _features(hidden, layer_hidden, layers):
    """The head's input features: the last hidden state, or the concatenated fused layers (EAGLE-3)."""
    return hidden if not layers else torch.cat([layer_hidden[i] for i in layers], dim=-1)


class AutoPolicy:
    """tree="auto": the cost-aware tree per step, and no drafting at all while trees do not pay.

    After drafting, the optimal tree's prefix with the most expected tokens per second is kept
    (latency profile of the device, drafting time measured so far, calibrated acceptance). When
    even that is slower than a plain one-token pass, the next steps skip drafting (4, then 8, ...
    up to 64 steps; x4 while a tree would lose more than 10%) before probing again, so on a device where
    trees do not pay `auto` decodes at about plain speed; where the profile says no tree of any size could
    pay even if every drafted token were accepted (t(N) >= N t(1)), it never drafts. The search width
    follows the budgets chosen lately, and drafting stops early once a deeper level could not pay for itself.
    """

    def __init__(self, profile, calibrator=None, budget: int = 60, max_wait: int = 64):
        self.profile, self.calibrator, self.budget, self.max_wait = profile, calibrator, budget, max_wait
        self.never = not trees_can_pay(profile, budget)
        self.skip = self.wait = 0  # steps left without drafting; the length of the last pause
        self.search_budget = budget
        self.draft_s, self.levels = 0.0, 0  # drafter calls so far: seconds and count
        self.gain = None  # running estimate of a tree step's tokens/s over a plain pass's

    def should_draft(self) -> bool:
        if self.never:
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def tree(self, expand, root, depth, top_k, kwargs, draft_time) -> DraftTree:
        """`expand` adds its seconds to draft_time[0] (which already holds this step's catch-up call).

        expand=None (the head is paused or absent): the copied spans alone, pruned by the same rule;
        such a step does not change the head's pause.
        """
        calls, before = [0], draft_time[0]

        def counting(nodes, tokens, parents, level):
            calls[0] += 1
            return expand(nodes, tokens, parents, level)

        t_one = float(self.profile.verify(1))
        min_gain = self.profile.draft_s_per_level / t_one  # tokens a drafting level must add to pay for itself
        full = optimal_search(counting if expand is not None else None, root, self.search_budget, depth, top_k,
                              min_gain=min_gain, **kwargs)
        values = full.values[1:] if self.calibrator is None else _calibrated_values(full, self.calibrator)
        if expand is None:
            return prune(full, choose_budget(values, self.profile, 0, max_budget=self.search_budget)[0])
        # Per-level cost from the tree's levels only: the drafter's catch-up call on the committed
        # tokens costs about one more level in steady state (the prompt's first one is paid once anyway).
        self.draft_s += draft_time[0] - before
        self.levels += calls[0]
        self.profile.draft_s_per_level = self.draft_s / max(self.levels, 1)
        n, expected, rate = choose_budget(values, self.profile, calls[0] + 1, max_budget=self.search_budget)
        # One step's estimate is noisy: pause only when the recent ones say trees lose to plain passes.
        gain = rate * t_one
        self.gain = gain if self.gain is None else 0.5 * (self.gain + gain)
        if self.gain < 1.0:
            self.wait = min((4 if self.gain < 0.9 else 2) * self.wait or 4, self.max_wait)
            self.skip = self.wait
        else:
            self.wait = 0
        self.search_budget = min(self.budget, max(8, 2 * n))
        return prune(full, n)


def trees_can_pay(profile, budget: int) -> bool:
    """Whether some tree of 2..budget nodes could beat a one-token pass on this profile at all: at best
    every drafted token is accepted (N tokens for N nodes), so trees cannot pay where t(N) >= N t(1)."""
    n = torch.arange(2, max(budget, 2) + 1, dtype=torch.float64)
    return bool((n * profile.verify(1) > profile.verify(n) * (1 + 1e-9)).any())


def _calibrated_values(tree: DraftTree, calibrator) -> torch.Tensor:
    """Path values with the head's draft probabilities calibrated; copied nodes' are calibrated already."""
    a = calibrator(tree.draft_probs).clamp(1e-30, 1.0)
    if tree.copy_info is not None:  # a copy the head proposed too is valued like the head's own candidates
        copied = torch.tensor([info is not None and len(info) == 2 for info in tree.copy_info])
        a = torch.where(copied.to(a.device), tree.draft_probs.to(a.dtype), a)
    a[0] = 1.0
    return torch.exp(tree.ancestors().double() @ a.log())[1:]


def generate(target, tokenizer, head, prompt_or_messages, stream: bool = False, **options):
    """Lossless speculative generation. Returns a GenerationResult, or with stream=True an iterator of text pieces.

    options: max_new_tokens, temperature, top_k, top_p, tree ("eagle2" | "optimal" | "chain" | "sequoia" | "auto"),
    budget, depth, top_k_draft, stop (extra stop tokens), seed, truncate_prompt.
    A list of prompts (strings or message lists) returns a list of results, decoded one after another.
    """
    if isinstance(prompt_or_messages, list) and prompt_or_messages and not isinstance(prompt_or_messages[0], dict):
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

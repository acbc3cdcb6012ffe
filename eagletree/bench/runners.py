"""Runs of `eagletree bench`: plain HF decoding, HF prompt lookup and eagletree's tree methods on the same
prompts, each right after plain decoding, with the checks that the outputs are the same."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..decode import (
    Decoder,
    GenerationStats,
    decode_steps,
    encode_prompt,
    hf_generation_config,
    stop_token_ids,
    whole_answers,
)
from ..decode.config import DecodeConfig
from ..errors import InvalidValue
from ..packing import stock_kernels
from ..search import acceptance_pairs
from .inputs import HEADLESS, TREE_METHODS, Method
from .rows import Run, add_run, check_same_tokens, empty_row
from .stats import calibration_bins, summarize


@dataclass(frozen=True)
class RunSettings:
    """How one timed run decodes: up to `max_new_tokens` at `temperature`, sampling from `seed`; HF prompt lookup
    with `lookup_tokens` candidates, and Sequoia's shape for the per-rank acceptance `accept_by_rank` (None: its
    default)."""

    max_new_tokens: int
    temperature: float
    seed: int | None
    lookup_tokens: int | None = None
    accept_by_rank: list[float] | None = None


@dataclass(frozen=True)
class BenchSettings:
    """What `run_bench` runs every method with: each temperature of `temperatures`, up to `max_new_tokens`, prompt i
    sampling from seed + i, HF prompt lookup with `lookup_tokens` candidates; copying methods also copy from `store`
    ("auto": the head folder's datastore.npz; None: nothing); `batch_size` prompts decoded together."""

    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int = 64
    seed: int = 0
    lookup_tokens: int = 10
    store: object = "auto"
    batch_size: int = 1


class _StepClock:
    """Timestamps the tokens HF's generate emits per step (its first `put` is the prompt).

    A streamer by duck typing (generate only calls `put` and `end`), so bench imports without transformers.
    """

    def __init__(self):
        self.steps = []

    def put(self, value):
        self.steps.append((time.perf_counter(), value.numel()))

    def end(self):
        pass


def run_hf(model, tok, messages, max_new_tokens, temperature, seed, lookup_tokens=None, top_k=None, top_p=None) -> Run:
    """HF `model.generate`: plain decoding, or prompt-lookup decoding with `lookup_tokens` candidates."""
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True).to(
        model.device
    )
    clock = _StepClock()
    if seed is not None:
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        # The same stop tokens as eagletree, so both stop at the same place.
        config = hf_generation_config(
            max_new_tokens,
            temperature,
            stop_token_ids(model, tok),
            top_k,
            top_p,
            prompt_lookup_num_tokens=lookup_tokens,
        )
        out = model.generate(**inputs, generation_config=config, streamer=clock)
    seconds = time.perf_counter() - t0
    steps = clock.steps[1:]
    return Run(
        out[0, inputs["input_ids"].shape[1] :].tolist(),
        seconds,
        steps[0][0] - t0 if steps else seconds,
        [n for _, n in steps],
    )


def run_hf_batch(model, tok, prompts, max_new_tokens, temperature, seed, top_k=None, top_p=None):
    """HF `model.generate` on `prompts` together (left padding, the same stop tokens as eagletree): a batch Run
    and each prompt's tokens (through its first stop token)."""
    rows = [encode_prompt(tok, p).tolist() for p in prompts]
    stops = stop_token_ids(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
    config = hf_generation_config(max_new_tokens, temperature, stops, top_k, top_p, pad_token_id=pad)
    clock = _StepClock()
    if seed is not None:
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, streamer=clock)
    seconds = time.perf_counter() - t0
    answers = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
        answers.append(row[:cut])
    first = clock.steps[1][0] - t0 if len(clock.steps) > 1 else seconds
    tokens = [t for a in answers for t in a]
    return Run(tokens, seconds, first, [1] * len(tokens), batch=True), answers


def run_tree_batch(model, tok, head, prompts, method: Method, settings: RunSettings, batch_size, store="auto"):
    """eagletree's batched decoding of `prompts` with one tree method (`Decoder.results`, `batch_size` sequences
    per target pass; prompt k samples with seed + k): a batch Run and each prompt's tokens."""
    config = DecodeConfig.from_options(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        tree=method.tree,
        budget=method.budget,
        depth=method.depth,
        top_k_draft=method.top_k,
        seed=settings.seed,
        accept_by_rank=settings.accept_by_rank,
        copy=method.copy,
        store=store if method.copy and method.name not in HEADLESS else None,
    )
    decoder = Decoder(model, tok, None if method.name in HEADLESS else head, config)
    t0 = time.perf_counter()
    results = whole_answers(decoder.generate_batch(prompts, batch_size))
    seconds = time.perf_counter() - t0
    answers = [r.token_ids for r in results]
    run = Run(
        [t for a in answers for t in a],
        seconds,
        results[0].stats.times["prefill"],  # (all admitted at once: the batch's prefill)
        [n for r in results for n in r.stats.accepted_lengths],
        [p for r in results for p in r.stats.predicted],
        batch=True,
    )
    return run, answers


def run_group(model, tok, head, prompts, method: Method, settings: RunSettings, batch_size, store):
    """One batched run of `method` (plain, packed or a tree method) on `prompts` together: (Run, tokens each)."""
    s = settings
    if method.name == "lookup":
        raise InvalidValue("HF prompt lookup decodes one sequence at a time; it has no batched run")
    if method.name == "plain":
        with stock_kernels(model):
            return run_hf_batch(model, tok, prompts, s.max_new_tokens, s.temperature, s.seed)
    if method.name == "packed":
        return run_hf_batch(model, tok, prompts, s.max_new_tokens, s.temperature, s.seed)
    return run_tree_batch(model, tok, head, prompts, method, s, batch_size, store)


def run_tree(
    model, tok, head, messages, method: Method, settings: RunSettings, record_steps=False, store="auto"
) -> Run:
    """eagletree's speculative decoding with one tree method; a copying method with a head also copies from `store`
    (a TokenStore, or "auto" = the head folder's datastore.npz)."""
    stats = GenerationStats(steps=[] if record_steps else None)
    ids, first = [], None
    for tokens in decode_steps(
        model,
        tok,
        None if method.name in HEADLESS else head,
        messages,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        tree=method.tree,
        budget=method.budget,
        depth=method.depth,
        top_k_draft=method.top_k,
        seed=settings.seed,
        accept_by_rank=settings.accept_by_rank,
        stats=stats,
        copy=method.copy,
        store=store if method.copy and method.name not in HEADLESS else None,
    ):
        first = stats.seconds if first is None else first
        ids += tokens
    return Run(
        ids,
        stats.seconds,
        stats.seconds if first is None else first,
        list(stats.accepted_lengths),
        stats.predicted,
        stats.steps,
    )


def run_method(
    model, tok, head, messages, method: Method, settings: RunSettings, record_steps=False, store="auto"
) -> Run:
    """One run of `method` (plain, an HF baseline or a tree method) on one prompt."""
    s = settings
    if method.name == "plain":  # the reference: HF generate as it runs without eagletree
        with stock_kernels(model):
            return run_hf(model, tok, messages, s.max_new_tokens, s.temperature, s.seed)
    if method.name in ("lookup", "packed"):
        lookup = s.lookup_tokens if method.name == "lookup" else None
        return run_hf(model, tok, messages, s.max_new_tokens, s.temperature, s.seed, lookup)
    return run_tree(model, tok, head, messages, method, s, record_steps, store=store)


def rank_acceptance(steps, k: int) -> list[float] | None:
    """Sequoia's per-rank acceptance from logged passes: how often a path node's r-th likeliest child was accepted.

    A search keeps each parent's children as a top prefix of its ranks, so ranks within the tree are true ranks.
    """
    hits, tries = [0] * k, 0
    for tree, accepted in steps:
        on_path, probs = set(accepted), tree.draft_probs.tolist()
        children = tree.children()
        for u in accepted:
            if not children[u]:
                continue
            tries += 1
            for r, v in enumerate(sorted(children[u], key=lambda v: -probs[v])[:k]):
                hits[r] += v in on_path
    return [h / tries for h in hits] if tries and any(hits) else None


def warm_up(model, tok, head, messages, methods, max_new_tokens, lookup_tokens) -> list[float] | None:
    """Untimed first runs (kernels, caches, auto's latency profile); returns Sequoia's measured per-rank acceptance."""
    names = {m.name for m in methods}
    short = min(8, max_new_tokens)
    with stock_kernels(model):
        run_hf(model, tok, messages, short, 0.0, 0)
    if "lookup" in names or "packed" in names:
        run_hf(model, tok, messages, short, 0.0, 0, lookup_tokens)
    trees = [m for m in methods if m.name in TREE_METHODS and m.name not in HEADLESS]
    if head is None or not trees:
        return None
    if any(m.tree == "auto" for m in trees):  # measures and caches the device's verify profile on first use
        run_tree(model, tok, head, messages, next(m for m in trees if m.tree == "auto"), RunSettings(short, 0.0, 0))
    widest = max(trees, key=lambda m: (m.budget, m.depth))
    probe = Method("eagle2", widest.budget, max(m.depth for m in trees), widest.top_k)
    sequoia = "sequoia" in names
    first = RunSettings(max_new_tokens if sequoia else short, 0.0, 0)
    run = run_tree(model, tok, head, messages, probe, first, record_steps=sequoia)
    return rank_acceptance(run.steps, probe.top_k) if sequoia else None


def warm_up_batch(model, tok, head, prompts, methods, max_new_tokens, batch_size, store) -> None:
    """Untimed first batched runs: HF's padded batches, and `auto`'s latency profile for passes of up to
    `batch_size` sequences (measured once and cached, the first time a batch that large is decoded)."""
    short = min(8, max_new_tokens)
    with stock_kernels(model):
        run_hf_batch(model, tok, prompts, short, 0.0, 0)
    auto = next((m for m in methods if m.name in TREE_METHODS and m.tree == "auto"), None)
    if auto is not None and (head is not None or auto.name in HEADLESS):
        run_tree_batch(model, tok, head, prompts, auto, RunSettings(short, 0.0, 0), batch_size, store=store)


@dataclass
class _Tally:
    """`run_bench`'s running results and progress: each (method, temperature) row's totals, the (draft probability,
    accepted?) pairs of every node the greedy tree runs tried, the progress bar and the log."""

    rows: dict
    pairs: tuple[list, list]
    bar: tqdm
    log: Callable[[str], None]


def run_bench(model, tok, head, prompts, methods, settings: BenchSettings = BenchSettings(), progress=True, log=None):
    """Every method on every prompt and temperature, each right after plain decoding; returns the results dict.
    `settings.batch_size` > 1: every method decodes the prompts in groups of that many together (plain and packed:
    HF `generate` on left-padded batches; tree methods: eagletree's batched decoding), each group right after
    plain's, and a row's rates are the groups' throughputs (`Run.batch`); HF prompt lookup has no batched run."""
    s = settings
    log = log or (lambda text: tqdm.write(text, file=sys.stderr))
    _check_bench(head, prompts, methods, s.batch_size)
    t_start = time.perf_counter()
    accept_by_rank = warm_up(model, tok, head, prompts[0], methods, s.max_new_tokens, s.lookup_tokens)
    if s.batch_size > 1:
        warm_up_batch(model, tok, head, prompts[: s.batch_size], methods, s.max_new_tokens, s.batch_size, s.store)
    if any(m.name == "sequoia" for m in methods):
        log(f"sequoia: acceptance by rank {[round(a, 3) for a in accept_by_rank] if accept_by_rank else 'default'}")
    everything = [Method("plain")] + list(methods)
    groups = [(i, prompts[i : i + s.batch_size]) for i in range(0, len(prompts), s.batch_size)]
    tally = _Tally(
        rows={(m, t): empty_row() for m in everything for t in s.temperatures},
        pairs=([], []),
        bar=tqdm(total=len(groups) * len(s.temperatures) * len(everything), desc="bench", disable=not progress),
        log=log,
    )
    for i, group in groups:
        for temperature in s.temperatures:
            run = RunSettings(s.max_new_tokens, temperature, s.seed + i, s.lookup_tokens, accept_by_rank)
            _run_group_methods(model, tok, head, i, group, everything, run, s, tally)
    tally.bar.close()
    results = [summarize(m, t, tally.rows[(m, t)], len(prompts)) for t in s.temperatures for m in everything]
    return {
        "prompts": len(prompts),
        "max_new_tokens": s.max_new_tokens,
        "temperatures": list(s.temperatures),
        "seed": s.seed,
        "lookup_tokens": s.lookup_tokens,
        **({"batch_size": s.batch_size} if s.batch_size > 1 else {}),
        "accept_by_rank": accept_by_rank,
        "accept_by_rank_source": "measured (warm-up run, eagle2)" if accept_by_rank else "default",
        "results": results,
        "calibration": calibration_bins(*tally.pairs, head),
        "seconds": time.perf_counter() - t_start,
    }


def _check_bench(head, prompts, methods, batch_size: int) -> None:
    """ValueError for a run that cannot start: tree methods without a head, no prompts, HF lookup in batches."""
    if head is None and any(m.name in TREE_METHODS and m.name not in HEADLESS for m in methods):
        raise InvalidValue("tree methods need a draft head; pass --head DIR or --methods lookup,copy")
    if not prompts:
        raise InvalidValue("no prompts to benchmark")
    if batch_size > 1 and any(m.name == "lookup" for m in methods):
        raise InvalidValue(
            "method 'lookup' (HF prompt lookup) decodes one sequence at a time; drop it for --batch-size > 1"
        )


def _run_group_methods(
    model, tok, head, i, group, everything, run: RunSettings, s: BenchSettings, tally: _Tally
) -> None:
    """Plain decoding and then every method on the prompts `group` (prompt i and the next ones: one prompt, or a
    batch decoded together), as `run` says (its temperature, the group's seed); each run is added to its row."""
    ref = same = None  # plain decoding with stock kernels; with the target's own (the 'packed' row)
    for m in everything:
        tally.bar.set_postfix_str(f"prompt {i + 1} T={run.temperature:g} {m.label}")
        if s.batch_size == 1:
            record = not run.temperature and m.name in TREE_METHODS and not m.copy
            timed = run_method(model, tok, head, group[0], m, run, record_steps=record, store=s.store)
            answers = [timed]
        else:
            timed, tokens = run_group(model, tok, head, group, m, run, s.batch_size, s.store)
            answers = [Run(t, timed.seconds, timed.first_seconds, []) for t in tokens]
        if ref is None:
            ref, ref_answers = timed, answers
        same = timed if m.name == "packed" else same
        row = tally.rows[(m, run.temperature)]
        add_run(row, m, timed, ref, same)
        if not run.temperature:  # each prompt's tokens against plain decoding's
            for k, (messages, got, want) in enumerate(zip(group, answers, ref_answers)):
                check_same_tokens(row, model, tok, messages, i + k, m, got, want, tally.log)
        for tree, accepted in timed.steps or ():
            q, y = acceptance_pairs(tree, accepted)
            tally.pairs[0].extend(q)
            tally.pairs[1].extend(y)
        tally.bar.update()

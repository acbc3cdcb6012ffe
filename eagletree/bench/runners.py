"""Runs of `eagletree bench`: plain HF decoding, HF prompt lookup and eagletree's tree methods on the same
prompts, each right after plain decoding, with the checks that the outputs are the same."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..decoding import (
    Decoder,
    GenerationStats,
    decode_steps,
    encode_prompt,
    hf_generation_config,
    stop_token_ids,
    whole_answers,
)
from ..decoding.config import DecodeConfig
from ..packing import stock_kernels
from ..tree_search import acceptance_pairs
from .inputs import HEADLESS, TREE_METHODS, Method
from .stats import calibration_bins, summarize


@dataclass
class Run:
    """One timed decoding of one prompt."""

    token_ids: list[int]
    seconds: float  # from the prompt's tokens to the last token, prefill included
    first_seconds: float  # until the first pass (the prefill, for plain decoding) has emitted its tokens
    accepted_lengths: list[int]  # tokens emitted per target pass, the first included
    predicted: list[float] = field(default_factory=list)
    steps: list | None = None  # (DraftTree, accepted) per pass, when recorded
    batch: bool = False  # a batch of prompts decoded together: tokens and passes of all its sequences

    @property
    def passes(self) -> int:
        return len(self.accepted_lengths)

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first pass (sampled outputs differ in length, so the prefill's share does);
        a batch's: its throughput, every sequence's tokens over the batch's seconds, prefill included."""
        if self.batch:
            return len(self.token_ids) / self.seconds if self.seconds > 0 else float("nan")
        rest = len(self.token_ids) - (self.accepted_lengths[0] if self.accepted_lengths else 0)
        return rest / (self.seconds - self.first_seconds) if rest > 0 else float("nan")


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


def run_tree_batch(
    model,
    tok,
    head,
    prompts,
    method: Method,
    max_new_tokens,
    temperature,
    seed,
    batch_size,
    accept_by_rank=None,
    store="auto",
):
    """eagletree's batched decoding of `prompts` with one tree method (`Decoder.results`, `batch_size` sequences
    per target pass; prompt k samples with seed + k): a batch Run and each prompt's tokens."""
    config = DecodeConfig.from_options(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        tree=method.tree,
        budget=method.budget,
        depth=method.depth,
        top_k_draft=method.top_k,
        seed=seed,
        accept_by_rank=accept_by_rank,
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


def run_group(
    model, tok, head, prompts, method: Method, max_new_tokens, temperature, seed, batch_size, accept_by_rank, store
):
    """One batched run of `method` (plain, packed or a tree method) on `prompts` together: (Run, tokens each)."""
    if method.name == "lookup":
        raise ValueError("HF prompt lookup decodes one sequence at a time; it has no batched run")
    if method.name == "plain":
        with stock_kernels(model):
            return run_hf_batch(model, tok, prompts, max_new_tokens, temperature, seed)
    if method.name == "packed":
        return run_hf_batch(model, tok, prompts, max_new_tokens, temperature, seed)
    return run_tree_batch(
        model, tok, head, prompts, method, max_new_tokens, temperature, seed, batch_size, accept_by_rank, store
    )


def run_tree(
    model,
    tok,
    head,
    messages,
    method: Method,
    max_new_tokens,
    temperature,
    seed,
    accept_by_rank=None,
    record_steps=False,
    store="auto",
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
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        tree=method.tree,
        budget=method.budget,
        depth=method.depth,
        top_k_draft=method.top_k,
        seed=seed,
        accept_by_rank=accept_by_rank,
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
    model,
    tok,
    head,
    messages,
    method: Method,
    max_new_tokens,
    temperature,
    seed,
    lookup_tokens,
    accept_by_rank,
    record_steps=False,
    store="auto",
) -> Run:
    """One run of `method` (plain, an HF baseline or a tree method) on one prompt."""
    if method.name == "plain":  # the reference: HF generate as it runs without eagletree
        with stock_kernels(model):
            return run_hf(model, tok, messages, max_new_tokens, temperature, seed)
    if method.name in ("lookup", "packed"):
        return run_hf(
            model, tok, messages, max_new_tokens, temperature, seed, lookup_tokens if method.name == "lookup" else None
        )
    return run_tree(
        model, tok, head, messages, method, max_new_tokens, temperature, seed, accept_by_rank, record_steps, store=store
    )


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
        run_tree(model, tok, head, messages, next(m for m in trees if m.tree == "auto"), short, 0.0, 0)
    widest = max(trees, key=lambda m: (m.budget, m.depth))
    probe = Method("eagle2", widest.budget, max(m.depth for m in trees), widest.top_k)
    sequoia = "sequoia" in names
    run = run_tree(
        model, tok, head, messages, probe, max_new_tokens if sequoia else short, 0.0, 0, record_steps=sequoia
    )
    return rank_acceptance(run.steps, probe.top_k) if sequoia else None


def warm_up_batch(model, tok, head, prompts, methods, max_new_tokens, batch_size, store) -> None:
    """Untimed first batched runs: HF's padded batches, and `auto`'s latency profile for passes of up to
    `batch_size` sequences (measured once and cached, the first time a batch that large is decoded)."""
    short = min(8, max_new_tokens)
    with stock_kernels(model):
        run_hf_batch(model, tok, prompts, short, 0.0, 0)
    auto = next((m for m in methods if m.name in TREE_METHODS and m.tree == "auto"), None)
    if auto is not None and (head is not None or auto.name in HEADLESS):
        run_tree_batch(model, tok, head, prompts, auto, short, 0.0, 0, batch_size, store=store)


def first_difference(got: list[int], want: list[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), or None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def logit_gap(model, tok, messages, want: list[int], got: list[int], k: int) -> float | None:
    """At the first difference k: a plain forward's logit of plain decoding's token minus the other output's."""
    if k >= min(len(want), len(got)):
        return None  # one output stopped earlier
    ids = encode_prompt(tok, messages).tolist() + want[:k]
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
    return float(logits[want[k]] - logits[got[k]])


def _empty_row() -> dict:
    """The running totals of one (method, temperature) row, filled by `_add_run`."""
    return dict(
        rate=[],
        e2e=[],
        first=[],
        ratio=[],
        same=[],
        new=0,
        passes=0,
        predicted=[],
        lengths=Counter(),
        mismatches=[],
    )


def _add_run(row: dict, m: Method, run: Run, ref: Run, same: Run | None) -> None:
    """Add one run to its row; `ref` is plain decoding with stock kernels, `same` with the target's own."""
    row["rate"].append(run.decode_rate)
    row["ratio"].append(run.decode_rate / ref.decode_rate)  # NaN (dropped) where either has one pass
    if m.name != "plain":  # like for like: against plain decoding with the same kernels
        row["same"].append(run.decode_rate / (same or ref).decode_rate)
    row["e2e"].append(len(run.token_ids) / run.seconds)
    row["first"].append(run.first_seconds)
    row["new"] += len(run.token_ids)
    row["passes"] += run.passes
    row["predicted"] += run.predicted
    row["lengths"].update(run.accepted_lengths)


def _check_same_tokens(row: dict, model, tok, messages, i: int, m: Method, run: Run, ref: Run, log) -> None:
    """Record in the row, and log, where a greedy run's tokens first differ from plain decoding's (prompt `i`)."""
    if (k := first_difference(run.token_ids, ref.token_ids)) is None:
        return
    gap = logit_gap(model, tok, messages, ref.token_ids, run.token_ids, k)
    row["mismatches"].append(
        {
            "prompt": i,
            "position": k,
            "got": run.token_ids[k : k + 8],
            "plain": ref.token_ids[k : k + 8],
            "logit_gap": gap,
        }
    )
    log(
        f"MISMATCH {m.label} on prompt {i}: first difference at token {k}: "
        f"{run.token_ids[k : k + 8]} vs plain {ref.token_ids[k : k + 8]}"
        + ("" if gap is None else f" (logit gap {gap:.4f} in a plain forward; near 0: a near-tie)")
    )


def run_bench(
    model,
    tok,
    head,
    prompts,
    methods,
    temperatures=(0.0, 1.0),
    max_new_tokens=64,
    seed=0,
    lookup_tokens=10,
    progress=True,
    log=None,
    store="auto",
    batch_size=1,
) -> dict:
    """Every method on every prompt and temperature, each right after plain decoding; returns the results dict.
    `store`: what copying methods also copy from ("auto": the head folder's datastore.npz; None: nothing).
    `batch_size` > 1: every method decodes the prompts in groups of that many together (plain and packed: HF
    `generate` on left-padded batches; tree methods: eagletree's batched decoding), each group right after plain's,
    and a row's rates are the groups' throughputs (`Run.batch`); HF prompt lookup has no batched run."""
    log = log or (lambda s: tqdm.write(s, file=sys.stderr))
    if head is None and any(m.name in TREE_METHODS and m.name not in HEADLESS for m in methods):
        raise ValueError("tree methods need a draft head; pass --head DIR or --methods lookup,copy")
    if not prompts:
        raise ValueError("no prompts to benchmark")
    if batch_size > 1 and any(m.name == "lookup" for m in methods):
        raise ValueError(
            "method 'lookup' (HF prompt lookup) decodes one sequence at a time; drop it for --batch-size > 1"
        )
    t_start = time.perf_counter()
    accept_by_rank = warm_up(model, tok, head, prompts[0], methods, max_new_tokens, lookup_tokens)
    if batch_size > 1:
        warm_up_batch(model, tok, head, prompts[:batch_size], methods, max_new_tokens, batch_size, store)
    if any(m.name == "sequoia" for m in methods):
        log(f"sequoia: acceptance by rank {[round(a, 3) for a in accept_by_rank] if accept_by_rank else 'default'}")
    plain = Method("plain")
    everything = [plain] + list(methods)
    rows = {(m, t): _empty_row() for m in everything for t in temperatures}
    pairs = ([], [])  # (draft probability, accepted?) of every tried node, greedy tree runs
    groups = [(i, prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size)]
    bar = tqdm(total=len(groups) * len(temperatures) * len(everything), desc="bench", disable=not progress)
    settings = dict(
        max_new_tokens=max_new_tokens,
        seed=seed,
        lookup_tokens=lookup_tokens,
        accept_by_rank=accept_by_rank,
        store=store,
        batch_size=batch_size,
    )
    for i, group in groups:
        for temperature in temperatures:
            _run_group_methods(model, tok, head, i, group, temperature, everything, rows, pairs, bar, log, settings)
    bar.close()
    results = [summarize(m, t, rows[(m, t)], len(prompts)) for t in temperatures for m in everything]
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperatures": list(temperatures),
        "seed": seed,
        "lookup_tokens": lookup_tokens,
        **({"batch_size": batch_size} if batch_size > 1 else {}),
        "accept_by_rank": accept_by_rank,
        "accept_by_rank_source": "measured (warm-up run, eagle2)" if accept_by_rank else "default",
        "results": results,
        "calibration": calibration_bins(*pairs, head),
        "seconds": time.perf_counter() - t_start,
    }


def _run_group_methods(model, tok, head, i, group, temperature, everything, rows, pairs, bar, log, s) -> None:
    """Plain decoding and then every method on the prompts `group` (prompt i and the next ones: one prompt, or a
    batch decoded together), at one temperature; each run is added to its row (`s`: run_bench's settings)."""
    ref = same = None  # plain decoding with stock kernels; with the target's own (the 'packed' row)
    for m in everything:
        bar.set_postfix_str(f"prompt {i + 1} T={temperature:g} {m.label}")
        common = (model, tok, head)
        if s["batch_size"] == 1:
            run = run_method(
                *common,
                group[0],
                m,
                s["max_new_tokens"],
                temperature,
                s["seed"] + i,
                s["lookup_tokens"],
                s["accept_by_rank"],
                record_steps=not temperature and m.name in TREE_METHODS and not m.copy,
                store=s["store"],
            )
            answers = [run]
        else:
            run, tokens = run_group(
                *common,
                group,
                m,
                s["max_new_tokens"],
                temperature,
                s["seed"] + i,
                s["batch_size"],
                s["accept_by_rank"],
                s["store"],
            )
            answers = [Run(t, run.seconds, run.first_seconds, []) for t in tokens]
        if ref is None:
            ref, ref_answers = run, answers
        same = run if m.name == "packed" else same
        row = rows[(m, temperature)]
        _add_run(row, m, run, ref, same)
        if not temperature:  # each prompt's tokens against plain decoding's
            for k, (messages, got, want) in enumerate(zip(group, answers, ref_answers)):
                _check_same_tokens(row, model, tok, messages, i + k, m, got, want, log)
        for tree, accepted in run.steps or ():
            q, y = acceptance_pairs(tree, accepted)
            pairs[0].extend(q)
            pairs[1].extend(y)
        bar.update()

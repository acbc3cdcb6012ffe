"""`eagletree bench`: speculative decoding vs plain and prompt-lookup decoding, on the same prompts in one run.

For every prompt (and temperature), plain HF decoding runs first and every method right after it,
so each speedup is a ratio measured moments apart on the same prompt; the tables report the median
and range of those per-prompt ratios. `--profile-only` measures the device's acceptance-independent
costs instead (verify latency per tree size, drafting, engine overhead) on random weights.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from .decoding import GenerationStats, decode_steps, encode_prompt, stop_token_ids
from .packing import is_packed, kernels_used, pack_target, stock_kernels
from .tree_search import acceptance_pairs

# "+copy": the head's candidates and copied spans of earlier text in one tree; "copy": copied spans alone
# (prompt lookup through eagletree's tree search and engine, no head).
TREE_METHODS = ("chain", "sequoia", "eagle2", "optimal", "auto", "eagle2+copy", "optimal+copy", "auto+copy", "copy")
METHODS = TREE_METHODS + ("lookup", "packed")
BASELINE_LABELS = {"lookup": "HF prompt lookup", "packed": "plain, packed kernels"}
HEADLESS = ("copy",)  # tree methods that need no head
FULL = dict(prompts="heldout:8", max_new_tokens=64, budgets="8,16,32,60", temperatures="0,1")
QUICK = dict(prompts="heldout:2", max_new_tokens=24, budgets="8,32", temperatures="0,1")
# Sizes written down from the models' config.json, so the profile needs no download.
BUILTIN_CONFIGS = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class Method:
    name: str  # one of METHODS, or "plain"
    budget: int | None = None  # tree nodes per pass, root included (auto: the most it may use)
    depth: int = 6
    top_k: int = 10

    @property
    def label(self) -> str:
        return self.name if self.budget is None else f"{self.name} {self.budget}"

    @property
    def tree(self) -> str:
        """The tree search this method runs (`decode_steps`' tree=)."""
        return "optimal" if self.name == "copy" else self.name.removesuffix("+copy")

    @property
    def copy(self) -> bool:
        return self.name == "copy" or self.name.endswith("+copy")


@dataclass
class Run:
    token_ids: list[int]
    seconds: float  # from the prompt's tokens to the last token, prefill included
    first_seconds: float  # until the first pass (the prefill, for plain decoding) has emitted its tokens
    accepted_lengths: list[int]  # tokens emitted per target pass, the first included
    predicted: list[float] = field(default_factory=list)
    steps: list | None = None  # (DraftTree, accepted) per pass, when recorded

    @property
    def passes(self) -> int:
        return len(self.accepted_lengths)

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first pass (sampled outputs differ in length, so the prefill's share does)."""
        rest = len(self.token_ids) - (self.accepted_lengths[0] if self.accepted_lengths else 0)
        return rest / (self.seconds - self.first_seconds) if rest > 0 else float("nan")


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def parse_list(text: str, kind, what: str) -> list:
    """A comma-separated option as a list of `kind` (int, float or str), or ValueError naming the bad item."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise ValueError(f"--{what} is empty; expected a comma-separated list")
    out = []
    for s in items:
        try:
            out.append(kind(s))
        except ValueError:
            raise ValueError(f"--{what}: {s!r} is not {'an integer' if kind is int else 'a number'}") from None
    return out


def method_grid(names, budgets, depth: int = 6, top_k: int = 10) -> list[Method]:
    """Every method at every budget; the chain (width 1) drafts min(budget - 1, depth) tokens, run once per length."""
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise ValueError(f"unknown method {bad[0]!r}; expected some of {', '.join(METHODS)} (plain always runs)")
    bad = [b for b in budgets if not isinstance(b, int) or b < 2]
    if bad:
        raise ValueError(f"budgets must be integers >= 2 (tree nodes per pass, root included), got {bad[0]!r}")
    if depth < 1 or top_k < 1:
        raise ValueError(f"depth and top-k must be >= 1, got depth {depth} and top-k {top_k}")
    grid = []
    for name in dict.fromkeys(names):
        if name in BASELINE_LABELS:
            grid.append(Method(name))
            continue
        for b in budgets:
            m = Method(name, b, depth, top_k) if name != "chain" else Method(name, min(b, depth + 1), min(b - 1, depth))
            if m not in grid:
                grid.append(m)
    return grid


def load_prompts(spec: str) -> list[list[dict]]:
    """`mtbench[:N]` (MT-bench first turns, N spread over the 8 categories), `humaneval[:N]` (the first N
    HumanEval problems), `heldout:N` (held-out ShareGPT first user turns) or a JSONL file of prompts.

    A JSONL line is a string, {"prompt": "..."} or {"messages": [...]}; each becomes chat messages.
    """
    if spec == "mtbench" or spec.startswith("mtbench:"):
        n = spec.removeprefix("mtbench").removeprefix(":")
        if n and (not n.isdigit() or int(n) < 1):
            raise ValueError(f"--prompts {spec!r}: expected mtbench or mtbench:N with N a positive integer")
        from .prompts import mtbench_subset

        return [q.messages() for q in mtbench_subset(int(n) if n else None)]
    if spec == "humaneval" or spec.startswith("humaneval:"):
        n = spec.removeprefix("humaneval").removeprefix(":")
        if n and (not n.isdigit() or int(n) < 1):
            raise ValueError(f"--prompts {spec!r}: expected humaneval or humaneval:N with N a positive integer")
        from .prompts import humaneval_prompts

        return humaneval_prompts(int(n) if n else None)
    if spec.startswith("heldout:"):
        n = spec.removeprefix("heldout:")
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--prompts {spec!r}: expected heldout:N with N a positive integer")
        from .train.data import load_dataset, split
        from .train.evaluate import heldout_prompts

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, heldout = split(load_dataset("sharegpt"))
        # Past the conversations the head's evaluation uses; ShareGPT splits long chats into parts, and a part
        # that opens with the assistant continues an earlier answer rather than asking something.
        opening = [c for c in heldout[100:]
                   if next((m["role"] for m in c.messages if m["role"] != "system"), None) == "user"]
        return heldout_prompts(opening, int(n))
    path = Path(spec)
    if not spec.endswith(".jsonl"):
        raise ValueError(f"--prompts {spec!r}: expected mtbench[:N], humaneval[:N], heldout:N or a .jsonl file")
    if not path.is_file():
        raise ValueError(f"--prompts {spec!r}: no such file")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{spec} line {i} is not JSON: {e}") from None
        if isinstance(item, dict):
            item = item.get("messages", item.get("prompt"))
        if isinstance(item, str) and item.strip():
            prompts.append([{"role": "user", "content": item}])
        elif isinstance(item, list) and item and all(isinstance(m, dict) and "role" in m for m in item):
            prompts.append(item)
        else:
            raise ValueError(f"{spec} line {i}: expected a string, {{\"prompt\": str}} or {{\"messages\": [...]}}")
    if not prompts:
        raise ValueError(f"{spec} holds no prompts")
    return prompts


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


class _StepClock(BaseStreamer):
    """Timestamps the tokens HF's generate emits per step (its first `put` is the prompt)."""

    def __init__(self):
        self.steps = []

    def put(self, value):
        self.steps.append((time.perf_counter(), value.numel()))

    def end(self):
        pass


def run_hf(model, tok, messages, max_new_tokens, temperature, seed, lookup_tokens=None, top_k=None,
           top_p=None) -> Run:
    """HF `model.generate`: plain decoding, or prompt-lookup decoding with `lookup_tokens` candidates."""
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True).to(model.device)
    sampling = dict(do_sample=False) if not temperature else dict(do_sample=True, temperature=temperature,
                                                                    top_k=top_k or 0, top_p=top_p or 1.0)
    clock = _StepClock()
    if seed is not None:
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        # The same stop tokens as eagletree, so both stop at the same place.
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, prompt_lookup_num_tokens=lookup_tokens,
                             eos_token_id=stop_token_ids(model, tok), streamer=clock, **sampling)
    seconds = time.perf_counter() - t0
    steps = clock.steps[1:]
    return Run(out[0, inputs["input_ids"].shape[1]:].tolist(), seconds, steps[0][0] - t0 if steps else seconds,
               [n for _, n in steps])


def run_tree(model, tok, head, messages, method: Method, max_new_tokens, temperature, seed,
             accept_by_rank=None, record_steps=False) -> Run:
    """eagletree's speculative decoding with one tree method."""
    stats = GenerationStats(steps=[] if record_steps else None)
    ids, first = [], None
    for tokens in decode_steps(model, tok, None if method.name in HEADLESS else head, messages,
                               max_new_tokens=max_new_tokens, temperature=temperature, tree=method.tree,
                               budget=method.budget, depth=method.depth, top_k_draft=method.top_k, seed=seed,
                               accept_by_rank=accept_by_rank, stats=stats, copy=method.copy):
        first = stats.seconds if first is None else first
        ids += tokens
    return Run(ids, stats.seconds, stats.seconds if first is None else first, list(stats.accepted_lengths),
               stats.predicted, stats.steps)


def run_method(model, tok, head, messages, method: Method, max_new_tokens, temperature, seed, lookup_tokens,
               accept_by_rank, record_steps=False) -> Run:
    if method.name == "plain":  # the reference: HF generate as it runs without eagletree
        with stock_kernels(model):
            return run_hf(model, tok, messages, max_new_tokens, temperature, seed)
    if method.name in ("lookup", "packed"):
        return run_hf(model, tok, messages, max_new_tokens, temperature, seed,
                      lookup_tokens if method.name == "lookup" else None)
    return run_tree(model, tok, head, messages, method, max_new_tokens, temperature, seed, accept_by_rank,
                    record_steps)


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
    run = run_tree(model, tok, head, messages, probe, max_new_tokens if sequoia else short, 0.0, 0,
                   record_steps=sequoia)
    return rank_acceptance(run.steps, probe.top_k) if sequoia else None


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


def run_bench(model, tok, head, prompts, methods, temperatures=(0.0, 1.0), max_new_tokens=64, seed=0,
              lookup_tokens=10, progress=True, log=None) -> dict:
    """Every method on every prompt and temperature, each right after plain decoding; returns the results dict."""
    log = log or (lambda s: tqdm.write(s, file=sys.stderr))
    if head is None and any(m.name in TREE_METHODS and m.name not in HEADLESS for m in methods):
        raise ValueError("tree methods need a draft head; pass --head DIR or --methods lookup,copy")
    if not prompts:
        raise ValueError("no prompts to benchmark")
    t_start = time.perf_counter()
    accept_by_rank = warm_up(model, tok, head, prompts[0], methods, max_new_tokens, lookup_tokens)
    if any(m.name == "sequoia" for m in methods):
        log(f"sequoia: acceptance by rank {[round(a, 3) for a in accept_by_rank] if accept_by_rank else 'default'}")
    plain = Method("plain")
    everything = [plain] + list(methods)
    rows = {(m, t): dict(rate=[], e2e=[], first=[], ratio=[], same=[], new=0, passes=0, predicted=[],
                         lengths=Counter(),
                         mismatches=[])
            for m in everything for t in temperatures}
    pairs = ([], [])  # (draft probability, accepted?) of every tried node, greedy tree runs
    bar = tqdm(total=len(prompts) * len(temperatures) * len(everything), desc="bench", disable=not progress)
    for i, messages in enumerate(prompts):
        for temperature in temperatures:
            ref = same = None  # plain decoding with stock kernels; with the target's own (the 'packed' row)
            for m in everything:
                bar.set_postfix_str(f"prompt {i + 1} T={temperature:g} {m.label}")
                run = run_method(model, tok, head, messages, m, max_new_tokens, temperature, seed + i, lookup_tokens,
                                 accept_by_rank, record_steps=not temperature and m.name in TREE_METHODS and not m.copy)
                ref = run if ref is None else ref
                same = run if m.name == "packed" else same
                row = rows[(m, temperature)]
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
                if not temperature and (k := first_difference(run.token_ids, ref.token_ids)) is not None:
                    gap = logit_gap(model, tok, messages, ref.token_ids, run.token_ids, k)
                    row["mismatches"].append({"prompt": i, "position": k, "got": run.token_ids[k:k + 8],
                                              "plain": ref.token_ids[k:k + 8], "logit_gap": gap})
                    log(f"MISMATCH {m.label} on prompt {i}: first difference at token {k}: "
                        f"{run.token_ids[k:k + 8]} vs plain {ref.token_ids[k:k + 8]}"
                        + ("" if gap is None else f" (logit gap {gap:.4f} in a plain forward; near 0: a near-tie)"))
                for tree, accepted in run.steps or ():
                    q, y = acceptance_pairs(tree, accepted)
                    pairs[0].extend(q)
                    pairs[1].extend(y)
                bar.update()
    bar.close()
    results = [summarize(m, t, rows[(m, t)], len(prompts)) for t in temperatures for m in everything]
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "temperatures": list(temperatures),
            "seed": seed, "lookup_tokens": lookup_tokens, "accept_by_rank": accept_by_rank,
            "accept_by_rank_source": "measured (warm-up run, eagle2)" if accept_by_rank else "default",
            "results": results, "calibration": calibration_bins(*pairs, head),
            "seconds": time.perf_counter() - t_start}


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else None


def _quantiles(values: list[float]) -> dict:
    xs = [x for x in values if x == x]  # drop NaN: a run that ended with its first pass has no decoding rate
    per_prompt = [x if x == x else None for x in values]
    if not xs:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "per_prompt": per_prompt}
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "q1": q1, "q3": q3,
            "per_prompt": per_prompt}


def summarize(m: Method, temperature: float, row: dict, prompts: int) -> dict:
    """One method at one temperature: pooled tokens/pass, median rates, the per-prompt speedup spread.

    tokens/s and speedups are decoding rates after the first pass; end to end and the first pass's time are kept too.
    """
    return {"method": m.name, "budget": m.budget, "depth": m.depth if m.budget else None, "label": m.label,
            "temperature": temperature, "prompts": prompts, "new_tokens": row["new"], "passes": row["passes"],
            "tokens_per_pass": row["new"] / row["passes"] if row["passes"] else 0.0,
            "predicted_tokens_per_pass": statistics.mean(row["predicted"]) if row["predicted"] else None,
            "tokens_per_s": _median(row["rate"]), "tokens_per_s_end_to_end": _median(row["e2e"]),
            "first_pass_s": _median(row["first"]), "speedup": _quantiles(row["ratio"]),
            "speedup_same_kernels": _quantiles(row["same"]) if row["same"] else None,
            "identical": None if temperature else not row["mismatches"], "mismatches": row["mismatches"],
            "accepted_histogram": dict(sorted(row["lengths"].items()))}


def calibration_bins(probs, hits, head=None, bins: int = 10) -> dict:
    """Per-node predicted (draft probability) vs measured acceptance in equal-width bins.

    Also binned by the head's calibrated prediction, when it has a calibration.json.
    """
    from .decoding import head_calibrator

    out = {"nodes": len(probs), "bins": _bin(probs, hits, bins)}
    calibrator = head_calibrator(head) if head is not None and probs else None
    if calibrator is not None:
        out["calibrated_bins"] = _bin(calibrator(probs).tolist(), hits, bins)
        out["calibrator"] = calibrator.method
    return out


def _bin(probs, hits, bins) -> list[dict]:
    groups = {}
    for q, y in zip(probs, hits):
        groups.setdefault(min(int(q * bins), bins - 1), []).append((q, y))
    return [{"predicted": statistics.mean(q for q, _ in g), "measured": statistics.mean(float(y) for _, y in g),
             "nodes": len(g)} for _, g in sorted(groups.items())]


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def machine_info(model) -> dict:
    """Where the numbers come from."""
    import transformers

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = next(model.parameters()).device
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": device.type, "dtype": str(model.dtype).removeprefix("torch.")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _x(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown_table(report: dict, temperature: float) -> str:
    """The results table of one temperature."""
    rows = [r for r in report["results"] if r["temperature"] == temperature]
    lines = ["| method | budget | tokens/pass | predicted | tokens/s (median) | speedup vs plain, same kernels "
             "(median, range) | speedup vs plain HF generate, stock kernels (median, range) "
             "| first pass s (median) | identical to plain |", "|---|---|---|---|---|---|---|---|---|"]

    def spread(s):
        return "-" if not s or s["median"] is None else f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"

    for r in rows:
        same = "n/a" if r["identical"] is None else "yes" if r["identical"] else f"NO ({len(r['mismatches'])})"
        lines.append(f"| {r['method']} | {_x(r['budget'], '{}')} | {r['tokens_per_pass']:.2f} | "
                     f"{_x(r['predicted_tokens_per_pass'])} | {_x(r['tokens_per_s'], '{:.1f}')} | "
                     f"{'-' if r['method'] in ('plain', 'packed') else spread(r.get('speedup_same_kernels'))} | "
                     f"{spread(r['speedup'])} | {_x(r['first_pass_s'])} | {same} |")
    return "\n".join(lines)


def markdown_report(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    where = f"{m['cpu']}, {m['cores']} cores" + (f", {m['gpu']}" if "gpu" in m else "")
    out = [f"# eagletree bench\n\n`{report['command']}`\n",
           f"Machine: {where}; Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}; "
           f"{m['device']}, target {m['dtype']}, head {s.get('head_dtype')}; "
           + ("target Linears packed for oneDNN in every row but plain (PyTorch's stock kernels)"
              + (f" where measured faster here ({s['kernels_measured']})" if s.get("kernels_measured") else "")
              + "; 'packed' is plain HF generate with the same kernels as the trees, so each row's speedup over it "
                "is drafting's alone and 'packed' over 'plain' is the kernels' own gain.\n"
              if s.get("packed") else "PyTorch's stock kernels in every row (the same kernels as plain)"
              + (f"; packing was measured slower here ({s['kernels_measured']})" if s.get("kernels_measured") else "")
              + ".\n"),
           f"Target {s['target']}, head {s['head']}; {report['prompts']} prompts ({s['prompts']}), "
           f"{report['max_new_tokens']} new tokens each; depth {s['depth']}, top-k {s['top_k_draft']}; "
           f"prompt lookup {report['lookup_tokens']} tokens; Sequoia acceptance by rank "
           f"{report['accept_by_rank_source']}; {report['seconds']:.0f} s in all.\n"]
    for t in report["temperatures"]:
        plain = next(r for r in report["results"] if r["temperature"] == t and r["method"] == "plain")
        out.append(f"## Temperature {t:g}{' (greedy)' if not t else ''}\n\nplain decoding: "
                   f"{_x(plain['tokens_per_s'], '{:.1f}')} tokens/s (median over prompts)\n\n"
                   f"{markdown_table(report, t)}\n")
    out.append("tokens/s and speedups are decoding rates after each run's first target pass (the prompt's prefill), "
               "per prompt; the speedup's range is over prompts. Sampled outputs differ in length, so end-to-end "
               "rates would mix in the prefill's varying share (they are in results.json).\n")
    out.append("Plots: " + ", ".join(f"[{p}]({p})" for p in report.get("plots", [])) + "\n")
    return "\n".join(out)


def _families(report, temperature):
    """Tree and lookup results of one temperature, grouped by method name in run order."""
    fam = {}
    for r in report["results"]:
        if r["temperature"] == temperature and r["method"] != "plain":
            fam.setdefault(r["method"], []).append(r)
    return fam


def write_plots(report: dict, out: Path) -> list[str]:
    """tokens/pass and speedup vs budget, accepted-length histogram, calibration; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = report["temperatures"]
    budgets = sorted({r["budget"] for r in report["results"] if r["budget"]})
    names = []
    marker = dict(zip(TREE_METHODS, "s^oDv<>PX"))
    color = {name: f"C{i}" for i, name in enumerate(METHODS)}  # one color per method in every plot

    def by_budget(fname, ylabel, value, spread=None, baseline=None):
        fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4.2), squeeze=False, sharey=True)
        for ax, t in zip(axes[0], temps):
            families = _families(report, t)
            for j, (name, rs) in enumerate(families.items()):
                if name in BASELINE_LABELS:
                    ax.axhline(value(rs[0]), color="gray" if name == "lookup" else "C9", ls="--",
                               label=BASELINE_LABELS[name])
                    continue
                # Methods side by side at each budget (a small shift on the log axis), so points never hide.
                shift = 2 ** (0.05 * (j - (len(families) - 1) / 2))
                xs, ys = [r["budget"] * shift for r in rs], [value(r) for r in rs]
                style = dict(marker=marker[name], color=color[name], label=name)
                if spread:
                    lo, hi = zip(*(spread(r) for r in rs))
                    ax.errorbar(xs, ys, yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]],
                                capsize=3, **style)
                else:
                    ax.plot(xs, ys, **style)
            if baseline is not None:
                ax.axhline(baseline, color="black", lw=0.8, label="plain decoding")
            ax.set_xscale("log", base=2)
            ax.set_xlim(budgets[0] / 1.25, budgets[-1] * 1.25)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
            ax.set_xlabel("budget (tree nodes per pass)")
            ax.set_title(f"temperature {t:g}")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        fig.suptitle(f"{ylabel} ({report['settings']['target']}, {report['machine']['device']})")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        names.append(fname)

    by_budget("tokens_per_pass.png", "tokens per target pass", lambda r: r["tokens_per_pass"], baseline=1.0)
    med = lambda r: r["speedup"]["median"] or 0.0  # noqa: E731
    by_budget("speedup.png", "speedup over plain decoding (median, range)", med,
              spread=lambda r: (r["speedup"]["min"] or 0.0, r["speedup"]["max"] or 0.0), baseline=1.0)

    # Accepted lengths: each tree method at its largest budget, greedy (or the first temperature).
    fam = _families(report, temps[0])
    shown = [rs[-1] for rs in fam.values() if rs[-1]["accepted_histogram"]]
    if shown:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        lengths = sorted({int(k) for r in shown for k in r["accepted_histogram"]})
        width = 0.8 / len(shown)
        for j, r in enumerate(shown):
            hist = {int(k): v for k, v in r["accepted_histogram"].items()}
            total = sum(hist.values())
            ax.bar([n + (j - (len(shown) - 1) / 2) * width for n in lengths], [hist.get(n, 0) / total for n in lengths],
                   width, color=color[r["method"]], label=f"{r['label']} (mean {r['tokens_per_pass']:.2f})")
        ax.set_xticks(lengths)
        ax.set_xlabel("tokens emitted per target pass")
        ax.set_ylabel("share of passes")
        ax.set_title(f"accepted lengths, temperature {temps[0]:g}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(out / "accepted_lengths.png", dpi=110)
        plt.close(fig)
        names.append("accepted_lengths.png")

    cal = report["calibration"]
    greedy = [r for r in report["results"] if not r["temperature"] and r["predicted_tokens_per_pass"] is not None]
    if cal["bins"] or greedy:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
        for key, label in (("bins", "draft probability"), ("calibrated_bins", f"calibrated ({cal.get('calibrator')})")):
            bins = cal.get(key) or []
            if bins:
                a1.scatter([b["predicted"] for b in bins], [b["measured"] for b in bins],
                           s=[20 + 200 * b["nodes"] / cal["nodes"] for b in bins], label=label, alpha=0.8)
        a1.plot([0, 1], [0, 1], color="black", lw=0.8)
        a1.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted acceptance of a node", ylabel="measured acceptance",
               title=f"per node, greedy ({cal['nodes']} tried nodes; size = share)")
        a1.legend(fontsize=8)
        a1.grid(alpha=0.3)
        labelled = set()
        for r in greedy:
            name, xy = r["method"], (r["predicted_tokens_per_pass"], r["tokens_per_pass"])
            hollow = name == "optimal"  # often on top of eagle2
            a2.scatter(*xy, label=None if name in labelled else name, marker=marker[name], s=80 if hollow else 36,
                       facecolors="none" if hollow else color[name], edgecolors=color[name])
            a2.annotate(str(r["budget"]), xy, xytext=(-14, 4) if hollow else (5, -3), textcoords="offset points",
                        fontsize=7)
            labelled.add(name)
        top = max([1.5] + [max(r["predicted_tokens_per_pass"], r["tokens_per_pass"]) * 1.1 for r in greedy])
        a2.plot([1, top], [1, top], color="black", lw=0.8)
        a2.set(xlim=(1, top), ylim=(1, top), xlabel="predicted tokens/pass", ylabel="measured tokens/pass",
               title="per method and budget, greedy")
        a2.legend(fontsize=7, ncol=2)
        a2.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "calibration.png", dpi=110)
        plt.close(fig)
        names.append("calibration.png")
    return names


def write_outputs(report: dict, out) -> Path:
    """results.json, the PNG plots and results.md (the tables) in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(report, out)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    (out / "results.md").write_text(markdown_report(report))
    return out


# ---------------------------------------------------------------------------------------------
# --profile-only: the device's acceptance-independent costs
# ---------------------------------------------------------------------------------------------


def build_config(spec: str):
    """A built-in config name (see BUILTIN_CONFIGS) or a path to an HF config.json (or its folder)."""
    from transformers import AutoConfig

    if spec in BUILTIN_CONFIGS:
        kw = dict(BUILTIN_CONFIGS[spec])
        return AutoConfig.for_model(kw.pop("model_type"), **kw)
    if not Path(spec).exists():
        raise ValueError(f"--config {spec!r} is neither a built-in config ({', '.join(BUILTIN_CONFIGS)}) "
                         "nor an existing config.json")
    return AutoConfig.from_pretrained(spec)


def random_model(config, device, dtype):
    """The model and its matching EAGLE head with random weights, built directly on the device (no download)."""
    from transformers import AutoModelForCausalLM

    from .draft_heads import EagleHead

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
        head = EagleHead.for_target(config).to(device=device, dtype=dtype).eval()
    return model, head


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_drafting(model, head, budgets, depth=6, top_k=10, prefix=256, reps=10) -> dict[int, dict]:
    """Median seconds per head call (one depth level) and of the EAGLE-2 search's own work per step, per budget."""
    from .draft_heads import make_drafter
    from .tree_search import eagle2_search

    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    drafter = make_drafter(head, model)
    drafter.extend(torch.randn(prefix, model.config.hidden_size, generator=g).to(device, model.dtype),
                   torch.randint(model.config.vocab_size, (prefix,), generator=g).to(device))
    times = {b: {"level": [], "search": []} for b in budgets}
    for rep in range(reps + 1):
        for b in budgets:
            calls = []

            def timed(nodes, tokens, parents, level):
                _sync(device)
                t = time.perf_counter()
                probs = drafter(nodes, tokens, parents, level)
                _sync(device)
                calls.append((level, time.perf_counter() - t))
                return probs

            t0 = time.perf_counter()
            eagle2_search(timed, 0, b, depth, top_k, device=device, token_map=drafter.token_map)
            _sync(device)
            total = time.perf_counter() - t0
            if rep:  # round 0 warms up
                times[b]["level"] += [s for level, s in calls if level > 1]  # level 1 reuses the committed root
                times[b]["search"].append(total - sum(s for _, s in calls))
    return {b: {k: statistics.median(v) if v else 0.0 for k, v in t.items()} for b, t in times.items()}


def profile_costs(model, head, sizes, depth=6, top_k=10, prefix=256, reps=10, progress=True) -> list[dict]:
    """Per tree size N: verify forward t(N), t(N)/t(1), drafting per step and the engine's overhead.

    The overhead is search, mask, acceptance and KV commit, as a share of the verify forward.
    """
    from .verify.profile import measure_verify

    if sizes[0] != 1 or sorted(set(sizes)) != list(sizes):
        raise ValueError(f"--sizes must be ascending, distinct and start at 1, got {sizes}")
    verify = measure_verify(model, sizes, prefix=prefix, depth=depth, reps=reps, progress=progress)
    drafting = measure_drafting(model, head, [n for n in sizes if n > 1], depth, top_k, prefix, reps)
    t1 = verify[1]["forward"]
    rows = []
    for n in sizes:
        v, d = verify[n], drafting.get(n, {"level": 0.0, "search": 0.0})
        engine = v["mask"] + v["accept"] + v["commit"] + d["search"]
        # A step makes about `depth` head calls: the commit of the accepted tokens and depth - 1 tree levels.
        draft = depth * d["level"] if n > 1 else 0.0
        rows.append({"n": n, "forward_ms": v["forward"] * 1e3, "ratio": v["forward"] / t1,
                     "draft_level_ms": d["level"] * 1e3, "draft_ms": draft * 1e3, "search_ms": d["search"] * 1e3,
                     "engine_ms": engine * 1e3, "overhead": engine / v["forward"],
                     "step_over_t1": (v["forward"] + engine + draft) / t1})
    return rows


def project(rows, tokens_per_pass) -> list[dict]:
    """Projected speedup = tokens/pass x t(1) / step time.

    `tokens_per_pass`: one number for every N, or {(method, budget, depth): tokens/pass} from a bench run.
    """
    import numpy as np

    if not isinstance(tokens_per_pass, dict):
        return [{"budget": r["n"], "tokens_per_pass": tokens_per_pass, "step_over_t1": r["step_over_t1"],
                 "speedup": tokens_per_pass / r["step_over_t1"]} for r in rows if r["n"] > 1]
    ns = [r["n"] for r in rows]
    out = []
    for (method, budget, depth), tpp in tokens_per_pass.items():
        if method == "auto" or not ns[0] < budget <= ns[-1]:  # auto's tree size varies per step
            continue
        verify = np.interp(budget, ns, [r["forward_ms"] + r["engine_ms"] for r in rows])
        level = np.interp(budget, ns[1:], [r["draft_level_ms"] for r in rows[1:]]) if len(ns) > 1 else 0.0
        step = (verify + depth * level) / rows[0]["forward_ms"]
        out.append({"method": method, "budget": budget, "tokens_per_pass": tpp, "step_over_t1": float(step),
                    "speedup": tpp / float(step)})
    return out


def measured_tokens_per_pass(path) -> dict:
    """Greedy tokens/pass per (method, budget, depth) from a bench results.json."""
    report = json.loads(Path(path).read_text())
    return {(r["method"], r["budget"], r["depth"]): r["tokens_per_pass"] for r in report["results"]
            if not r["temperature"] and r["method"] in TREE_METHODS}


def profile_report(rows, projections, info, command, goal_n=64) -> str:
    """The cost table, the goals, and the projected speedups, as markdown."""
    lines = [f"# eagletree bench --profile-only\n\n`{command}`\n",
             f"{info['config']} with random {info['dtype']} weights on {info['device']}; prefix {info['prefix']} "
             f"tokens, tree depth <= {info['depth']}, top-k {info['top_k']}; median of {info['reps']} "
             "round-robin reps.\n",
             "| N | verify ms | t(N)/t(1) | head call ms | drafting ms/step | search ms | engine ms (search, mask, "
             "accept, commit) | engine % of pass | step / t(1) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['forward_ms']:.2f} | {r['ratio']:.2f} | {r['draft_level_ms']:.2f} | "
                     f"{r['draft_ms']:.2f} | {r['search_ms']:.2f} | {r['engine_ms']:.2f} | {r['overhead']:.1%} | "
                     f"{r['step_over_t1']:.2f} |")
    goal = next((r for r in rows if r["n"] == goal_n), None)
    if goal:
        lines.append(f"\nGoals at N = {goal_n}: t(N)/t(1) = {goal['ratio']:.2f} (goal <= 1.2: "
                     f"{'met' if goal['ratio'] <= 1.2 else 'not met'}); engine overhead {goal['overhead']:.1%} of the "
                     f"pass (goal < 10%: {'met' if goal['overhead'] < 0.1 else 'not met'}).")
    if projections:
        lines += ["\nProjected speedup = tokens/pass / (step time / t(1)), tokens/pass "
                  + (f"from {info['tokens_source']}" if info.get("tokens_source") else "given") + ":\n",
                  "| method | budget | tokens/pass | step / t(1) | projected speedup |", "|---|---|---|---|---|"]
        for p in projections:
            lines.append(f"| {p.get('method', '-')} | {p['budget']} | {p['tokens_per_pass']:.2f} | "
                         f"{p['step_over_t1']:.2f} | {p['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main_profile(args, command: str) -> int:
    if not args.config:
        raise ValueError("--profile-only needs --config: a built-in name "
                         f"({', '.join(BUILTIN_CONFIGS)}) or a path to an HF config.json")
    sizes = parse_list(args.sizes, int, "sizes")
    config = build_config(args.config)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or "bfloat16")
    out = Path(args.out)
    tokens, source = args.tokens_per_pass, None
    results = Path(args.results) if args.results else out / "results.json"
    if tokens is None and results.is_file():
        tokens, source = measured_tokens_per_pass(results), str(results)
    model, head = random_model(config, device, dtype)
    rows = profile_costs(model, head, sizes, args.depth, args.top_k_draft, args.prefix, args.reps)
    projections = project(rows, tokens) if tokens is not None else []
    info = {"config": args.config, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "prefix": args.prefix, "depth": args.depth, "top_k": args.top_k_draft, "reps": args.reps,
            "tokens_source": source, "machine": machine_info(model)}
    text = profile_report(rows, projections, info, command)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps({"command": command, **info, "rows": rows,
                                                  "projections": projections}, indent=2))
    (out / "profile.md").write_text(text)
    print(text)
    print(f"wrote {out / 'profile.md'} and profile.json", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------------


def main(args) -> int:
    """`eagletree bench` (arguments from the CLI parser)."""
    command = "eagletree " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "eagletree bench"
    if args.profile_only:
        return main_profile(args, command)
    preset = QUICK if args.quick else FULL
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else preset[name]  # noqa: E731
    budgets = parse_list(pick("budgets"), int, "budgets")
    temperatures = parse_list(pick("temperatures"), float, "temperatures")
    if any(t < 0 for t in temperatures):
        raise ValueError(f"--temperatures must be >= 0, got {temperatures}")
    methods = method_grid(parse_list(args.methods, str, "methods"), budgets, args.depth, args.top_k_draft)
    max_new_tokens = pick("max_new_tokens")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    prompts = load_prompts(pick("prompts"))

    from .cli import SHIPPED_HEADS, draft_dtype
    from .draft_heads import load_head
    from .target import load_target

    model, tok = load_target(args.target, dtype=getattr(torch, args.dtype) if args.dtype else None,
                             device=args.device)
    if pack_target(model, args.pack):
        if not any(m.name == "packed" for m in methods):
            methods = [Method("packed")] + methods  # so the kernels' share of each speedup shows
    elif any(m.name == "packed" for m in methods):
        raise ValueError("method 'packed' (plain decoding with packed kernels) needs a packed target; "
                         "drop it or pass --pack on/auto on a CPU")
    head_path = args.head or SHIPPED_HEADS.get(args.target)
    head = None
    if head_path is not None and str(head_path) != "none":
        head = load_head(head_path, target_config=model.config, device=model.device,
                         dtype=draft_dtype(args.draft_dtype, model))
    report = run_bench(model, tok, head, prompts, methods, temperatures, max_new_tokens, args.seed, args.lookup_tokens)
    report.update(command=command, machine=machine_info(model),
                  settings={"target": args.target, "head": str(head_path), "prompts": pick("prompts"),
                            "packed": is_packed(model), "kernels": kernels_used(model),
                            "kernels_measured": None if getattr(model, "kernel_choice", None) is None
                            else model.kernel_choice.summary(),
                            "head_dtype": None if head is None else str(next(head.parameters()).dtype)[6:],
                            "budgets": budgets, "depth": args.depth, "top_k_draft": args.top_k_draft,
                            "methods": [m.label for m in methods], "quick": args.quick})
    out = write_outputs(report, args.out)
    print("\n" + (out / "results.md").read_text())
    print(f"wrote {out}/results.json, results.md, {', '.join(report['plots'])}", file=sys.stderr)
    return 0

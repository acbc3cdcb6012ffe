"""`eagletree profile`: the device's acceptance-independent costs on random weights (verify
latency per tree size, drafting, the engine's overhead) and the speedups they project.

transformers is imported only where a model is built from a config, so the CLI starts without it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..draft import head_class, make_drafter
from ..errors import InvalidValue
from ..files import check_output_folder, write_json_atomic, write_text_atomic
from ..search import eagle2_search
from ..verify.profile import measure_verify
from .inputs import TREE_METHODS, parse_list
from .report import machine_info, vocab_words

# Sizes written down from the models' config.json, so the profile needs no download.
BUILTIN_CONFIGS = {
    "llama-3.1-8b": dict(
        model_type="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}


def build_config(spec: str):
    """A built-in config name (see BUILTIN_CONFIGS) or a path to an HF config.json (or its folder)."""
    from transformers import AutoConfig  # lazy: see the module's docstring

    if spec in BUILTIN_CONFIGS:
        kw = dict(BUILTIN_CONFIGS[spec])
        return AutoConfig.for_model(kw.pop("model_type"), **kw)
    if not Path(spec).exists():
        raise InvalidValue(
            f"--config {spec!r} is neither a built-in config ({', '.join(BUILTIN_CONFIGS)}) nor an existing config.json"
        )
    return AutoConfig.from_pretrained(spec)


def random_target(config, device, dtype):
    """A model with random weights from `config`, built directly on the device (no download)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def random_model(config, device, dtype, draft_vocab: int | None = None, head_type: str = "eagle"):
    """The model and a matching head of `head_type` with random weights, built directly on the device (no download);
    the head drafts over the target's whole vocabulary, or over `draft_vocab` tokens."""
    model = random_target(config, device, dtype)
    with torch.device(device):
        tokens = None if draft_vocab is None else torch.arange(draft_vocab)
        head = head_class(head_type).new(model, tokens).to(device=device, dtype=dtype).eval()
    return model, head


def profile_head_type(head_dir) -> str:
    """The kind of head to profile: that of the head in `head_dir` (its config.json's head_type; a folder in
    EAGLE's own layout has none and is an EAGLE-1/2 head), or EAGLE-1/2 without one."""
    if not head_dir:
        return "eagle"
    path = Path(head_dir) / "config.json"
    try:
        kind = json.loads(path.read_text()).get("head_type", "eagle")
    except (OSError, ValueError, AttributeError) as e:
        raise InvalidValue(f"--head {head_dir}: cannot read its head_type from {path}: {e}") from None
    head_class(kind)  # an unknown kind is refused here, naming the known ones
    return kind


def profile_draft_vocab(choice: str, head_dir, device: torch.device, vocab_size: int) -> int | None:
    """How many tokens the profile's random head drafts over (None: the whole vocabulary), per --draft-vocab:
    full; head = as many as the head in `head_dir` drafts over (its config.json's draft_vocab_size); auto = full
    on a GPU, else the head's when a head is given."""
    if choice == "full" and head_dir:
        raise InvalidValue(
            "profile --draft-vocab full does not read --head (the random head drafts over the "
            "whole vocabulary); drop --head, or pass --draft-vocab head"
        )
    if choice == "auto":
        choice = "head" if device.type != "cuda" and head_dir else "full"
    if choice == "full":
        return None
    if not head_dir:
        raise InvalidValue(
            "profile --draft-vocab head: pass --head DIR; the random head drafts over as many "
            "tokens as that head's draft vocabulary"
        )
    path = Path(head_dir) / "config.json"
    try:
        size = json.loads(path.read_text()).get("draft_vocab_size")
    except (OSError, ValueError, AttributeError) as e:
        raise InvalidValue(f"--head {head_dir}: cannot read its draft vocabulary from {path}: {e}") from None
    if size is not None and not (isinstance(size, int) and 1 <= size <= vocab_size):
        raise InvalidValue(
            f"--head {head_dir}: draft_vocab_size {size!r} in {path}, expected an integer in "
            f"1..{vocab_size} (the --config's vocab_size)"
        )
    return size


def sync(device) -> None:
    """Wait for a GPU's queued work, so the clock reads what ran (no-op on a CPU or without a device)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class TimedDrafter:
    """A drafter (any tree search's expand function) that records (level, seconds) per call; on a GPU each
    call is synchronized on both sides, so its time is its own."""

    def __init__(self, drafter, device=None):
        self.drafter, self.device, self.calls = drafter, device, []

    def __call__(self, nodes, tokens, parents, level):
        sync(self.device)
        t = time.perf_counter()
        probs = self.drafter(nodes, tokens, parents, level)
        sync(self.device)
        self.calls.append((level, time.perf_counter() - t))
        return probs

    @property
    def seconds(self) -> float:
        """All calls' time so far."""
        return sum(s for _, s in self.calls)


def measure_drafting(model, head, budgets, depth=6, top_k=10, prefix=256, reps=10) -> dict[int, dict]:
    """Median seconds per budget of one head call per depth level ("level"), of the EAGLE-2 search's own work per
    step ("search") and of the catch-up on 2 accepted tokens that starts a step ("catch_up")."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    drafter = make_drafter(head, model)
    depth = min(depth, head.drafting.max_depth or depth)

    def commit(n: int) -> float:
        """Seconds of committing n random positions (the features the head reads, and their next tokens)."""
        feats = torch.randn(n, head.feature_spec.width, generator=g).to(device, model.dtype)
        tokens = torch.randint(model.config.vocab_size, (n,), generator=g).to(device)
        sync(device)
        t = time.perf_counter()
        drafter.extend(feats, tokens)
        sync(device)
        return time.perf_counter() - t

    commit(prefix)
    times = {b: {"level": [], "search": [], "catch_up": []} for b in budgets}
    for rep in range(reps + 1):
        for b in budgets:
            catch_up = commit(2)
            timed = TimedDrafter(drafter, device)
            t0 = time.perf_counter()
            eagle2_search(timed, 0, b, depth, top_k, device=device, token_map=drafter.token_map)
            sync(device)
            total = time.perf_counter() - t0
            if rep:  # round 0 warms up
                times[b]["level"] += [s for level, s in timed.calls if level > 1]  # level 1 reuses the committed root
                times[b]["search"].append(total - timed.seconds)
                times[b]["catch_up"].append(catch_up)
    return {b: {k: statistics.median(v) if v else 0.0 for k, v in t.items()} for b, t in times.items()}


def profile_costs(model, head, sizes, depth=6, top_k=10, prefix=256, reps=10, progress=True) -> list[dict]:
    """Per tree size N: verify forward t(N), t(N)/t(1), drafting per step and the engine's overhead.

    The overhead is search, mask, acceptance and KV commit, as a share of the verify forward.
    """
    if sizes[0] != 1 or sorted(set(sizes)) != list(sizes):
        raise InvalidValue(f"--sizes must be ascending, distinct and start at 1, got {sizes}")
    verify = measure_verify(model, sizes, prefix=prefix, depth=depth, reps=reps, progress=progress)
    drafting = measure_drafting(model, head, [n for n in sizes if n > 1], depth, top_k, prefix, reps)
    t1 = verify[1]["forward"]
    rows = []
    for n in sizes:
        v, d = verify[n], drafting.get(n, {"level": 0.0, "search": 0.0, "catch_up": 0.0})
        engine = v["mask"] + v["accept"] + v["commit"] + d["search"]
        draft = step_drafting(head.drafting, d, depth) if n > 1 else 0.0
        rows.append(
            {
                "n": n,
                "forward_ms": v["forward"] * 1e3,
                "ratio": v["forward"] / t1,
                "draft_level_ms": d["level"] * 1e3,
                "catch_up_ms": step_drafting(head.drafting, d, 1) * 1e3 if n > 1 else 0.0,
                "draft_ms": draft * 1e3,
                "search_ms": d["search"] * 1e3,
                "engine_ms": engine * 1e3,
                "overhead": engine / v["forward"],
                "step_over_t1": (v["forward"] + engine + draft) / t1,
            }
        )
    return rows


def step_drafting(drafting, measured: dict, depth: int) -> float:
    """Seconds of a step's drafting to `depth` levels, by the head's declared calls: what its drafter does when the
    accepted tokens are committed (`measured["catch_up"]`: the catch-up, and a block drafter's block, which it drafts
    there), then its calls per level below the root (as deep as it drafts)."""
    levels = min(depth, drafting.max_depth or depth) - 1
    commit = measured["catch_up"] if drafting.catch_up or drafting.block_calls else 0.0
    return commit + drafting.level_calls * levels * measured["level"]


def project(rows, tokens_per_pass) -> list[dict]:
    """Projected speedup = tokens/pass x t(1) / step time.

    `tokens_per_pass`: one number for every N, or {(method, budget, depth): tokens/pass} from a bench run.
    """
    if not isinstance(tokens_per_pass, dict):
        return [
            {
                "budget": r["n"],
                "tokens_per_pass": tokens_per_pass,
                "step_over_t1": r["step_over_t1"],
                "speedup": tokens_per_pass / r["step_over_t1"],
            }
            for r in rows
            if r["n"] > 1
        ]
    ns = [r["n"] for r in rows]
    out = []
    for (method, budget, depth), tpp in tokens_per_pass.items():
        if method == "auto" or not ns[0] < budget <= ns[-1]:  # auto's tree size varies per step
            continue
        verify = np.interp(budget, ns, [r["forward_ms"] + r["engine_ms"] for r in rows])
        level = np.interp(budget, ns[1:], [r["draft_level_ms"] for r in rows[1:]]) if len(ns) > 1 else 0.0
        step = (verify + depth * level) / rows[0]["forward_ms"]
        out.append(
            {
                "method": method,
                "budget": budget,
                "tokens_per_pass": tpp,
                "step_over_t1": float(step),
                "speedup": tpp / float(step),
            }
        )
    return out


def measured_tokens_per_pass(path) -> dict:
    """Greedy tokens/pass per (method, budget, depth) from a bench results.json."""
    try:
        report = json.loads(Path(path).read_text())
        return {
            (r["method"], r["budget"], r["depth"]): r["tokens_per_pass"]
            for r in report["results"]
            if not r["temperature"] and r["method"] in TREE_METHODS
        }
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidValue(
            f"{path}: not a bench results.json (expected the JSON `eagletree bench` writes, with "
            f"results rows): {type(e).__name__}: {e}"
        ) from None


def profile_report(rows, projections, info, command, goal_n=64) -> str:
    """The cost table, the goals, and the projected speedups, as markdown."""
    lines = [
        f"# eagletree profile\n\n`{command}`\n",
        f"{info['config']} with random {info['dtype']} weights on {info['device']}; prefix {info['prefix']} "
        f"tokens, tree depth <= {info['depth']}, top-k {info['top_k']}, the {info.get('head_type', 'eagle')} head "
        f"drafting over {vocab_words(info.get('draft_vocab', 'full'))}; median of {info['reps']} round-robin reps.\n",
        "| N | verify ms | t(N)/t(1) | head call ms | drafting ms/step | search ms | engine ms (search, mask, "
        "accept, commit) | engine % of pass | step / t(1) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['forward_ms']:.2f} | {r['ratio']:.2f} | {r['draft_level_ms']:.2f} | "
            f"{r['draft_ms']:.2f} | {r['search_ms']:.2f} | {r['engine_ms']:.2f} | {r['overhead']:.1%} | "
            f"{r['step_over_t1']:.2f} |"
        )
    goal = next((r for r in rows if r["n"] == goal_n), None)
    if goal:
        lines.append(
            f"\nGoals at N = {goal_n}: t(N)/t(1) = {goal['ratio']:.2f} (goal <= 1.2: "
            f"{'met' if goal['ratio'] <= 1.2 else 'not met'}); engine overhead {goal['overhead']:.1%} of the "
            f"pass (goal < 10%: {'met' if goal['overhead'] < 0.1 else 'not met'})."
        )
    if projections:
        lines += [
            "\nProjected speedup = tokens/pass / (step time / t(1)), tokens/pass "
            + (f"from {info['tokens_source']}" if info.get("tokens_source") else "given")
            + ":\n",
            "| method | budget | tokens/pass | step / t(1) | projected speedup |",
            "|---|---|---|---|---|",
        ]
        for p in projections:
            lines.append(
                f"| {p.get('method', '-')} | {p['budget']} | {p['tokens_per_pass']:.2f} | "
                f"{p['step_over_t1']:.2f} | {p['speedup']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main_profile(args, command: str = "eagletree profile") -> int:
    """`eagletree profile` (arguments from the CLI parser): measure, write profile.json and profile.md, print."""
    check_output_folder(args.out, "-o/--out")  # before minutes of measuring
    sizes = parse_list(args.sizes, int, "sizes")
    if args.tokens_per_pass is not None and not 1.0 <= args.tokens_per_pass < float("inf"):
        raise InvalidValue(
            f"--tokens-per-pass must be a finite number >= 1 (a pass emits at least one token), "
            f"got {args.tokens_per_pass}"
        )
    if args.results and not Path(args.results).is_file():
        raise InvalidValue(f"--results {args.results!r} does not exist; expected a bench results.json")
    config = build_config(args.config)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or "bfloat16")
    out = Path(args.out)
    tokens, source = args.tokens_per_pass, None
    results = Path(args.results) if args.results else out / "results.json"
    if tokens is None and results.is_file():
        tokens, source = measured_tokens_per_pass(results), str(results)
    draft_vocab = profile_draft_vocab(args.draft_vocab, args.head, device, config.vocab_size)
    kind = profile_head_type(args.head)
    model, head = random_model(config, device, dtype, draft_vocab, kind)
    rows = profile_costs(model, head, sizes, args.depth, args.top_k_draft, args.prefix, args.reps)
    projections = project(rows, tokens) if tokens is not None else []
    info = {
        "config": args.config,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "draft_vocab": draft_vocab or "full",
        "head_type": kind,
        "prefix": args.prefix,
        "depth": args.depth,
        "top_k": args.top_k_draft,
        "reps": args.reps,
        "tokens_source": source,
        "machine": machine_info(model),
    }
    text = profile_report(rows, projections, info, command)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "profile.json", {"command": command, **info, "rows": rows, "projections": projections})
    write_text_atomic(out / "profile.md", text)
    print(text)
    print(f"wrote {out / 'profile.md'} and profile.json", file=sys.stderr)
    return 0

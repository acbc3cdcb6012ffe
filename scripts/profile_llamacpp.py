"""llama.cpp's costs for `eagletree plan --engine llamacpp`, measured in llama.cpp itself on the target's GGUF file:

    python scripts/profile_llamacpp.py --head DIR --out costs.json [--target smollm2-135m] [--threads 2]
        [--settings 1:0 2:0 3:0 3:0.5] [--prompts 8] [--max-new-tokens 128] [--rounds 2]

Per thread count: ms per plain token; the n-gram modes' tokens/s; and the head (`export --format gguf`) at each
`--settings` k:p_min (`--spec-draft-n-max`, `--spec-draft-p-min`): one debug-verbosity run each, whose timestamps give
every step's size (1 + its drafts), draft calls and phases (drafting, the target's pass, what follows), then timed runs
at normal verbosity, alternating per round (the median round kept). The costs eagletree/plan_llamacpp.py predicts
with (a step that drafted nothing, one that verified a draft, each further draft, an EAGLE-3 call past the last draft)
are fitted to the timed runs by least squares over the debug runs' step counts (the same greedy answers); how well
they then model each run is printed. llama.cpp as scripts/check_llamacpp.py builds it (.llama-cpp/, or LLAMA_SERVER).
Measure it alone: llama.cpp's spinning threads collapse under any other load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from engines import llamacpp_build, llamacpp_runs  # noqa: E402

NGRAM_MODES = ("ngram-simple", "ngram-mod")
SPEC_TYPES = {"dflash": "draft-dflash", "eagle3": "draft-eagle3"}  # head_type -> llama-server's --spec-type


def setting(text: str) -> tuple[int, float]:
    """k:p_min, e.g. 3:0.5."""
    try:
        k, p = text.split(":")
        k, p = int(k), float(p)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a setting is k:p_min such as 3:0.5, got {text!r}") from None
    if k < 1 or not 0 <= p < 1:
        raise argparse.ArgumentTypeError(f"k must be >= 1 and p_min in [0, 1), got {text!r}")
    return k, p


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", type=Path, required=True, help="a block or EAGLE-3 head folder")
    p.add_argument("--out", type=Path, required=True, help="the cost profile (JSON) for plan --profile")
    p.add_argument("--target", default="smollm2-135m", help="an alias of a GGUF target or a .gguf file")
    p.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1])
    p.add_argument("--settings", type=setting, nargs="+", default=None, help="k:p_min of each head run")
    p.add_argument("--prompts", type=int, default=8, help="MT-bench first turns")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    for name in ("prompts", "max_new_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.settings is not None and len(args.settings) < 3:
        p.error("--settings needs 3 or more k:p_min runs (three costs are fitted to them)")
    if min(args.threads) < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


def default_settings(call_per_draft: bool, deepest: int | None) -> list[tuple[int, float]]:
    """Runs that tell the costs apart: chains of several lengths, and ones that p_min cuts (steps drafting nothing,
    and for EAGLE-3 calls past the last draft)."""
    eagle3 = [(1, 0.0), (2, 0.0), (3, 0.0), (3, 0.5), (1, 0.5)]
    runs = eagle3 if call_per_draft else [(1, 0.0), (3, 0.0), (7, 0.0), (7, 0.3), (3, 0.3)]
    return [(min(k, deepest or k), p) for k, p in runs]


def counts(timeline: list[dict]) -> dict:
    """A debug run's steps as `simulate` counts them: steps per size and their draft calls."""
    top = max(s["size"] for s in timeline)
    sizes, calls = [0] * (top + 1), [0] * (top + 1)
    for s in timeline:
        sizes[s["size"]] += 1
        calls[s["size"]] += s["calls"]
    return {"sizes": sizes, "calls": calls}


def fit(runs: list[dict], timelines: list[list[dict]], plain_ms: float) -> tuple[dict, list[float]]:
    """The step costs of `LlamaCosts` from timed runs and their steps: a call past a chain's last draft and the
    target's share of a drafting step from the steps' timestamps (medians), the rest by least squares: timed ms =
    empty * (plain + e) + drafted * one + further * draft + stops * call. Returns the costs and each run's relative
    residual."""
    import statistics

    import numpy as np

    from eagletree.plan_llamacpp import LlamaCosts

    steps = [s for t in timelines for s in t]
    drafting = [s for s in steps if s["size"] > 1]
    call = statistics.median(s["draft_ms"] / s["calls"] for s in drafting if s["calls"])
    share = statistics.median(s["verify_ms"] / (s["draft_ms"] + s["verify_ms"] + s["after_ms"]) for s in drafting)
    terms = [LlamaCosts.terms(counts(t)) for t in timelines]
    a = np.array([[t["empty"], t["drafted"], t["further"]] for t in terms], dtype=float)
    b = np.array([r["ms"] - t["empty"] * plain_ms - t["stops"] * call for r, t in zip(runs, terms)])
    (extra, one, draft), *_ = np.linalg.lstsq(a, b, rcond=None)
    costs = {"empty_ms": plain_ms + extra, "one_ms": one, "draft_ms": draft, "stop_call_ms": call}
    costs["target_share"] = share
    model = a @ np.array([extra, one, draft]) + np.array([t["empty"] * plain_ms + t["stops"] * call for t in terms])
    return {k: float(v) for k, v in costs.items()}, [float(x) for x in model / np.array([r["ms"] for r in runs]) - 1]


def cautious_rate(mode_rounds: list[dict], plain_rounds: list[dict]) -> float:
    """An n-gram mode's tokens/s, cautiously: plain's rate times the mode's per-prompt ratio to plain (paired by prompt
    and round) less two standard errors. (The plan lists the n-gram modes and never chooses them: their gain depends
    on how much each answer repeats, and it did not carry over to other prompts.)"""
    import statistics

    ratios = [m / p for a, b in zip(mode_rounds, plain_rounds) for m, p in zip(a["rates"], b["rates"])]
    low = statistics.mean(ratios) - 2 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else 0.0
    plain = statistics.median(r["tokens"] / r["ms"] * 1e3 for r in plain_rounds)
    return plain * low


def profile(args, work: Path) -> dict:
    import torch

    from eagletree.export.convert import export_head

    binary = llamacpp_build.server()
    target, _, head, prompts, model = llamacpp_runs.target_and_head(args.target, args.head, args.prompts)
    if head.head_type not in SPEC_TYPES:
        raise SystemExit(f"error: --head is a {head.head_type!r} head; llama.cpp drafts {sorted(SPEC_TYPES)}")
    call_per_draft = head.drafting.level_calls > 0
    settings = args.settings or default_settings(call_per_draft, head.drafting.max_depth)
    export = export_head(head, work / "export", "gguf", dtype=torch.float32, target=target) / "model.gguf"
    n = args.max_new_tokens
    costs, raw = [], []
    for threads in args.threads:

        def flags(name):  # noqa: E306
            if name == "plain":
                return []
            if name in NGRAM_MODES:
                return ["--spec-type", name]
            k, p = name
            drafter = ["-md", str(export), "--spec-type", SPEC_TYPES[head.head_type]]
            return [*drafter, "--spec-draft-n-max", str(k), "--spec-draft-p-min", str(p)]

        names = ["plain", *NGRAM_MODES, *settings]
        timelines = {}
        for k, p in settings:  # each step's phases: one debug-verbosity run each (greedy: the timed runs' answers)
            with llamacpp_runs.Server(binary, model, work / "debug.log", threads, flags((k, p)), verbose=True) as s:
                llamacpp_runs.totals(s, prompts, n)
            timelines[(k, p)] = llamacpp_runs.step_timeline(work / "debug.log", call_per_draft)
        rounds = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                with llamacpp_runs.Server(binary, model, work / "server.log", threads, flags(name)) as s:
                    rounds[name].append(llamacpp_runs.totals(s, prompts, n))
        median = {name: sorted(rs, key=lambda r: r["ms"] / r["tokens"])[len(rs) // 2] for name, rs in rounds.items()}
        timed = [median[setting] for setting in settings]
        for setting, run in zip(settings, timed):
            if len(timelines[setting]) != run["steps"]:
                found = len(timelines[setting])
                raise SystemExit(f"error: {setting}: {found} steps in the debug log, {run['steps']} timed")
        plain_ms = median["plain"]["ms"] / median["plain"]["tokens"]
        terms, residuals = fit(timed, [timelines[s] for s in settings], plain_ms)
        runs = [{"k": k, "p_min": p, **run, "fit": e} for (k, p), run, e in zip(settings, timed, residuals)]
        ngram = {m: cautious_rate(rounds[m], rounds["plain"]) for m in NGRAM_MODES}
        costs.append({"threads": threads, "plain_ms": plain_ms, **terms, "ngram": ngram})
        raw.append({"threads": threads, "plain": median["plain"], "ngram": {m: median[m] for m in NGRAM_MODES}})
        raw[-1] |= {"ngram_cautious": ngram, "head": runs}
    return {
        "engine": "llamacpp",
        "head": str(args.head),
        "head_type": head.head_type,
        "spec_type": SPEC_TYPES[head.head_type],
        "max_k": max(k for k, _ in settings),  # the sizes measured bound the plan's k
        "target": args.target,
        "target_gguf": model,
        "target_bytes": Path(model).stat().st_size,
        "llama_server": str(binary),
        "device": _cpu(),
        "date": datetime.date.today().isoformat(),
        "prompts": args.prompts,
        "max_new_tokens": n,
        "costs": costs,
        "runs": raw,
    }


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="profile-llamacpp-") as tmp:
        result = profile(args, Path(tmp))
    args.out.write_text(json.dumps(result, indent=2))
    for c, r in zip(result["costs"], result["runs"]):
        print(
            f"{c['threads']} threads: plain {c['plain_ms']:.2f} ms a token; a step drafting nothing "
            f"{c['empty_ms']:.2f}, one draft {c['one_ms']:.2f}, each further draft {c['draft_ms']:.2f}, a call past "
            f"the last draft {c['stop_call_ms']:.2f}; the target's share of a drafting step {c['target_share']:.0%}"
        )
        print("  n-gram: " + ", ".join(f"{m} {v:.1f} tokens/s" for m, v in c["ngram"].items()))
        print(
            "  the costs model each head run within "
            + ", ".join(f"k={x['k']} p_min={x['p_min']:g}: {x['fit']:+.1%}" for x in r["head"])
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/check_llamacpp.py --plan: what `eagletree plan --engine llamacpp` chose, served by llama.cpp on the prompts
the plan left for checking (the second half of its --prompts), next to llama.cpp plain and the plan's best head
setting; measured tokens/s against the plan's prediction.

The machine's speed drifts between the profile and the check, so each prediction is judged as a ratio to plain
decoding measured in the same run (its absolute tokens/s are printed too): the check fails when a ratio is off by
more than TOLERANCE, or when the choice measures below plain."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import llamacpp_runs

TOLERANCE = 0.05


def settings(plan: dict) -> dict[str, dict]:
    """The rows to serve: plain (at the choice's threads), the choice unless it is plain, and the best head setting
    unless it is the choice."""
    choice = plan["choice"]
    rows = {"plain": {"mode": "plain", "threads": choice["threads"], "tokens_per_s": _plain(plan, choice["threads"])}}
    if choice["mode"] != "plain":
        rows["choice"] = choice
    if plan["best_head"] != choice:
        rows["best head"] = plan["best_head"]
    return rows


def _plain(plan: dict, threads: int) -> float:
    return next(r["tokens_per_s"] for r in plan["options"] if r["mode"] == "plain" and r["threads"] == threads)


def flags(row: dict, export: str, spec_type: str) -> list[str]:
    if row["mode"] == "plain":
        return []
    if row["mode"] != "head":
        return ["--spec-type", row["mode"]]
    return ["-md", export, "--spec-type", spec_type, "--spec-draft-n-max", str(row["k"])] + [
        "--spec-draft-p-min",
        str(row["p_min"]),
    ]


def check_plan(plan_path: Path, work: Path, rounds: int = 2) -> dict:
    import torch

    from eagletree.bench import load_prompts
    from eagletree.decode import encode_prompt
    from eagletree.draft import load_head
    from eagletree.export.convert import export_head
    from eagletree.plan import split_prompts
    from eagletree.plan_llamacpp import LlamaCosts, own_chains, simulate
    from eagletree.target import load_target

    from . import llamacpp_build

    plan = json.loads(plan_path.read_text())
    profile = plan["profile"]
    binary = llamacpp_build.server()
    target, tokenizer = load_target(profile["target"], dtype=torch.float32, device="cpu")
    head = load_head(profile["head"], target_config=target.config)
    export = str(export_head(head, work / "export", "gguf", dtype=torch.float32, target=target) / "model.gguf")
    _, held_out = split_prompts(load_prompts(plan["prompts"]))
    prompts = [encode_prompt(tokenizer, p).tolist() for p in held_out]
    rows = settings(plan)
    # the same costs on the held-out prompts' own answers: how much of a miss is the prompts' acceptance, not the costs
    heads = [r for r in rows.values() if r["mode"] == "head"]
    here = {}
    if heads:
        n = plan["max_new_tokens"]
        chains = own_chains(target, tokenizer, head, held_out, n, max(r["k"] for r in heads), progress=False)
        costs = {c["threads"]: LlamaCosts(**c) for c in plan["costs"]}
        for name, r in rows.items():
            if r["mode"] == "head":
                counts = simulate(chains, r["k"], r["p_min"], head.drafting.level_calls > 0, n)
                here[name] = counts["tokens"] / costs[r["threads"]].step_ms(counts) * 1e3
    runs = {name: [] for name in rows}
    for _ in range(rounds):
        for name, row in rows.items():
            extra = flags(row, export, profile["spec_type"])
            with llamacpp_runs.Server(binary, profile["target_gguf"], work / "server.log", row["threads"], extra) as s:
                runs[name].append(llamacpp_runs.totals(s, prompts, plan["max_new_tokens"]))
    measured = {name: statistics.median(r["tokens"] / r["ms"] * 1e3 for r in rs) for name, rs in runs.items()}
    return judge(rows, measured, len(prompts), here)


def judge(rows: dict[str, dict], measured: dict[str, float], prompts: int, here: dict | None = None) -> dict:
    """Each row's measured and predicted tokens/s and ratio to plain; problems where a ratio is off by more than
    TOLERANCE or the choice (when not plain itself) measures below plain. `here`: head rows' tokens/s predicted by the
    same costs on the checked prompts' own answers (reported, not judged)."""
    plain_pred, plain_meas = rows["plain"]["tokens_per_s"], measured["plain"]
    report, problems = {}, []
    for name, row in rows.items():
        pred_ratio, meas_ratio = row["tokens_per_s"] / plain_pred, measured[name] / plain_meas
        error = meas_ratio / pred_ratio - 1
        report[name] = {
            "setting": {k: v for k, v in row.items() if k in ("mode", "threads", "k", "p_min")},
            "predicted_tokens_per_s": row["tokens_per_s"],
            "measured_tokens_per_s": measured[name],
            "predicted_vs_plain": pred_ratio,
            "measured_vs_plain": meas_ratio,
            "ratio_error": error,
        }
        if here and name in here:
            report[name]["predicted_here_vs_plain"] = here[name] / plain_pred
        if abs(error) > TOLERANCE:
            problems.append(
                f"{name}: measured {meas_ratio:.3f}x plain, predicted {pred_ratio:.3f}x ({error:+.1%}, more than "
                f"{TOLERANCE:.0%} off)"
            )
    if "choice" in measured and measured["choice"] < plain_meas:
        problems.append(f"the choice measured {measured['choice']:.1f} tokens/s, below plain's {plain_meas:.1f}")
    return {"prompts": prompts, "rows": report, "problems": problems, "ok": not problems}


def lines(result: dict) -> list[str]:
    out = [f"{result['prompts']} held-out prompts; tokens/s measured (predicted), and as a ratio to plain:"]
    for name, r in result["rows"].items():
        out.append(
            f"  {name:>9}: {r['setting']} {r['measured_tokens_per_s']:.1f} ({r['predicted_tokens_per_s']:.1f}); "
            f"{r['measured_vs_plain']:.3f}x ({r['predicted_vs_plain']:.3f}x, {r['ratio_error']:+.1%})"
            + (
                f"; the same costs on these prompts' answers: {r['predicted_here_vs_plain']:.3f}x"
                if "predicted_here_vs_plain" in r
                else ""
            )
        )
    return out

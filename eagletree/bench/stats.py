"""Statistics of bench runs: medians and spreads of per-prompt ratios, a method's summary, acceptance
calibration bins, and a paired bootstrap interval over prompts."""

from __future__ import annotations

import random
import statistics

from ..decode.resources import head_calibrator
from .inputs import Method


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else None


def _quantiles(values: list[float]) -> dict:
    xs = [x for x in values if x == x]  # drop NaN: a run that ended with its first pass has no decoding rate
    per_prompt = [x if x == x else None for x in values]
    if not xs:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "per_prompt": per_prompt}
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "q1": q1,
        "q3": q3,
        "per_prompt": per_prompt,
    }


def summarize(m: Method, temperature: float, row: dict, prompts: int) -> dict:
    """One method at one temperature: pooled tokens/pass, median rates, the per-prompt speedup spread.

    tokens/s and speedups are decoding rates after the first pass; end to end and the first pass's time are kept too.
    """
    return {
        "method": m.name,
        "budget": m.budget,
        "depth": m.depth if m.budget else None,
        "label": m.label,
        "temperature": temperature,
        "prompts": prompts,
        "new_tokens": row["new"],
        "passes": row["passes"],
        "tokens_per_pass": row["new"] / row["passes"] if row["passes"] else 0.0,
        "predicted_tokens_per_pass": statistics.mean(row["predicted"]) if row["predicted"] else None,
        "tokens_per_s": _median(row["rate"]),
        "tokens_per_s_end_to_end": _median(row["e2e"]),
        "first_pass_s": _median(row["first"]),
        "speedup": _quantiles(row["ratio"]),
        "speedup_same_kernels": _quantiles(row["same"]) if row["same"] else None,
        "identical": None if temperature else not row["mismatches"],
        "mismatches": row["mismatches"],
        "accepted_histogram": dict(sorted(row["lengths"].items())),
    }


def calibration_bins(probs, hits, head=None, bins: int = 10) -> dict:
    """Per-node predicted (draft probability) vs measured acceptance in equal-width bins.

    Also binned by the head's calibrated prediction, when it has a calibration.json.
    """
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
    return [
        {
            "predicted": statistics.mean(q for q, _ in g),
            "measured": statistics.mean(float(y) for _, y in g),
            "nodes": len(g),
        }
        for _, g in sorted(groups.items())
    ]


def ratio_interval(new, passes, base_new, base_passes, reps: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """95% bootstrap interval of (sum new / sum passes) / (sum base_new / sum base_passes) - 1 over prompts;
    None for fewer than 2 prompts (no spread to resample) or a prompt without passes."""
    if len(new) < 2 or not all(passes) or not all(base_passes) or not all(base_new):
        return None
    rng = random.Random(seed)
    n, out = len(new), []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        a = sum(new[i] for i in idx) / sum(passes[i] for i in idx)
        b = sum(base_new[i] for i in idx) / sum(base_passes[i] for i in idx)
        out.append(a / b - 1)
    out.sort()
    return out[int(0.025 * reps)], out[int(0.975 * reps) - 1]

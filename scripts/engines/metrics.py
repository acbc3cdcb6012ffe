"""The rules scripts/check_vllm.py judges by, pure (tested without vLLM): draft acceptance per position counted
from eagletree's chain passes and from vLLM's counters, the outputs compared token for token, the printed table,
and a plan's predicted tokens per pass against vLLM's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

TOLERANCE = 0.02  # the largest |vLLM - eagletree| acceptance at any draft position (absolute)
PLAN_TOLERANCE = 0.05  # the largest |vLLM / plan - 1| of tokens per pass at the plan's K
MIN_REACHED = 100  # passes reaching a position before its conditional rate is judged (one pass moves it <= 1 point)
RULE = (
    f"at each draft position d, |vLLM - eagletree| <= {TOLERANCE} for the fraction of the drafting passes (at least "
    f"{MIN_REACHED}) accepting the d-th draft, and for the fraction of the passes that reached d accepting it where "
    f"both engines have >= {MIN_REACHED} such passes (eagletree's chain on vLLM's schedule)"
)


def chain_counts(passes, k: int) -> list[list[int]]:
    """[reached, accepted] per draft position 1..k from chain passes given as (drafted, accepted) draft counts.

    A pass reaches position d when it drafted at least d tokens and accepted the d - 1 before it."""
    counts = [[0, 0] for _ in range(k)]
    for drafted, accepted in passes:
        if not 0 <= accepted <= drafted <= k:
            raise ValueError(f"a chain pass of {drafted} drafts cannot accept {accepted} (k = {k})")
        for d in range(1, drafted + 1):
            if accepted < d - 1:
                break
            counts[d - 1][0] += 1
            counts[d - 1][1] += accepted >= d
    return counts


def vllm_counts(num_drafts: int, accepted_per_pos: list[int]) -> list[list[int]]:
    """[reached, accepted] per draft position from vLLM's counters: every draft reaches position 1; position d is
    reached by the drafts that accepted position d - 1 (vLLM accepts a prefix of the chain)."""
    reached = [num_drafts, *accepted_per_pos[:-1]]
    counts = [[r, a] for r, a in zip(reached, accepted_per_pos)]
    for d, (r, a) in enumerate(counts, start=1):
        if not 0 <= a <= r:
            raise ValueError(f"vLLM's counters: position {d} accepted {a} of {r} drafts reaching it")
    return counts


def rates(counts: list[list[int]]) -> list[float | None]:
    """accepted / reached per position (None where no pass reached it)."""
    return [a / r if r else None for r, a in counts]


def per_draft(counts: list[list[int]]) -> list[float | None]:
    """accepted at position d / drafting passes (every pass reaches position 1): vLLM's own per-position rate."""
    return [a / counts[0][0] if counts[0][0] else None for _, a in counts]


def acceptance_problems(
    vllm: list[list[int]],
    ours: list[list[int]],
    tolerance: float = TOLERANCE,
    min_reached: int = MIN_REACHED,
    engine: str = "vLLM",
    own_answers: bool = False,
) -> list[str]:
    """Where the engines' acceptance at a draft position differs by more than `tolerance` (absolute): per drafting
    pass, and of the passes that reached the position (judged where both engines have `min_reached` such passes).
    Fewer than `min_reached` drafting passes is a problem too: nothing would be judged. `own_answers`: the engines
    drafted on answers of their own (llama.cpp's arithmetic parts from eagletree's), so two samples of a rate: a
    rate of the passes reaching a position differs by more than the tolerance plus twice the sampling noise of the
    difference (pooled binomial standard error) before it is a problem."""
    if len(vllm) != len(ours) or not vllm:
        return [f"{engine} counted {len(vllm)} draft positions, eagletree {len(ours)}"]
    if min(vllm[0][0], ours[0][0]) < min_reached:
        return [
            f"drafting passes: {engine} {vllm[0][0]}, eagletree {ours[0][0]}; fewer than {min_reached} are too few to "
            "compare acceptance (use more --prompts or --max-new-tokens)"
        ]
    problems = []
    for d, (v, o) in enumerate(zip(vllm, ours), start=1):
        pv, po = v[1] / vllm[0][0], o[1] / ours[0][0]
        if abs(pv - po) > tolerance:
            problems.append(
                f"position {d}: per drafting pass {engine} accepts {pv:.3f}, eagletree {po:.3f}, "
                f"more than {tolerance} apart"
            )
        if min(v[0], o[0]) < min_reached:
            continue
        noise = 2 * pooled_error(v, o) if own_answers else 0.0
        if abs(v[1] / v[0] - o[1] / o[0]) > tolerance + noise:
            allowed = f"{tolerance} + {noise:.3f} (twice the sampling noise)" if own_answers else f"{tolerance}"
            problems.append(
                f"position {d}: of the passes reaching it {engine} accepts {v[1] / v[0]:.3f} ({v[1]}/{v[0]}), "
                f"eagletree {o[1] / o[0]:.3f} ({o[1]}/{o[0]}), more than {allowed} apart"
            )
    return problems


def pooled_error(a: list[int], b: list[int]) -> float:
    """The standard error of the difference of two binomial rates [trials, successes], pooled."""
    p = (a[1] + b[1]) / (a[0] + b[0])
    return math.sqrt(p * (1 - p) * (1 / a[0] + 1 / b[0]))


def output_problems(runs: dict[str, list[list[int]]], reference: str) -> list[str]:
    """Each run whose token ids differ from `reference`'s, naming the first prompt and token where they part."""
    want = runs[reference]
    problems = []
    for name, got in runs.items():
        if len(got) != len(want):
            problems.append(f"{name} answered {len(got)} prompts, {reference} {len(want)}")
            continue
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                problems.append(
                    f"{name} differs from {reference} on prompt {i} at token {j} ({len(a)} vs {len(b)} tokens)"
                )
                break
    return problems


def tokens_per_pass(counts: list[list[int]]) -> float | None:
    """1 + the mean accepted drafts per drafting pass (vLLM's mean acceptance length; the same for both engines)."""
    return 1 + sum(a for _, a in counts) / counts[0][0] if counts and counts[0][0] else None


def acceptance(counts: list[list[int]]) -> dict:
    """One engine's acceptance, as recorded: counts [reached, accepted], both rates per position, tokens per pass."""
    return {
        "counts": counts,
        "rates": rates(counts),
        "per_draft": per_draft(counts),
        "tokens_per_pass": tokens_per_pass(counts),
    }


def table(result: dict) -> list[str]:
    """The printed summary: acceptance per position for both engines, then tokens per pass and tokens/s."""
    v, o = result["vllm_eagle"]["acceptance"], result["eagletree_chain"]["acceptance"]
    lines = [
        "acceptance of the d-th draft: of the passes that reached d (accepted/reached), and per drafting pass",
        f"{'d':>3}  {'vLLM':>18}  {'eagletree':>18}  {'|diff|':>6}  {'vLLM':>6}  {'eagletree':>9}  {'|diff|':>6}",
    ]
    for d in range(len(v["counts"])):
        vr, orate = v["rates"][d], o["rates"][d]
        diff = f"{abs(vr - orate):.3f}" if vr is not None and orate is not None else "-"
        vp, op = v["per_draft"][d] or 0.0, o["per_draft"][d] or 0.0
        lines.append(
            f"{d + 1:>3}  {_rate(vr, v['counts'][d]):>18}  {_rate(orate, o['counts'][d]):>18}  {diff:>6}  "
            f"{vp:>6.3f}  {op:>9.3f}  {abs(vp - op):>6.3f}"
        )
    n = result["settings"]["prompts"]
    lines.append(f"{'run':<18}{'tokens/pass':>12}{'tok/s one at a time':>21}{f'tok/s batched ({n})':>20}")
    for name in ("vllm_plain", "vllm_eagle", "eagletree_plain", "eagletree_chain"):
        run = result[name]
        tpp = run["acceptance"]["tokens_per_pass"] if "acceptance" in run else 1.0
        one, batched = run["one_at_a_time"]["tokens_per_s"], run["batched"]["tokens_per_s"]
        lines.append(f"{name:<18}{tpp or 1.0:>12.2f}{one:>21.1f}{batched:>20.1f}")
    plan = result.get("plan")
    if plan is not None and plan["relative_error"] is not None:
        lines.append(
            f"plan (K={plan['k']}, measured on {plan['positions']} positions): predicted {plan['predicted']:.3f} "
            f"tokens/pass, vLLM {plan['measured']:.3f} ({plan['relative_error']:+.1%})"
        )
    return lines


def _rate(rate: float | None, counts: list[int]) -> str:
    return "-" if rate is None else f"{rate:.3f} ({counts[1]}/{counts[0]})"


# ----------------------------------------------------------------------------- a plan against vLLM


def read_plan(path: Path) -> dict:
    """`eagletree plan --engine vllm`'s JSON -> {"k": its chain's length, "predicted": its tokens per pass (decoding
    the measured answers, else over every measured position), "positions": how many it measured}."""
    try:
        data = json.loads(Path(path).read_text())
        engine, config = data["engine"], data["config"]["speculative_config"]
        k = config["num_speculative_tokens"]
        predicted = data.get("decoded_tokens_per_pass") or data["expected_tokens_per_pass"]
        positions = data["acceptance"]["positions"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(
            f"error: --plan {str(path)!r}: not a plan's JSON as `eagletree plan --engine vllm -o FILE` writes it "
            f"({type(e).__name__}: {e})"
        ) from None
    if engine != "vllm" or not isinstance(k, int) or k < 1:
        raise SystemExit(
            f"error: --plan {str(path)!r}: expected a vLLM plan with K >= 1, got engine {engine!r}, K {k!r}"
        )
    return {"k": k, "predicted": float(predicted), "positions": positions}


def plan_vs_engine(plan: dict, vllm_eagle: dict) -> dict:
    """The plan's predicted tokens per pass against vLLM's measured one at its K (relative error)."""
    measured = (vllm_eagle.get("acceptance") or {}).get("tokens_per_pass")
    error = None if not measured else measured / plan["predicted"] - 1.0
    return {**plan, "measured": measured, "relative_error": error}


def plan_problems(comparison: dict | None) -> list[str]:
    """A plan whose prediction misses vLLM's measured tokens per pass by more than PLAN_TOLERANCE."""
    if comparison is None:
        return []
    error = comparison["relative_error"]
    if error is None:
        return ["vLLM measured no tokens per pass to compare the plan with"]
    if abs(error) > PLAN_TOLERANCE:
        return [
            f"the plan predicted {comparison['predicted']:.3f} tokens/pass at K={comparison['k']}, vLLM measured "
            f"{comparison['measured']:.3f} ({error:+.1%}, beyond {PLAN_TOLERANCE:.0%})"
        ]
    return []

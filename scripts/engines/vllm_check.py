"""scripts/check_vllm.py's check put together: the venv, vLLM's two runs, eagletree's two, and every problem found
(the command line and its description are in scripts/check_vllm.py)."""

from __future__ import annotations

import time
from pathlib import Path

from .eagletree_runs import prepare, run_eagletree
from .metrics import RULE, acceptance_problems, output_problems, plan_problems, plan_vs_engine
from .vllm_runs import MODES, run_vllm, vllm_run
from .vllm_venv import VLLM_REQUIREMENT, ensure_venv, vllm_env


def evaluate(result: dict) -> list[str]:
    """Every problem found: outputs other than eagletree's plain decoding, acceptance further apart than the rule."""
    runs = {}
    for name in ("eagletree_plain", "vllm_plain", "vllm_eagle", "eagletree_chain"):
        for how in ("one_at_a_time", "batched"):
            runs[f"{name} ({how.replace('_', ' ')})"] = result[name][how]["outputs"]
    problems = output_problems(runs, "eagletree_plain (one at a time)")
    if "acceptance" not in result["vllm_eagle"]:
        problems.append("vLLM reported no speculative-decoding counters")
    else:
        problems += acceptance_problems(
            result["vllm_eagle"]["acceptance"]["counts"], result["eagletree_chain"]["acceptance"]["counts"]
        )
    return problems + plan_problems(result.get("plan"))


def check(args, work: Path) -> dict:
    """Everything measured, in one dict (settings, the four runs, problems, ok)."""
    import torch

    from eagletree.errors import EagletreeError

    venv = ensure_venv(args.venv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    try:
        setup = prepare(args, work)
    except (EagletreeError, ValueError, OSError) as e:  # a head, export, target or prompt file that is not usable
        raise SystemExit(f"error: {e}") from None
    longest = max(map(len, setup["prompts"]))
    job = {
        "target": setup["target_folder"],
        "export": setup["export"],
        "kind": setup["kind"],
        "start": setup["start"],
        "prompts": setup["prompts"],
        "stop": setup["stop"],
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "max_model_len": max(2048, longest + args.max_new_tokens + args.k + 16),
    }
    env = vllm_env(args.venv, args.threads, args.kv_cache_gib)
    result = {
        "settings": {
            **{k: v for k, v in job.items() if k not in ("prompts", "stop")},
            "prompts": len(setup["prompts"]),
            "threads": args.threads,
            "vllm": VLLM_REQUIREMENT,
            "rule": RULE,
        },
        "venv": venv,
    }
    for mode in MODES:
        result[f"vllm_{mode}"] = vllm_run(run_vllm(args.venv, {**job, "mode": mode}, work, env, args.timeout), args.k)
    result["eagletree_plain"] = run_eagletree(setup, args, chain=False)
    firsts = [answer[0] for answer in result["eagletree_plain"]["one_at_a_time"]["outputs"]]
    result["eagletree_chain"] = run_eagletree(setup, args, chain=True, firsts=firsts)
    if getattr(args, "planned", None) is not None:
        result["plan"] = plan_vs_engine(args.planned, result["vllm_eagle"])
    result["problems"] = evaluate(result)
    result["ok"] = not result["problems"]
    result["check_seconds"] = time.perf_counter() - started
    return result

"""The vLLM side of scripts/check_vllm.py: one engine run, in vLLM's venv, on the job file it is given.

    .venv-vllm/bin/python scripts/engines/vllm_worker.py JOB.json

It imports the standard library and vLLM only, and none of this folder's modules: it runs in vLLM's venv (made
by `vllm_venv.ensure_venv`) with no paths of this project. vLLM's `LLM` plain or with the export as drafter, one
warm-up answer, then each prompt alone and all in one batch, at temperature 0, with vLLM's speculative-decoding
counters around each run; the results go to the job's "out".
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _spec_counters(llm) -> dict | None:
    """vLLM's cumulative speculative-decoding counters (None without a drafter)."""
    found = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            found[name] = found.get(name, 0) + int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            old = found.get(name, [0] * len(metric.values))
            found[name] = [a + int(b) for a, b in zip(old, metric.values)]
    return found or None


def _counter_delta(before: dict | None, after: dict | None) -> dict | None:
    if after is None:
        return None
    before = before or {}
    delta = {}
    for key, value in after.items():
        old = before.get(key, [0] * len(value) if isinstance(value, list) else 0)
        delta[key] = [a - b for a, b in zip(value, old)] if isinstance(value, list) else value - old
    return delta


def _timed_generate(llm, prompts, params, one_at_a_time: bool) -> dict:
    """Greedy answers (token ids) and tokens/s, each prompt alone or all in one `generate` call."""
    start = time.perf_counter()
    if one_at_a_time:
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    new = sum(len(i) for i in ids)
    return {"outputs": ids, "seconds": seconds, "new_tokens": new, "tokens_per_s": new / seconds}


def worker(job_path: str) -> None:
    """In the vLLM venv: one engine (plain or with the EAGLE export), one warm-up answer, then the timed runs."""
    from vllm import LLM, SamplingParams

    job = json.loads(Path(job_path).read_text())
    start_with = job["start"] if job["mode"] == "eagle" else {"model": job["target"], "speculative_config": None}
    start = time.perf_counter()
    llm = LLM(
        model=start_with["model"],
        speculative_config=start_with["speculative_config"],
        dtype="float32",
        seed=0,
        max_model_len=job["max_model_len"],
        enable_prefix_caching=False,  # eagletree has none: every prompt is prefilled in full by both
        disable_log_stats=False,  # the spec-decode counters
    )
    init = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["stop"])
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    before = _spec_counters(llm)
    one = _timed_generate(llm, prompts, params, one_at_a_time=True)
    middle = _spec_counters(llm)
    batched = _timed_generate(llm, prompts, params, one_at_a_time=False)
    one["spec"], batched["spec"] = _counter_delta(before, middle), _counter_delta(middle, _spec_counters(llm))
    Path(job["out"]).write_text(json.dumps({"init_seconds": init, "one_at_a_time": one, "batched": batched}))


if __name__ == "__main__":  # (vLLM starts its engine in a spawned process, which imports this file again)
    # this folder's modules must not shadow what vLLM imports (sys.path[0] is the script's folder)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    if len(sys.argv) != 2:
        raise SystemExit("usage: vllm_worker.py JOB.json")
    worker(sys.argv[1])

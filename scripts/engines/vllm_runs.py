"""vLLM's runs for scripts/check_vllm.py: how vLLM starts with an export, one worker run in vLLM's venv
(`vllm_worker.py`, in a subprocess), and its results in the shape of eagletree's runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from .metrics import acceptance, vllm_counts

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
MODES = ("plain", "eagle")  # vLLM's runs: the target alone, and with the export as drafter


def export_kind(config: dict) -> str:
    """What an export's config.json is to vLLM: "speculators" (a speculators_config: `LLM(model=EXPORT)`), "dflash"
    (a DFlashDraftModel checkpoint for method "dflash"), "eagle3" (an EAGLE-3 head for method "eagle3") or "eagle"
    (an EAGLE-1/2 head for method "eagle")."""
    if config.get("speculators_config") is not None:
        return "speculators"
    if isinstance(config.get("dflash_config"), dict):
        return "dflash"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) or "draft_vocab_size" in config:
        return "eagle3"
    return "eagle"


def vllm_start(kind: str, export: str, target_folder: str, k: int, config: dict) -> dict:
    """How vLLM's `LLM` starts with the export as a drafter of k tokens: its `model` and `speculative_config`.

    A speculators export starts alone: vLLM serves the verifier its config names (ValueError unless that is the
    target's folder) and drafts its proposal's speculative_tokens, overridden here only where those are not k."""
    if kind in ("eagle", "eagle3", "dflash"):
        return {
            "model": target_folder,
            "speculative_config": {"method": kind, "model": export, "num_speculative_tokens": k},
        }
    if kind != "speculators":
        raise ValueError(f"export kind {kind!r} is not one of ('eagle', 'eagle3', 'dflash', 'speculators')")
    spec = config["speculators_config"]
    verifier = str(spec["verifier"]["name_or_path"])
    if Path(verifier).expanduser().resolve() != Path(target_folder).resolve():
        raise ValueError(
            f"the speculators export {export!r} names the verifier {verifier!r}, but --target is the folder "
            f"{target_folder!r}: vLLM would serve another target (export it again with this --target)"
        )
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    return {"model": export, "speculative_config": None if tokens == k else {"num_speculative_tokens": k}}


def run_vllm(venv: Path, job: dict, work: Path, env: dict, timeout: int) -> dict:
    """One worker run in the vLLM venv (`vllm_worker.py`); its results, or exit with vLLM's last error line."""
    mode = job["mode"]
    job_path, log_path = work / f"vllm-{mode}.json", work / f"vllm-{mode}.log"
    job_path.write_text(json.dumps({**job, "out": str(work / f"vllm-{mode}-result.json")}))
    print(f"vllm {mode}: starting (log: {log_path})", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            run = subprocess.run(
                [str(venv / "bin" / "python"), str(WORKER), str(job_path)],
                cwd=work,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise SystemExit(f"error: vLLM ({mode}) did not finish in {timeout} s; its log: {log_path}") from None
    if run.returncode != 0:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        sys.stderr.write("\n".join(lines[-15:]) + "\n")
        last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "no output")
        raise SystemExit(f"error: vLLM ({mode}) failed (exit {run.returncode}): {last.strip()}")
    result = json.loads(Path(job_path.parent / f"vllm-{mode}-result.json").read_text())
    result["wall_seconds"] = time.perf_counter() - start
    print(f"vllm {mode}: done in {result['wall_seconds']:.0f} s (engine start {result['init_seconds']:.0f} s)")
    return result


def vllm_run(raw: dict, k: int) -> dict:
    """A worker's results in the shape of eagletree's runs (acceptance from the one-at-a-time run's counters)."""
    run = {key: raw[key] for key in ("one_at_a_time", "batched", "init_seconds", "wall_seconds")}
    spec = raw["one_at_a_time"].get("spec")
    if spec is not None:
        per_pos = spec.get("num_accepted_tokens_per_pos") or [0] * k
        run["acceptance"] = acceptance(vllm_counts(spec.get("num_drafts", 0), per_pos))
    return run

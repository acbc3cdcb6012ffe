"""Feature caching by transformers against vLLM, side by side: tokens/s, wall time and disk bytes per token.

    python benchmarks/features_engines.py --conversations 48 --rounds 2 --head-type eagle3 --dtype fp32

Runs `eagletree features` on the same ShareGPT training conversations with --engine hf (this venv) and
--engine vllm (vLLM's venv, .venv-vllm: scripts/engines/vllm_venv.py makes it), alternating engines per round into
fresh folders; prints each engine's feature tokens/s (the engine's start left out: the `this_run` figure the command
prints), its wall seconds (Python start, target or vLLM start included), the cache's bytes on disk per token, and the
ratio vLLM / hf per round. Run it with nothing else on the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from engines.vllm_venv import ensure_venv  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=48, help="ShareGPT training conversations")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--head-type", default="eagle3", help="whose features: eagle, eagle3, medusa or dflash")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the target's and the cache's")
    ap.add_argument("--shard-size", type=int, default=16)
    ap.add_argument("--target", default="smollm2-135m")
    args = ap.parse_args(argv)
    for name in ("conversations", "rounds", "shard_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def write_inputs(args, work: Path) -> Path:
    """A config over a JSONL file of the conversations and the target's folder (so vLLM's venv needs neither
    the dataset's nor the target's package)."""
    from eagletree.target import resolve_target
    from eagletree.train.config import TrainConfig
    from eagletree.train.inputs import training_conversations

    convs = training_conversations(TrainConfig(dataset="sharegpt", max_conversations=args.conversations))
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in convs))
    keys = {"target": str(resolve_target(args.target)), "dataset": str(data), "head_type": args.head_type}
    keys |= {"max_len": 512, "long": "truncate", "heldout_fraction": 0.01}
    keys |= {"precision": args.dtype, "feature_dtype": args.dtype}
    config = work / "cfg.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in keys.items()))
    return config


def run_engine(python: Path, engine: str, config: Path, out: Path, shard_size: int) -> dict:
    """One `eagletree features` run: its JSON line, wall seconds and bytes on disk."""
    start = time.perf_counter()
    run = subprocess.run(
        [str(python), "-m", "eagletree.cli", "features", "--config", str(config), "--engine", engine]
        + ["--shard-size", str(shard_size), f"features_dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    if run.returncode != 0:
        raise SystemExit(f"error: features --engine {engine} failed: {run.stderr.strip().splitlines()[-1:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - start
    result["bytes"] = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    venv = ROOT / ".venv-vllm"
    ensure_venv(venv)
    pythons = {"hf": Path(sys.executable), "vllm": venv / "bin" / "python"}
    with tempfile.TemporaryDirectory(prefix="features-engines-") as tmp:
        work = Path(tmp)
        config = write_inputs(args, work)
        rows = []
        for r in range(args.rounds):
            order = ("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")
            got = {e: run_engine(pythons[e], e, config, work / f"{e}-{r}", args.shard_size) for e in order}
            rows.append(got)
    tokens = rows[0]["hf"]["tokens"]
    print(
        f"{args.conversations} conversations, {tokens} tokens, {args.head_type} features in {args.dtype}, "
        f"{args.rounds} rounds, threads {os.environ.get('OMP_NUM_THREADS', 'default')}"
    )
    print("| round | hf tokens/s | vllm tokens/s | vllm / hf | hf wall s | vllm wall s |\n|---|---|---|---|---|---|")
    rates = {e: [] for e in pythons}
    for r, got in enumerate(rows):
        for e in pythons:
            rates[e].append(got[e]["this_run"]["tokens"] / got[e]["this_run"]["seconds"])
        print(
            f"| {r + 1} | {rates['hf'][-1]:.0f} | {rates['vllm'][-1]:.0f} | {rates['vllm'][-1] / rates['hf'][-1]:.2f}x "
            f"| {got['hf']['wall_s']:.1f} | {got['vllm']['wall_s']:.1f} |"
        )
    ratio = statistics.median(v / h for v, h in zip(rates["vllm"], rates["hf"]))
    print(f"median vllm / hf: {ratio:.2f}x; disk: {rows[0]['hf']['bytes'] / tokens:.0f} bytes per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())

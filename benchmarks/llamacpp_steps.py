"""What a drafted step costs in llama.cpp: `llama-server` plain and with a head's GGUF export at several chain
lengths k, side by side in one run, on MT-bench first turns (one at a time, greedy).

    .venv/bin/python benchmarks/llamacpp_steps.py --head runs/smollm2-135m-eagle3/head --k 1 2 3
    .venv/bin/python benchmarks/llamacpp_steps.py --head runs/smollm2-135m-dflash/head --k 1 3 7 --prompts 8
    .venv/bin/python benchmarks/llamacpp_steps.py --head DIR --k 1 --server-args="--poll 0"   # flags for every run

llama.cpp as scripts/check_llamacpp.py builds it (.llama-cpp/, or LLAMA_SERVER). Per setting: tokens/s of the answers
(llama.cpp's own timings, prefill left out), drafting steps (its draft_n / k: it drafts k every step), tokens per step
and ms per step, against ms per token plain; runs alternate plain / drafted per round and the medians are printed.
Measure it alone: llama.cpp's spinning threads collapse under any other load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
from engines import llamacpp_build, llamacpp_runs  # noqa: E402

SPEC_TYPES = {"dflash": "draft-dflash", "eagle3": "draft-eagle3"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--server-args", default="", help="more llama-server flags for every run (plain too)")
    ap.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32", help="the head's GGUF export")
    return ap.parse_args(argv)


def measure(server, prompts, n) -> dict:
    """Tokens, decode seconds, drafted and accepted counts over the prompts."""
    tokens = seconds = drafted = accepted = 0
    for ids in prompts:
        t = server.complete(ids, n)["timings"]
        tokens, seconds = tokens + t["predicted_n"], seconds + t["predicted_ms"] / 1000
        drafted, accepted = drafted + t.get("draft_n", 0), accepted + t.get("draft_n_accepted", 0)
    return {"tokens": tokens, "seconds": seconds, "drafted": drafted, "accepted": accepted}


def main(argv=None) -> None:
    import torch

    from eagletree.export.convert import export_head

    args = parse_args(argv)
    binary = llamacpp_build.server()
    target, _, head, prompts, model = llamacpp_runs.target_and_head(args.target, args.head, args.prompts)
    runs = {"plain": []} | {k: [] for k in args.k}
    flags = args.server_args.split()
    with tempfile.TemporaryDirectory() as tmp:
        dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
        export = export_head(head, Path(tmp) / "export", "gguf", dtype=dtype, target=target) / "model.gguf"
        for _ in range(args.rounds):
            for setting in runs:
                extra = [] if setting == "plain" else ["-md", str(export), "--spec-type", SPEC_TYPES[head.head_type]]
                extra += [] if setting == "plain" else ["--spec-draft-n-max", str(setting)]
                with llamacpp_runs.Server(binary, model, Path(tmp) / "server.log", args.threads, extra + flags) as s:
                    runs[setting].append(measure(s, prompts, args.max_new_tokens))
    plain_ms = statistics.median(r["seconds"] / r["tokens"] for r in runs["plain"]) * 1e3
    print(f"llama.cpp {binary}, {args.prompts} MT-bench prompts x {args.max_new_tokens} tokens, {args.threads} threads")
    print(f"server flags: {' '.join(flags) or '(none)'}; the head exported in {args.dtype}")
    print(f"plain: {1e3 / plain_ms:.1f} tokens/s, {plain_ms:.1f} ms a token")
    for k in args.k:
        rate = statistics.median(r["tokens"] / r["seconds"] for r in runs[k])
        steps = statistics.median(r["drafted"] / k for r in runs[k])
        step_ms = statistics.median(r["seconds"] / max(r["drafted"] / k, 1) for r in runs[k]) * 1e3
        per_step = statistics.median(1 + r["accepted"] / max(r["drafted"] / k, 1) for r in runs[k])
        print(
            f"k={k}: {rate:.1f} tokens/s ({rate * plain_ms / 1e3:.2f}x plain), {steps:.0f} drafted steps, "
            f"{per_step:.2f} tokens a step, {step_ms:.1f} ms a step = {step_ms / plain_ms:.2f} plain tokens"
        )


if __name__ == "__main__":
    main()

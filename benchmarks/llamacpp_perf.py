"""Where a llama.cpp step's time goes: `perf record` on `llama-server` decoding MT-bench first turns plain and with a
head's GGUF export (chain of k), each profile's samples grouped by what the code does, as ms per plain token and per
drafted step.

    .venv/bin/python benchmarks/llamacpp_perf.py --head runs/smollm2-135m-eagle3/head --k 1
    .venv/bin/python benchmarks/llamacpp_perf.py --head DIR --k 1 --top 25        # and the top symbols of each run

Needs Linux `perf` (user-space samples of one's own processes: kernel.perf_event_paranoid <= 2) and llama.cpp as
scripts/check_llamacpp.py builds it (.llama-cpp/, or LLAMA_SERVER). Samples are taken on every thread of the server
at 999 Hz; a group's ms per token (or step) is its share of the samples times the CPU time the decoding took on all
threads, so spinning worker threads show as `threads: wait and sync`. Measure it alone.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
from engines import llamacpp_build, llamacpp_runs  # noqa: E402

SPEC_TYPES = {"dflash": "draft-dflash", "eagle3": "draft-eagle3"}
# (group, symbol pattern), first match wins
GROUPS = (
    ("matrix products", r"vec_dot|gemv|gemm|mul_mat|quantize_row|repack|amx|sgemm|tinyblas"),
    ("threads: wait and sync", r"barrier|sched_yield|futex|graph_compute_thread|_spin|pthread_cond|sem_wait|usleep"),
    ("other tensor ops", r"ggml_compute_forward|ggml_vec_|rope|soft_max|rms_norm|get_rows|ggml_fp16|ggml_cpu_"),
    ("graph build and scheduling", r"gallocr|backend_sched|ggml_new_tensor|ggml_graph|llm_build|graph_|hash|build_"),
    ("sampling", r"sampler|sample|sort|softmax|top_k|heap"),
    ("memory copies", r"memcpy|memmove|memset|__memcpy|copy"),
    ("kv cache", r"kv_cache|memory_seq|seq_rm|kv_self|llama_kv"),
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, required=True)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=0, help="also print each run's top symbols")
    return ap.parse_args(argv)


def group_of(symbol: str) -> str:
    return next((name for name, pattern in GROUPS if re.search(pattern, symbol)), "other")


def report(data: Path) -> list[tuple[float, str, str]]:
    """(percent, dso, symbol) of every sampled symbol, from `perf report`."""
    out = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "--stdio", "-q", "-g", "none"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3).strip()))
    return rows


def profiled(server, prompts, n, data: Path) -> tuple[dict, float]:
    """Totals of decoding `prompts` while perf samples the server, and the server's CPU seconds meanwhile."""
    cpu = lambda: sum(map(int, Path(f"/proc/{server.proc.pid}/stat").read_text().split()[13:15])) / 100  # noqa: E731
    perf = subprocess.Popen(
        ["perf", "record", "-F", "999", "-p", str(server.proc.pid), "-o", str(data), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # perf attached
    before = cpu()
    totals = llamacpp_runs.totals(server, prompts, n)
    used = cpu() - before
    perf.send_signal(signal.SIGINT)
    perf.wait(timeout=60)
    return totals, used


def main(argv=None) -> None:
    import torch

    from eagletree.export.convert import export_head

    args = parse_args(argv)
    binary = llamacpp_build.server()
    target, _, head, prompts, model = llamacpp_runs.target_and_head(args.target, args.head, args.prompts)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        export = export_head(head, Path(tmp) / "export", "gguf", dtype=torch.float32, target=target) / "model.gguf"
        drafted = ["-md", str(export), "--spec-type", SPEC_TYPES[head.head_type], "--spec-draft-n-max", str(args.k)]
        for name, extra in (("plain", []), (f"k={args.k}", drafted)):
            with llamacpp_runs.Server(binary, model, Path(tmp) / "server.log", args.threads, extra) as s:
                llamacpp_runs.totals(s, prompts[:1], 16)  # warm-up
                totals, cpu_s = profiled(s, prompts, args.max_new_tokens, Path(tmp) / f"{name}.data")
            results[name] = (totals, cpu_s, report(Path(tmp) / f"{name}.data"))
    print(f"llama.cpp {binary}; {args.prompts} MT-bench prompts x {args.max_new_tokens} tokens, {args.threads} threads")
    units = {}
    for name, (totals, cpu_s, _) in results.items():
        per = totals["tokens"] if name == "plain" else totals["steps"]
        units[name] = cpu_s * 1e3 / per  # CPU ms (all threads) per plain token or per drafted step
        unit = "token" if name == "plain" else "step"
        print(f"{name}: {totals['ms'] / per:.2f} ms a {unit} ({units[name]:.2f} CPU ms on all threads)")
    groups = [g for g, _ in GROUPS] + ["other"]
    print(f"{'CPU ms':>28} " + " ".join(f"{name:>10}" for name in results) + "  difference")
    for g in groups:
        ms = [units[name] * sum(p for p, _, s in results[name][2] if group_of(s) == g) / 100 for name in results]
        print(f"{g:>28} " + " ".join(f"{v:>10.2f}" for v in ms) + f"  {ms[-1] - ms[0]:+10.2f}")
    for name, (_, _, rows) in results.items():
        for pct, dso, sym in rows[: args.top]:
            print(f"  {name}: {pct:5.2f}%  {dso:<28} {sym[:90]}")


if __name__ == "__main__":
    main()

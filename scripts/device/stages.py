"""The stages of the GPU run; run.py starts each as its own process: `stages.py NAME --work W --out O [--dry-run]`.

Every stage reads only the unpacked folder W (the GGUF file, the pre-tokenized data, MT-bench's
questions, the carried gguf package) and the repository, writes its results under O when it ends
(results.json, a short summary.txt) and imports optional packages only where it needs them.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(HERE), str(REPO)]

SHIPPED_HEAD = REPO / "eagletree" / "heads" / "smollm2-135m"
TRAIN_CONFIG = REPO / "configs" / "smollm2-135m-eagle.yaml"
PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "numpy",
    "safetensors",
    "yaml",
    "tqdm",
    "tokenizers",
    "jinja2",
    "huggingface_hub",
    "gguf",
    "scipy",
    "matplotlib",
    "datasets",
    "wandb",
    "pytest",
)


def write(out: Path, results: dict, summary: list[str]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary), flush=True)


def gguf_file(work: Path) -> Path:
    files = sorted((work / "model").glob("*.gguf"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one .gguf file in {work / 'model'}, found {[f.name for f in files]}")
    return files[0]


def device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def stage_env(args) -> int:
    """What imports here and what the machine is."""
    import importlib

    found = {}
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
            found[name] = getattr(module, "__version__", "?") + f" ({Path(module.__file__).parent})"
        except Exception as e:  # report every kind of failure: this stage only looks
            found[name] = f"missing: {type(e).__name__}: {e}".splitlines()[0]
    import os

    import torch

    info = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": found,
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name,
            capability=f"{p.major}.{p.minor}",
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            cuda_version=torch.version.cuda,
            bf16=torch.cuda.is_bf16_supported(),
        )
    summary = [
        f"python {info['python']}, {info['cpus']} CPUs, "
        + (f"{info['gpu']} ({info['gpu_memory_gib']} GiB, CUDA {info['cuda_version']})" if info["cuda"] else "no CUDA")
    ]
    summary += [f"  {k}: {v}" for k, v in found.items()]
    write(args.out, info, summary)
    return 0


def stage_checks(args) -> int:
    """Greedy == HF generate (fp32, bf16), sampled chi-square, tree pass == path forwards, on the device."""
    import checks
    import torch

    dev, dry = device(), args.dry_run
    results, summary = {}, []
    greedy = {"prompts": 1, "max_new": 8, "kinds": ("llama",)} if dry else {"prompts": 4, "max_new": 40}
    trees = {"sizes": (1, 9), "kinds": ("qwen2",)} if dry else {}
    todo = [
        ("greedy_fp32", lambda: checks.greedy_check(dev, torch.float32, **greedy)),
        ("greedy_bf16", lambda: checks.greedy_check(dev, torch.bfloat16, **greedy)),
        ("sampled_T1", lambda: checks.sampled_check(dev, draws=300 if dry else 20_000, max_seconds=10)),
        (
            "sampled_T0.7_top_p0.9",
            lambda: checks.sampled_check(dev, draws=300 if dry else 20_000, temperature=0.7, top_p=0.9, max_seconds=5),
        ),
        ("tree_pass_fp32", lambda: checks.tree_pass_check(dev, torch.float32, **trees)),
        ("tree_pass_bf16", lambda: checks.tree_pass_check(dev, torch.bfloat16, **trees)),
    ]
    for name, run in todo:
        t0 = time.perf_counter()
        try:
            results[name] = run()
        except Exception as e:  # one failing check must not hide the others' results
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        results[name]["seconds"] = round(time.perf_counter() - t0, 1)
        r = results[name]
        detail = r.get("error") or ", ".join(
            f"{k}={v}" for k, v in r.items() if k not in ("ok", "device", "seconds") and not isinstance(v, list)
        ) + (f", near-ties {len(r['near_ties'])}, wrong {len(r['wrong'])}" if "wrong" in r else "")
        summary.append(f"{name} on {dev}: {'ok' if r['ok'] else 'FAILED'} ({r['seconds']} s): {detail}")
        write(args.out, results, summary)  # after every check: a time-out keeps the finished ones
    return 0 if all(r["ok"] for r in results.values()) else 1


def stage_profile(args) -> int:
    """`eagletree profile` with the llama-3.1-8b config (random bf16 weights)."""
    from eagletree.cli import main

    if args.dry_run:
        config = args.out / "tiny-config.json"
        config.write_text(
            json.dumps(
                {
                    "model_type": "llama",
                    "vocab_size": 128,
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 512,
                }
            )
        )
        argv = ["--config", str(config), "--sizes", "1,2,4", "--reps", "1", "--prefix", "16"]
    else:
        argv = ["--config", "llama-3.1-8b", "--sizes", "1,2,4,8,16,32,48,64,96,128,192,256", "--reps", "10"]
    rc = main(["profile", "-o", str(args.out)] + argv)
    profile = args.out / "profile.json"
    if rc == 0 and profile.is_file():
        rows = json.loads(profile.read_text())["rows"]
        at = {r["n"]: r for r in rows}
        n = 64 if 64 in at else max(at)
        (args.out / "summary.txt").write_text(
            f"t({n})/t(1) = {at[n]['ratio']:.2f}, engine overhead {at[n]['overhead']:.1%} of a pass, "
            f"t(1) = {at[1]['forward_ms']:.2f} ms, head call {at[n]['draft_level_ms']:.2f} ms\n"
        )
    return rc


def _mtbench(work: Path, n: int):
    from eagletree.prompts import mtbench_subset

    return [q.messages() for q in mtbench_subset(n, work / "data" / "mtbench.jsonl")]


def stage_smollm2(args) -> int:
    """SmolLM2 on the device: eagletree eagle2 and auto vs HF generate on MT-bench prompts, outputs compared."""

    from eagletree.bench import BenchSettings, machine_info, markdown_report, method_grid, run_bench
    from eagletree.draft import load_head
    from eagletree.loading import draft_vocab_for
    from eagletree.target import load_target

    dry = args.dry_run
    t0 = time.perf_counter()
    model, tok = load_target(gguf_file(args.work), device=device())  # bf16 on CUDA, fp32 on CPU
    head = load_head(SHIPPED_HEAD, target_config=model.config, device=model.device, dtype=model.dtype)
    if draft_vocab_for("auto", model) == "full" and head.can_widen_vocab():  # as the CLI drafts on a GPU
        head.widen_vocab()
    load_s = time.perf_counter() - t0
    budget = 8 if dry or model.device.type == "cpu" else 60
    if dry:  # `auto` measures its latency profile once; a rehearsal measures two small sizes, not the real ones
        import eagletree.verify.profile as verify_profile

        measure = verify_profile.measure_verify
        verify_profile.measure_verify = lambda target, **kw: measure(
            target, **(kw | dict(sizes=(1, 8), prefix=16, reps=1))
        )
    methods = method_grid(["eagle2", "auto"], [budget])
    prompts = _mtbench(args.work, 1 if dry else 8)  # one per category
    report = run_bench(
        model,
        tok,
        head,
        prompts,
        methods,
        BenchSettings(temperatures=(0.0,), max_new_tokens=6 if dry else 128),
        progress=False,
        log=lambda s: print(s, flush=True),
    )
    report.update(
        command="scripts/device/stages.py smollm2",
        machine=machine_info(model),
        load_s=load_s,
        plots=[],
        settings={
            "target": "smollm2-135m (the carried GGUF)",
            "head": str(SHIPPED_HEAD.relative_to(REPO)),
            "prompts": f"mtbench:{len(prompts)}",
            "packed": False,
            "head_dtype": str(model.dtype).removeprefix("torch."),
            "draft_vocab": head.config.draft_vocab_size or "full",
            "budgets": [budget],
            "depth": 6,
            "top_k_draft": 10,
            "methods": [m.label for m in methods],
        },
    )
    (args.out / "results.md").write_text(markdown_report(report))
    greedy = [r for r in report["results"] if not r["temperature"]]
    summary = [
        f"SmolLM2 {report['machine']['dtype']} on {report['machine']['device']}, {len(prompts)} MT-bench prompts x "
        f"{report['max_new_tokens']} tokens, budget {budget}:"
    ]
    for r in report["results"]:
        summary.append(
            f"  T={r['temperature']:g} {r['method']}: {r['tokens_per_pass']:.2f} tokens/pass, "
            f"{r['tokens_per_s'] or 0:.1f} tokens/s, speedup {(r['speedup'] or {}).get('median') or 0:.2f}x"
            + ("" if r["temperature"] else f", identical to plain {r['identical']}")
        )
    write(args.out, report, summary)
    return 0 if all(r["identical"] in (True, None) or r["method"] == "plain" for r in greedy) else 1


def stage_train(args) -> int:
    """Train a head on all the carried data for the time left, then its MT-bench tokens/pass against the shipped
    head."""
    import torch

    from eagletree.target import load_target

    t_start = time.perf_counter()
    dev = device()
    model, tok = load_target(
        gguf_file(args.work), device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32
    )
    records, sources = _pretokenized_records(args.work, tok)
    cfg, steps, per_step, train_s, summary_ = _train_for_time_left(args, t_start, dev, model, tok, records)
    micro = steps * cfg.grad_accum
    results = {
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "data": sources,
        "conversations": len(records),
        "trial_s_per_step": per_step,
        "steps": steps,
        "grad_accum": cfg.grad_accum,
        "epochs": micro / len(records),
        "train_s": train_s,
        "s_per_step": train_s / steps,
        "summary": summary_,
        "config": str(TRAIN_CONFIG.relative_to(REPO)),
    }
    summary = [
        f"trained {steps} steps x {cfg.grad_accum} conversations in {train_s:.0f} s ({micro / len(records):.2f} "
        f"epochs of {len(records)}; {summary_['tokens']} assistant tokens), final loss "
        f"{summary_['final']['loss']:.3f}, acc {summary_['final']['acc']:.3f}"
    ]
    write(args.out, results, summary)
    results["mtbench"], line = _compare_heads_on_mtbench(args, dev, model, tok)
    summary.append(line)
    write(args.out, results, summary)
    return 0


def _pretokenized_records(work: Path, tok):
    """All the carried pre-tokenized conversations, and each source's header figures."""
    from eagletree.train import pretokenized

    records, sources = [], {}
    for name in ("sharegpt", "distill"):
        path = work / "data" / f"{name}.npz"
        if path.is_file():
            part, header = pretokenized.load(path, tok)
            records += part
            sources[name] = {k: header[k] for k in ("records", "tokens", "assistant_tokens", "truncated", "max_len")}
    if not records:
        raise FileNotFoundError(f"no pre-tokenized data in {work / 'data'}")
    return records, sources


def _train_for_time_left(args, t_start: float, dev, model, tok, records):
    """A short trial run times a step, then the real run takes the steps that fit the time left; the head is
    shipped to O/head. Returns (config, steps, trial seconds per step, training seconds, training summary)."""
    from eagletree.train.evaluate import ship
    from eagletree.train.loop import TrainConfig, train

    dry = args.dry_run
    work = args.work / "train"
    base = ["report_to=none", "device=" + dev.type, "save_every=1000000", "keep_checkpoints=1"]
    base += ["max_len=64", "grad_accum=1", "draft_vocab=256", "draft_vocab_sample=8", "warmup_steps=1"] if dry else []
    eval_reserve = 12 if dry else 50  # seconds kept for the two heads' tokens/pass
    trial_steps = 1 if dry else 20
    cfg = TrainConfig.from_sources(TRAIN_CONFIG, base + [f"out_dir={work / 'trial'}", f"steps={trial_steps}"])
    t0 = time.perf_counter()
    train(cfg, model_and_tokenizer=(model, tok), conversations=records, progress=False)
    per_step = (time.perf_counter() - t0) / trial_steps
    left = args.limit - (time.perf_counter() - t_start) - eval_reserve
    steps = max(1, int(left / per_step)) if not dry else 2
    cfg = TrainConfig.from_sources(TRAIN_CONFIG, base + [f"out_dir={work / 'run'}", f"steps={steps}"])
    t0 = time.perf_counter()
    _, summary_ = train(cfg, model_and_tokenizer=(model, tok), conversations=records, progress=False)
    train_s = time.perf_counter() - t0
    ship(cfg.out_dir, args.out / "head")  # bf16, as the shipped head
    (args.out / "history.jsonl").write_text((Path(cfg.out_dir) / "history.jsonl").read_text())
    return cfg, steps, per_step, train_s, summary_


def _compare_heads_on_mtbench(args, dev, model, tok):
    """Tokens/pass of the new head and the shipped one on the same MT-bench prompts, prompt by prompt (paired).
    Returns the results entry and its summary line."""
    from eagletree.draft import load_head
    from eagletree.train.evaluate import tokens_per_pass

    dry = args.dry_run
    eval_n, eval_tokens = (1, 6) if dry else (8, 128)
    prompts = _mtbench(args.work, eval_n)
    options = dict(max_new_tokens=eval_tokens, tree="eagle2", budget=8 if dry else 60, depth=6, top_k_draft=10)
    heads = {
        "trained": load_head(args.out / "head", target_config=model.config, device=dev, dtype=model.dtype),
        "shipped": load_head(SHIPPED_HEAD, target_config=model.config, device=dev, dtype=model.dtype),
    }
    per_prompt = {name: [tokens_per_pass(h, model, tok, [p], **options) for p in prompts] for name, h in heads.items()}
    m = {
        name: {
            "tokens_per_pass": sum(r["new_tokens"] for r in rows) / sum(r["passes"] for r in rows),
            "passes": [r["passes"] for r in rows],
            "new_tokens": [r["new_tokens"] for r in rows],
        }
        for name, rows in per_prompt.items()
    }
    m.update(prompts=len(prompts), **options)
    line = (
        f"MT-bench ({len(prompts)} prompts x {eval_tokens} tokens, EAGLE-2 {options['budget']} nodes): "
        f"trained head {m['trained']['tokens_per_pass']:.2f} tokens/pass, shipped head "
        f"{m['shipped']['tokens_per_pass']:.2f}"
    )
    return m, line


STAGES = {
    "env": stage_env,
    "checks": stage_checks,
    "profile": stage_profile,
    "smollm2": stage_smollm2,
    "train": stage_train,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("stage", choices=sorted(STAGES))
    p.add_argument("--work", type=Path, required=True, help="the unpacked pieces")
    p.add_argument("--out", type=Path, required=True, help="this stage's results folder")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--limit", type=float, default=600.0, help="seconds this stage has (the train stage fills them)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return STAGES[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())

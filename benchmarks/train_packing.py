"""Training tokens/s with packed micro-batches against one conversation per micro-batch, every head kind, the real
target and data, side by side in one run.

    .venv/bin/python benchmarks/train_packing.py                                 # eagle eagle3 medusa dflash, online
    .venv/bin/python benchmarks/train_packing.py --kinds eagle --micro-batch 8 --steps 4 --rounds 3
    .venv/bin/python benchmarks/train_packing.py --offline                       # from cached features instead

Each head kind trains from its shipped recipe (`configs/smollm2-135m-<kind>.yaml`, medusa from the eagle one) for
`--steps` optimizer steps of the same global batch, `--global-batch` conversations: grad_accum = global batch and
micro_batch 1 (today's loop), against grad_accum = global batch / m and micro_batch m. Runs alternate A, B per
round; the rate is the run's assistant (loss) tokens over its steps' wall time, from its own history record.
Also printed: where one conversation's time goes (the target's pass, the head's forward and backward), measured
on its own before the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eagletree.target import load_target  # noqa: E402
from eagletree.train.config import TrainConfig, resolve_precision  # noqa: E402
from eagletree.train.features import cache_features  # noqa: E402
from eagletree.train.inputs import training_conversations  # noqa: E402
from eagletree.train.loop import train  # noqa: E402

RECIPES = {
    "eagle": ("smollm2-135m-eagle.yaml", {}),
    "eagle3": ("smollm2-135m-eagle3.yaml", {}),
    "medusa": ("smollm2-135m-eagle.yaml", {"head_type": "medusa"}),
    "dflash": ("smollm2-135m-dflash.yaml", {}),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--micro-batch", type=int, default=4, help="conversations per packed micro-batch")
    ap.add_argument("--global-batch", type=int, default=8, help="conversations per optimizer step (both runs)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=200, help="training conversations the runs draw from")
    ap.add_argument("--offline", action="store_true", help="train from cached features (cached first, not timed)")
    args = ap.parse_args(argv)
    if args.global_batch % args.micro_batch:
        ap.error(f"--global-batch {args.global_batch} must be a multiple of --micro-batch {args.micro_batch}")
    if args.steps < 1 or args.rounds < 1:
        ap.error(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
    return args


def config(kind: str, out: Path, args, micro: int, features_dir: str = "") -> TrainConfig:
    recipe, more = RECIPES[kind]
    overrides = more | {
        "out_dir": str(out),
        "report_to": "none",
        "steps": args.steps,
        "save_every": args.steps,
        "warmup_steps": 1,
        "max_conversations": args.conversations,
        "grad_accum": args.global_batch // micro,
        "micro_batch": micro,
        "features_dir": features_dir,
    }
    return TrainConfig.from_sources(ROOT / "configs" / recipe, [f"{k}={v}" for k, v in overrides.items()])


def timed_run(cfg: TrainConfig, target) -> float:
    """Loss tokens per second of the run's steps (its last history record: counted from its first step on)."""
    train(cfg, model_and_tokenizer=target, progress=False, overwrite=True)
    records = [json.loads(line) for line in (Path(cfg.out_dir) / "history.jsonl").read_text().splitlines()]
    return records[-1]["tokens_per_s"]


def split(kind: str, cfg: TrainConfig, target) -> str:
    """Where one conversation's micro-batch goes: the target's pass, the head's objective forward and backward."""
    from eagletree.draft import head_class
    from eagletree.train.render import render_item

    model, tok = target
    convs = training_conversations(cfg)[:6]
    head = head_class(cfg.head_type).create(model, cfg, torch.arange(cfg.draft_vocab or model.config.vocab_size))
    head.train()
    lm = (model.get_output_embeddings().weight.detach()[head.d2t], None)
    embed = model.get_input_embeddings()
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=next(model.parameters()).dtype == torch.bfloat16)
    t_target = t_head = 0.0
    for i, conv in enumerate(convs):
        r = render_item(tok, conv, cfg.max_len)
        t0 = time.perf_counter()
        with torch.no_grad():
            feats = head.target_features(model, r.input_ids)
        t1 = time.perf_counter()
        with amp:
            result = head.training_loss(head, lm, embed, feats.float(), r.input_ids, r.loss_mask, cfg)
        if result is not None:
            result[0].backward()
        t2 = time.perf_counter()
        if i:  # the first warms the kernels
            t_target, t_head = t_target + t1 - t0, t_head + t2 - t1
    share = t_target / (t_target + t_head)
    ms = f"target pass {t_target / 5 * 1e3:.0f} ms, head {t_head / 5 * 1e3:.0f} ms"
    return f"{kind}: a conversation's {ms} ({share:.0%} target)"


def main(argv=None) -> None:
    args = parse_args(argv)
    precision = resolve_precision("auto", True)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    target = load_target("smollm2-135m", dtype=dtype, device="cpu")
    print(f"precision {precision}, torch threads {torch.get_num_threads()}, global batch {args.global_batch}")
    rates = {kind: {1: [], args.micro_batch: []} for kind in args.kinds}
    with tempfile.TemporaryDirectory() as tmp:
        features = {}
        for kind in args.kinds:
            cfg = config(kind, Path(tmp) / kind / "probe", args, 1)
            print(split(kind, cfg, target), flush=True)
            if args.offline:
                features[kind] = str(Path(tmp) / kind / "features")
                needed = args.global_batch * args.steps * args.rounds
                convs = training_conversations(cfg)[: max(needed, args.global_batch)]
                cache_features(
                    TrainConfig(**(vars(cfg) | {"features_dir": features[kind]})), *target, convs, progress=False
                )
        for round_ in range(args.rounds):
            for kind in args.kinds:
                for micro in (1, args.micro_batch) if round_ % 2 == 0 else (args.micro_batch, 1):
                    cfg = config(kind, Path(tmp) / kind / f"m{micro}", args, micro, features.get(kind, ""))
                    rate = timed_run(cfg, target)
                    rates[kind][micro].append(rate)
                    print(f"  round {round_ + 1} {kind} micro_batch {micro}: {rate:.0f} loss tokens/s", flush=True)
    print("\nkind     today (1 a micro-batch)  packed   ratio")
    for kind in args.kinds:
        one, packed = statistics.median(rates[kind][1]), statistics.median(rates[kind][args.micro_batch])
        print(f"{kind:8} {one:10.0f} tokens/s   {packed:8.0f}   {packed / one:.2f}x")


if __name__ == "__main__":
    main()

"""Train an EAGLE draft head: `accelerate launch train.py --config configs/NAME.yaml [key=value ...]`.

`python train.py ...` works too. `--resume` continues from the run folder's last checkpoint with
the same model, optimizer, scheduler, data order and RNG state.
"""

import argparse
import json
import sys

from eagletree.train.loop import TrainConfig, TrainingError, train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file of TrainConfig keys (see eagletree/train/loop.py)")
    ap.add_argument("--resume", action="store_true", help="continue from out_dir's last checkpoint")
    ap.add_argument("--report-to", choices=["wandb", "none"], help="shorthand for report_to=...")
    ap.add_argument("--eval", action="store_true", help="evaluate the head on held-out conversations at the end")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = ap.parse_args(argv)
    overrides = list(args.overrides) + ([f"report_to={args.report_to}"] if args.report_to else [])
    from eagletree.train.evaluate import evaluate_run, evaluation_conversations

    try:
        cfg = TrainConfig.from_sources(args.config, overrides)
        heldout = evaluation_conversations(cfg) if args.eval else None  # a bad eval_dataset fails now, not after
        head, summary = train(cfg, resume=args.resume)
        print(json.dumps(summary, default=float))
        if args.eval:
            print(json.dumps(evaluate_run(cfg, head, heldout=heldout), indent=2, default=float))
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Train an EAGLE draft head: `accelerate launch train.py --config configs/NAME.yaml [key=value ...]`.

`python train.py ...` works too. `--resume` continues from the run folder's last checkpoint with
the same model, optimizer, scheduler, data order and RNG state; Ctrl-C or SIGTERM stops after the step in
progress with a checkpoint of it (exit status 130), so `--resume` loses nothing.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from accelerate import PartialState

from eagletree.errors import EagletreeError
from eagletree.train.evaluate import evaluate_run, evaluation_conversations
from eagletree.train.loop import TrainConfig, TrainingInterrupted, train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file of TrainConfig keys (see eagletree/train/config.py)")
    ap.add_argument("--resume", action="store_true", help="continue from out_dir's last checkpoint")
    ap.add_argument("--report-to", choices=["wandb", "none"], help="shorthand for report_to=...")
    ap.add_argument("--eval", action="store_true", help="evaluate the head on held-out conversations at the end")
    ap.add_argument(
        "--allow-changes",
        action="store_true",
        help="--resume with changed run-defining keys (lr, dataset, max_len, ...): continue with the new values",
    )
    ap.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="--resume from a trainer.pt that holds Python objects (an older format, or a run folder from elsewhere): "
        "loads it with pickle, which can run any code; only for run folders you trust",
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an out_dir that holds a run: its checkpoints, head, history and metrics are deleted",
    )
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = ap.parse_args(argv)
    overrides = list(args.overrides) + ([f"report_to={args.report_to}"] if args.report_to else [])
    out_dir = None
    try:
        cfg = TrainConfig.from_sources(args.config, overrides)
        out_dir = Path(cfg.out_dir)
        existed = out_dir.exists()
        heldout = evaluation_conversations(cfg) if args.eval else None  # a bad eval_dataset fails now, not after
        head, summary = train(
            cfg,
            resume=args.resume,
            allow_changes=args.allow_changes,
            overwrite=args.overwrite,
            trust_checkpoint=args.trust_checkpoint,
        )
        if PartialState().is_main_process:  # one summary of the whole run (its counts summed over processes)
            print(json.dumps(summary, default=float))
        if args.eval and PartialState().is_main_process:  # one evaluation, not one per process
            print(json.dumps(evaluate_run(cfg, head, heldout=heldout), indent=2, default=float))
    except TrainingInterrupted as e:
        print(str(e), file=sys.stderr)
        return 130
    except (EagletreeError, ValueError, OSError) as e:
        if out_dir is not None and not existed and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a failed run leaves no empty folder it made
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """Under torchrun every process leaves its gloo group when its run ends, whatever the outcome (the group is
    not left to the interpreter's shutdown; a finished worker then ends by `_exit_worker`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _exit_worker(code: int) -> None:
    """Under torchrun, end the process without the interpreter's teardown: by now the run has written (atomically)
    and flushed everything it keeps, and torch's C++ teardown sometimes aborted a worker there after a finished run
    ("terminate called without an active exception", SIGABRT, about 1 run in 6 on 2 CPU cores even after the
    process group was left), which torchrun reports as the run failing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    status = main()
    if "LOCAL_RANK" in os.environ:  # (set by torchrun and accelerate launch for each worker)
        _exit_worker(status)
    sys.exit(status)

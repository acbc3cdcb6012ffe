"""Checkpoints of a run (head, optimizer, scheduler, RNG state, config) written atomically, found and resumed;
the run's history.jsonl kept in step with them."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from ..draft import HeadError, load_head
from ..errors import InvalidValue
from ..files import appending, building, publish, write_text_atomic
from .config import TrainConfig, TrainingError, lr_lambda


def rng_state(noise_gen) -> dict:
    """Every random state a run draws from: torch's, Python's, the noise generator's and CUDA's."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "noise": noise_gen.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state, noise_gen) -> None:
    """Restore what `rng_state` saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    noise_gen.set_state(state["noise"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainer_state(optimizer, scheduler, step: int, counters: dict, noise_gen, precision: str = "fp32", data=None):
    """What a checkpoint's trainer.pt holds besides the head: the optimizer, the schedule, the step, the run's counts,
    every random state, the precision and what the run trains on (`data`: `inputs.data_fingerprint`, so that a
    resume notices a changed dataset)."""
    return {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
        "counters": counters,
        "rng": rng_state(noise_gen),
        "precision": precision,
        "data": data,
    }


def save_checkpoint(folder: Path, head, state: dict, cfg) -> Path:
    """Write checkpoints/step-N (N: the trainer `state`'s step) atomically (temporary folder, then rename) and prune
    all but the cfg.keep_checkpoints newest."""
    root = folder / "checkpoints"
    final = root / f"step-{state['step']:07d}"
    with building(final) as tmp:  # also removes what a killed save left in `root`
        head.save_pretrained(tmp / "head")
        torch.save(state, tmp / "trainer.pt")
        (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    publish(tmp, final, keep_others=False)
    # the `keep` newest by step, the one just written always among them
    for old in sorted(root.glob("step-*"), key=lambda p: (p == final, p.name))[: -cfg.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint folder of a run, or None."""
    found = sorted((folder / "checkpoints").glob("step-*"))
    return found[-1] if found else None


# Keys that may differ on --resume without changing the run (where and how it is written, when it stops).
NOT_RUN_DEFINING = (
    "out_dir",
    "stop_after",
    "save_every",
    "keep_checkpoints",
    "log_every",
    "eval_conversations",
    "eval_dataset",
    "report_to",
    "device",
    "precision",
    "features_dir",
)


# Keys that make the head what it is (its shape, vocabulary, where its weights start): a resume goes on with the
# checkpoint's head, so these cannot change, not even with --allow-changes.
HEAD_DEFINING = (
    "head_type",
    "medusa_heads",
    "fc_bias",
    "draft_vocab",
    "draft_vocab_sample",
    "init_head",
    "init_from_target",
    "widen_vocab",
)


def changed_run_keys(saved: dict, cfg: TrainConfig) -> dict:
    """{key: (checkpoint's value, config's value)} for the run-defining keys that differ."""
    now = asdict(cfg)
    return {k: (saved[k], v) for k, v in now.items() if k in saved and k not in NOT_RUN_DEFINING and saved[k] != v}


class UntrustedCheckpoint(TrainingError):
    """A trainer state that would run code when loaded: refused unless the user trusts the run folder."""


def load_trainer_state(path: Path, trust: bool = False) -> dict:
    """The trainer state `save_checkpoint` wrote (tensors, numbers, strings and containers of them), loaded with
    `weights_only=True`, which runs no code. A file that holds other Python objects (an older format, or someone
    else's file) is UntrustedCheckpoint unless `trust`, which loads it with pickle: that can run any code."""
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))  # (reads, runs nothing; a cut file raises)
    if unsafe and not trust:
        raise UntrustedCheckpoint(
            f"{path} holds Python objects that loading it would construct ({', '.join(unsafe[:4])}"
            f"{', ...' if len(unsafe) > 4 else ''}); the trainer states this version writes hold none. Resume it only "
            "if you trust where the run folder came from, with --trust-checkpoint (trust_checkpoint=True): that "
            "loads it with pickle, which can run any code"
        )
    return torch.load(path, weights_only=not unsafe)


def resume_point(folder: Path, target_config, set_aside: bool = True, trust: bool = False):
    """(checkpoint, head, trainer state, saved config) of the newest intact checkpoint, or Nones when there is none.

    A damaged checkpoint (a file cut or missing) is skipped, saying so, and (`set_aside`: the main process only,
    so that processes do not move each other's) renamed out of the way; TrainingError when none is intact. A
    trainer state that would run code when loaded is refused (`load_trainer_state`; `trust` loads it).
    """
    found = sorted((folder / "checkpoints").glob("step-*"), reverse=True)
    damaged = []
    for ckpt in found:
        try:
            head = load_head(ckpt / "head")
            state = load_trainer_state(ckpt / "trainer.pt", trust)
            saved = json.loads((ckpt / "config.json").read_text())
            if not isinstance(state, dict) or not {"optimizer", "scheduler", "step", "counters", "rng"} <= set(state):
                raise InvalidValue("trainer.pt lacks the trainer state")
        except UntrustedCheckpoint:
            raise  # not damage: set nothing aside, resume nothing older
        except (HeadError, OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
            damaged.append((ckpt, f"{ckpt.name} ({' '.join(str(e).split())[:160]})"))
            print(
                f"warning: checkpoint {ckpt} is damaged ({damaged[-1][1]}); trying the one before it", file=sys.stderr
            )
            continue
        head.check_target(target_config)  # another target is a wrong run, not a damaged checkpoint
        if damaged and set_aside:
            print(f"warning: resuming from {ckpt}, the newest intact checkpoint", file=sys.stderr)
            for bad, _ in damaged:  # out of the way: the resumed run's checkpoints would sort before them and be pruned
                aside = bad.with_name(f"damaged-{bad.name}")
                shutil.rmtree(aside, ignore_errors=True)
                bad.rename(aside)
                print(f"warning: set the damaged {bad.name} aside as {aside}", file=sys.stderr)
        return ckpt, head, state, saved
    if damaged:
        raise TrainingError(
            f"no intact checkpoint in {folder / 'checkpoints'} to resume from: {'; '.join(text for _, text in damaged)}"
        )
    return None, None, None, None


def check_resume(
    ckpt: Path, head, state: dict, changes: dict, data: dict, cfg: TrainConfig, allow_changes: bool
) -> None:
    """Refuse to resume from `ckpt` (its `head` and trainer `state`) a run that the config would change: another
    head type or a head-defining key always; run-defining keys that differ (`changes`) or other training data
    (`data`, `inputs.data_fingerprint`) unless `allow_changes` (then a changed dataset is warned about)."""
    if head.config.head_type != cfg.head_type:  # no flag changes this
        raise TrainingError(
            f"checkpoint {ckpt} holds a {head.config.head_type!r} head but the config asks for "
            f"head_type {cfg.head_type!r}"
        )
    fixed = {k: v for k, v in changes.items() if k in HEAD_DEFINING}
    if fixed:  # the checkpoint's head already has its shape and start: no flag changes these either
        listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in fixed.items())
        raise TrainingError(
            f"--resume from {ckpt}: {listed} would change the head's shape or start, which the "
            "checkpoint fixes; keep the checkpoint's values, or start a new run in another out_dir"
        )
    saved_data = state.get("data")  # (checkpoints before this key record none)
    if saved_data is not None and saved_data != data:
        before, now = saved_data["conversations"], data["conversations"]
        counts = f"{before} -> {now} conversations" if before != now else f"{now} conversations, other ones"
        what = (
            f"the training data changed since the checkpoint ({counts}), so the rest of the run takes them in "
            "another order than a straight run"
        )
        if {**saved_data, "groups": 0} == {**data, "groups": 0}:  # the same data, read in other shard groups
            before, now = (
                f"{n} shard group{'s' * (n != 1)}" for n in (saved_data.get("groups", 1), data.get("groups", 1))
            )
            what = (
                f"the feature cache was read in {before} and would be read in {now} (feature_groups, by default "
                "one per process), so the rest of the run takes it in another order than a straight run: set "
                f"feature_groups={saved_data.get('groups', 1)} to read it as the checkpoint did"
            )
        if not allow_changes:
            raise TrainingError(
                f"--resume from {ckpt}: {what}; pass --allow-changes to continue on the new data, "
                "or give the run another out_dir"
            )
        warnings.warn(f"--resume from {ckpt}: {what}", stacklevel=5)  # (at train()'s caller)
    if changes and not allow_changes:
        listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
        raise TrainingError(
            f"--resume from {ckpt} with changed run-defining keys: {listed}; pass "
            "--allow-changes to continue with the new values, or give the run another out_dir"
        )


def restore_trainer(
    accelerator,
    ckpt: Path,
    state: dict,
    changes: dict,
    optimizer,
    scheduler,
    noise_gen,
    cfg: TrainConfig,
    precision: str,
) -> tuple[int, dict]:
    """Load a checkpoint's trainer `state` into the optimizer, the schedule (then the `changes` that
    `check_resume` allowed) and the random generators; returns (step, counters) to go on from."""
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if changes:
        apply_changes(optimizer, scheduler, cfg)
        listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
        accelerator.print(f"resuming with changed keys: {listed}")
    # the checkpoint holds the whole run's counts: the main process carries them on, the others count afresh
    step, counters = (
        state["step"],
        (state["counters"] if accelerator.is_main_process else dict.fromkeys(state["counters"], 0)),
    )
    set_rng_state(state["rng"], noise_gen)
    if state.get("precision", precision) != precision:  # (checkpoints before the precision key record none)
        warnings.warn(
            f"{ckpt} was trained in {state['precision']} and continues in {precision} (precision="
            f"{cfg.precision!r} on this machine): the run will not match a straight {state['precision']} "
            "run exactly; pass precision=... to keep it",
            stacklevel=4,
        )  # (at train()'s caller)
    accelerator.print(f"resumed from {ckpt} at step {step}")
    return step, counters


RUN_FILES = ("checkpoints", "head", "history.jsonl", "metrics.json")  # what a run writes in its out_dir


def check_run_dir(folder: Path, resume: bool, overwrite: bool) -> list[Path]:
    """Refuse an out_dir that is a file, and a fresh run into one that holds a run (unless `overwrite`): the new
    run's history and head would replace the old one's, and its checkpoints would mix with the old ones.
    TrainingError naming the folder and the flags. Returns the old run's files that `overwrite` removes; the
    caller removes them (`clear_run`) only once the new run's inputs have loaded, so a mistyped target, head or
    dataset leaves the old run as it was."""
    if folder.exists() and not folder.is_dir():
        raise TrainingError(f"out_dir {str(folder)!r} is a file; expected a folder for the run")
    if resume or not folder.is_dir():
        return []
    # a run that saved something: a checkpoint, its head or metrics (one killed before its first checkpoint left
    # nothing a resume could use, so a rerun simply starts over)
    if latest_checkpoint(folder) is None and not (folder / "head").exists() and not (folder / "metrics.json").exists():
        return []
    held = [name for name in RUN_FILES if (folder / name).exists()]
    if not overwrite:
        last = latest_checkpoint(folder)
        where = f"checkpoints up to {last.name}" if last is not None else ", ".join(held)
        raise TrainingError(
            f"out_dir {str(folder)!r} holds a run ({where}); pass --resume to continue it, "
            "--overwrite to start over (its checkpoints, head, history and metrics are deleted), "
            "or another out_dir"
        )
    return [folder / name for name in held]


def clear_run(paths: list[Path]) -> None:
    """Remove an overwritten run's files (`check_run_dir`); tolerant: under `accelerate launch` every process does
    this."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def apply_changes(optimizer, scheduler, cfg: TrainConfig) -> None:
    """After loading a checkpoint's optimizer and scheduler, follow the config's lr, weight decay and schedule."""
    for group in optimizer.param_groups:
        group["initial_lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    scheduler.lr_lambdas = [lr_lambda(cfg)] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def keep_history(path: Path, step: int) -> None:
    """Rewrite history.jsonl (atomically) with only the records of steps <= `step`."""
    lines = path.read_text().splitlines() if path.is_file() else []
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut by a kill
    write_text_atomic(path, "".join(kept))


def append_history(path: Path, history: list, written: int) -> int:
    """Append the records not yet written; returns how many are written now."""
    if written < len(history):
        with appending(path) as f:
            f.write("".join(json.dumps(h) + "\n" for h in history[written:]))
            f.flush()
            os.fsync(f.fileno())
    return len(history)

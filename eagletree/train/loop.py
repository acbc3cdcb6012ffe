"""The training loop: the same code on CPU, one GPU or many (accelerate), resumable bit for bit.

One optimizer step = `grad_accum` micro-batches per process; a micro-batch is one rendered
conversation. Online features: the frozen target runs inside the loop. Everything that depends on
the kind of head (its creation, objective, target features, dummy forward) is a method of the head;
a step is `step.Stepper`, checkpoints and resuming are `checkpoints`, Ctrl-C and SIGTERM `signals`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from ..draft import HeadError, head_class
from ..draft.vocab import draft_vocab_from_counts, token_counts
from ..loading import load_head  # init_head may be an export to import
from ..target import checked_device, load_target
from ..target.shell import load_target_shell
from .checkpoints import (
    append_history,
    changed_run_keys,
    check_resume,
    check_run_dir,
    clear_run,
    keep_history,
    restore_trainer,
    resume_point,
    save_checkpoint,
    trainer_state,
)
from .config import TrainConfig, TrainingError, lr_lambda, on_cpu, resolve_precision
from .inputs import (
    GroupStream,
    Stream,
    assistant_tokens,
    data_fingerprint,
    has_assistant_text,
    special_ids,
    training_conversations,
    training_stream,
)
from .signals import TrainingInterrupted, interrupted, stop_on_signals
from .step import Stepper, zero_backward

# Re-exported: train.py, the CLI and the scripts import these from here.
__all__ = [
    "Stream",
    "TrainConfig",
    "TrainingError",
    "TrainingInterrupted",
    "has_assistant_text",
    "on_cpu",
    "resolve_precision",
    "train",
    "training_conversations",
    "zero_backward",
]


@dataclass
class Run:
    """A run under way: its settings, its `Stepper`, the step reached, the records of the steps taken since it
    started (`written` of them already in history.jsonl) and its newest checkpoint."""

    cfg: TrainConfig
    accelerator: Accelerator
    precision: str  # "bf16" or "fp32", as resolved on this machine
    data: dict  # inputs.data_fingerprint of what it trains on
    stepper: Stepper
    step: int = 0
    last_ckpt: Path | None = None
    history: list = field(default_factory=list)
    written: int = 0

    @property
    def out(self) -> Path:
        return Path(self.cfg.out_dir)

    @property
    def history_path(self) -> Path:
        return self.out / "history.jsonl"


def train(
    cfg: TrainConfig,
    resume: bool = False,
    model_and_tokenizer=None,
    conversations=None,
    progress=True,
    allow_changes: bool = False,
    overwrite: bool = False,
    trust_checkpoint: bool = False,
):
    """Train an EAGLE head; returns (head, summary dict). `model_and_tokenizer`/`conversations` are for tests.

    A fresh run refuses an out_dir that holds a run unless `overwrite` (`checkpoints.check_run_dir`). A resume
    refuses a config whose run-defining keys differ from the checkpoint's, unless `allow_changes` (then the new
    values apply from the checkpoint's step on); keys that set the head's shape or start never change; a trainer
    state that would run code when loaded is refused unless `trust_checkpoint`. SIGINT and
    SIGTERM stop the run after the step in progress with a checkpoint (`TrainingInterrupted`)."""
    out = Path(cfg.out_dir)  # made once the run's inputs are read, so a refused run leaves no empty folder
    if resume and overwrite:
        raise TrainingError("--resume continues the run in out_dir and --overwrite deletes it: pass one of them")
    if cfg.device:
        checked_device(cfg.device)  # a CUDA device on a machine without one is an error, not a CPU run
    if not cfg.features_dir and conversations is None:
        conversations = training_conversations(cfg)  # a bad dataset fails before the target is loaded
    overwritten = check_run_dir(out, resume, overwrite)  # removed once the inputs below have loaded
    log_with = _trackers(cfg)
    precision = resolve_precision(cfg.precision, on_cpu(cfg.device or None))
    # bf16 autocast is applied by the Stepper (`amp`) rather than through accelerate's mixed_precision, which
    # fixes one precision per process (a second train() call with another precision would be refused); "no"
    # also overrides ACCELERATE_MIXED_PRECISION / an `accelerate launch` config, so the config decides.
    accelerator = Accelerator(log_with=log_with, cpu=cfg.device == "cpu", mixed_precision="no")
    set_seed(cfg.seed)
    if model_and_tokenizer is None:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        # from cached features the target never runs: its embedding, final norm and lm_head are all a head reads
        load = load_target_shell if cfg.features_dir else load_target
        model_and_tokenizer = load(cfg.target, dtype=dtype, device=accelerator.device)
    resume_as = (resume, allow_changes, trust_checkpoint)
    run = _start(cfg, accelerator, *model_and_tokenizer, conversations, precision, resume_as)
    clear_run(overwritten)
    out.mkdir(parents=True, exist_ok=True)
    stepper = run.stepper
    stepper.head, stepper.optimizer = accelerator.prepare(stepper.core, stepper.optimizer)  # `head`: maybe DDP's
    if log_with:
        accelerator.init_trackers("eagletree", config=asdict(cfg))
    _run_steps(run, progress, log_with)
    return _finish(run, log_with)


def _run_steps(run: Run, progress: bool, log_with) -> None:
    """Take the run's steps up to `steps` (or `stop_after`), logging each and saving checkpoints; a signal ends the
    step in progress, saves it and raises TrainingInterrupted."""
    cfg, accelerator, stepper = run.cfg, run.accelerator, run.stepper
    end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    bar = tqdm(total=end, initial=run.step, desc="train", disable=not (progress and accelerator.is_main_process))
    t0, tokens0 = time.perf_counter(), stepper.counters["tokens"]
    if accelerator.is_main_process:  # a fresh run starts it empty; a resumed one redoes the steps after its checkpoint
        keep_history(run.history_path, run.step)
    with stop_on_signals() as signals:
        while run.step < end:
            stats = stepper.accumulate(run.step, run.last_ckpt)
            # Sum over processes, so the logged numbers are those of the global batch (and every process learns
            # of a signal any of them got, so that all stop after the same step).
            totals = torch.tensor(stats + [float(bool(signals))], dtype=torch.float64, device=accelerator.device)
            if accelerator.num_processes > 1:
                totals = accelerator.reduce(totals, reduction="sum")
            stopping = bool(totals[5] > 0)
            n = int(totals[4])  # sequences with assistant tokens in the global batch
            lr = stepper.update(n)
            run.step += 1
            # a step where none had any (all cut, dropped or without an answer) has no loss: null, not 0
            record = {k: float(v) / n if n else None for k, v in zip(("loss", "l1", "ce", "acc"), totals[:4])} | {
                "lr": lr,
                "step": run.step,
                "sequences": n,
            }
            run.history.append(record)
            tokens = (stepper.counters["tokens"] - tokens0) * accelerator.num_processes
            record["tokens_per_s"] = tokens / max(time.perf_counter() - t0, 1e-9)
            bar.update(1)
            if n:
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.2f}", tok_s=f"{record['tokens_per_s']:.0f}"
                )
            if log_with and run.step % cfg.log_every == 0:
                accelerator.log({k: v for k, v in record.items() if v is not None}, step=run.step)
            if run.step % cfg.save_every == 0 or run.step == end or stopping:
                _save(run)
            if stopping and run.step < end:  # at the last step the run is done: the head is written as usual
                bar.close()
                raise interrupted(signals, run.step, cfg.steps, run.out)
    bar.close()


def _save(run: Run) -> None:
    """Checkpoint the step just taken (the main process writes; every process takes part in the counting)."""
    accelerator, stepper = run.accelerator, run.stepper
    accelerator.wait_for_everyone()
    totals = _global_counters(accelerator, stepper.counters)  # (a collective: every process takes part)
    if accelerator.is_main_process:
        # history first: a kill between the two leaves records past the checkpoint, which a resume drops
        run.written = append_history(run.history_path, run.history, run.written)
        state = trainer_state(
            stepper.optimizer, stepper.scheduler, run.step, totals, stepper.noise_gen, run.precision, run.data
        )
        run.last_ckpt = save_checkpoint(run.out, accelerator.unwrap_model(stepper.head), state, run.cfg)


def _finish(run: Run, log_with):
    """Write the trained head and the rest of the history; returns (head, summary)."""
    cfg, accelerator = run.cfg, run.accelerator
    counters = _global_counters(accelerator, run.stepper.counters)  # the run's, not this process's share
    if counters["tokens"] == 0 and run.step > 0:
        raise TrainingError(
            f"dataset {cfg.dataset!r}: {run.step} steps saw no assistant token to train on "
            f"({counters['skipped']} conversations skipped, {counters['dropped']} dropped as longer "
            f"than max_len={cfg.max_len}); no head was saved"
        )
    head = accelerator.unwrap_model(run.stepper.head).eval()
    if accelerator.is_main_process:
        head.save_pretrained(run.out / "head")
        append_history(run.history_path, run.history, run.written)
    if log_with:
        accelerator.end_training()
    final = next((h for h in reversed(run.history) if h["loss"] is not None), None)
    return head, {"steps": run.step, **counters, "final": final}


def _start(cfg: TrainConfig, accelerator, model, tok, conversations, precision: str, resume_as: tuple) -> Run:
    """The run at its first step: a new head, or resuming (`resume_as`: resume, allow_changes, trust_checkpoint) the
    newest checkpoint's head, optimizer, schedule, counts and random state."""
    model.requires_grad_(False)
    device = accelerator.device
    store, stream = training_stream(cfg, model.config, conversations, tok, accelerator.num_processes)
    data = data_fingerprint(stream.conversations, store, stream)
    head, resumed = _head_to_train(cfg, accelerator, model, tok, stream, store, data, *resume_as)
    head = head.to(device).train()
    embed = model.get_input_embeddings()
    target_lm = _target_lm(model, head, device)
    if store is not None and store.layers != head.feature_spec.layers:  # (init_head: a head of its own layers)
        raise TrainingError(
            f"features_dir {cfg.features_dir!r} holds {_layers(store.layers)}, but this {head.head_type!r} head "
            f"reads {_layers(head.feature_spec.layers)}: cache the features for this head again, or train online "
            "(features_dir='')"
        )
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    noise_gen = torch.Generator().manual_seed(cfg.seed + 17 + accelerator.process_index)
    step, counters = 0, {"tokens": 0, "skipped": 0, "truncated": 0, "dropped": 0}
    if resumed is not None:
        step, counters = restore_trainer(accelerator, *resumed, optimizer, scheduler, noise_gen, cfg, precision)
    bf16 = precision == "bf16"

    def amp():
        """The run's autocast: bf16 set here per run rather than by accelerate (see `train`)."""
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    stepper = Stepper(
        cfg,
        accelerator,
        model,
        tok,
        stream,
        store,
        head,
        head,
        optimizer,
        scheduler,
        params,
        embed,
        target_lm,
        amp,
        noise_gen,
        counters,
    )
    return Run(cfg, accelerator, precision, data, stepper, step, last_ckpt=resumed[0] if resumed else None)


def _layers(layers) -> str:
    """The target features a cache holds or a head reads, in words."""
    return f"the outputs of target layers {list(layers)}" if layers else "the target's last hidden state"


def _head_to_train(
    cfg: TrainConfig, accelerator, model, tok, stream, store, data: dict, resume: bool, allow_changes: bool, trust: bool
):
    """(head, resumed): with `resume` and a checkpoint, its head and resumed = (checkpoint, trainer state, changed
    keys) once `checkpoints.check_resume` allows them; else a new head and None."""
    out = Path(cfg.out_dir)
    ckpt, head, state, saved_cfg = (
        resume_point(out, model.config, accelerator.is_main_process, trust) if resume else (None,) * 4
    )
    if resume and ckpt is None:
        accelerator.print(f"--resume: no checkpoint in {out / 'checkpoints'}; starting from step 0", file=sys.stderr)
    if ckpt is not None:
        changes = changed_run_keys(saved_cfg, cfg)
        check_resume(ckpt, head, state, changes, data, cfg, allow_changes)
        return head.train(), (ckpt, state, changes)
    if cfg.init_head:
        return _initial_head(cfg, model.config), None
    set_seed(cfg.seed)  # the head's initial weights depend on the seed only, not on what ran before
    draft_tokens = None
    if cfg.draft_vocab:
        draft_tokens = _draft_vocab(cfg, accelerator, model.config.vocab_size, tok, stream, store)
    return head_class(cfg.head_type).create(model, cfg, draft_tokens), None


def _draft_vocab(cfg: TrainConfig, accelerator, vocab_size: int, tok, stream, store) -> torch.Tensor:
    """The draft vocabulary: the most frequent assistant tokens of the run's first conversations. From shard groups
    each process counts its own groups' share and the counts are summed, so no process reads another's shards."""
    world = accelerator.num_processes
    counts = token_counts(assistant_tokens(tok, stream, cfg, store, accelerator.process_index, world), vocab_size)
    if isinstance(stream, GroupStream) and world > 1:
        counts = accelerator.reduce(counts.to(accelerator.device), "sum").cpu()
    return draft_vocab_from_counts(counts, cfg.draft_vocab, vocab_size, always=special_ids(tok))


def _target_lm(model, head, device) -> tuple:
    """(weight [V', H], bias [V'] or None): the frozen target's lm_head rows of the head's draft vocabulary."""
    lm = model.get_output_embeddings()
    rows = head.d2t.to(device) if head.config.draft_vocab_size else None
    weight = lm.weight.detach() if rows is None else lm.weight.detach()[rows]
    bias = None if getattr(lm, "bias", None) is None else (lm.bias.detach() if rows is None else lm.bias.detach()[rows])
    return weight, bias


def _initial_head(cfg: TrainConfig, target_config):
    """The head named by `init_head`, in fp32 for training; it must suit the config and the target."""
    folder = Path(cfg.init_head)
    if not (folder / "config.json").is_file():
        raise TrainingError(f"init_head {cfg.init_head!r} is not a saved head (no config.json there)")
    try:
        head = load_head(folder, target_config=target_config, dtype=torch.float32)
    except HeadError as e:
        raise TrainingError(f"init_head {cfg.init_head!r}: {e}") from e
    if head.config.head_type != cfg.head_type:
        raise TrainingError(
            f"init_head {cfg.init_head!r} holds a {head.config.head_type!r} head but the config asks "
            f"for head_type {cfg.head_type!r}"
        )
    if cfg.widen_vocab:
        try:
            head.widen_vocab()
        except HeadError as e:
            raise TrainingError(f"init_head {cfg.init_head!r}: {e}") from e
    size = head.config.draft_vocab_size or 0
    if cfg.draft_vocab and cfg.draft_vocab != size:
        keep = f"set draft_vocab={size} or 0" if size else "set draft_vocab=0"
        over = f"{size} tokens" if size else "the full vocabulary"
        raise TrainingError(
            f"init_head {cfg.init_head!r} drafts over {over} but the config asks for "
            f"draft_vocab={cfg.draft_vocab}; {keep} to keep the head's"
        )
    head.folder = None  # a new head: the old one's calibration.json does not describe it
    return head


def _global_counters(accelerator, counters: dict) -> dict:
    """The counts (tokens, skipped, truncated, dropped) summed over every process (each counts its own share)."""
    if accelerator.num_processes == 1:
        return dict(counters)
    keys = sorted(counters)
    totals = accelerator.reduce(
        torch.tensor([float(counters[k]) for k in keys], dtype=torch.float64, device=accelerator.device),
        reduction="sum",
    )
    return {k: int(v) for k, v in zip(keys, totals.tolist())}


def _trackers(cfg: TrainConfig):
    """accelerate's `log_with` for the config's report_to: "wandb" (set up to log offline without a key) or None."""
    if cfg.report_to == "none":
        return None
    if cfg.report_to != "wandb":
        raise TrainingError(f"report_to must be 'wandb' or 'none', got {cfg.report_to!r}")
    # Never block or ask: without an API key (or a network) wandb logs offline into the run folder.
    if not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_DIR", cfg.out_dir)
    return "wandb"

"""The training loop: the same code on CPU, one GPU or many (accelerate), resumable bit for bit.

One optimizer step = `grad_accum` micro-batches per process; a micro-batch is one rendered
conversation. Online features: the frozen target runs inside the loop. Everything that depends on
the kind of head (its creation, objective, target features, dummy forward) is a method of the head.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm import tqdm

from ..draft_heads import HeadError, build_draft_vocab, head_class, load_head
from ..target import checked_device, load_target
from .checkpoints import (HEAD_DEFINING, append_history, apply_changes, changed_run_keys, check_run_dir, clear_run,
                          keep_history, resume_point, save_checkpoint, set_rng_state)
from .config import TrainConfig, TrainingError, lr_lambda, on_cpu, resolve_precision
from .data import load_training_data, split
from .features import FeatureStore
from .render import RenderError, render_item

# Re-exported: train.py, the CLI and the scripts import these from here.
__all__ = ["TrainConfig", "TrainingError", "TrainingInterrupted", "Stream", "has_assistant_text", "on_cpu",
           "resolve_precision", "train", "training_conversations", "zero_backward"]


class Stream:
    """Deterministic conversation order: a fresh permutation per epoch; position = micro-batch index."""

    def __init__(self, conversations, seed: int):
        self.conversations, self.seed = conversations, seed
        self._perm_epoch, self._perm = -1, None

    def __getitem__(self, index: int):
        epoch, i = divmod(index, len(self.conversations))
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.conversations), generator=g), epoch
        return self.conversations[int(self._perm[i])]


def data_fingerprint(items, store=None) -> dict:
    """What a run trains on, for a resume to compare: the number of training conversations and a hash of their ids
    in order (None when the items have no ids, e.g. pre-tokenized records)."""
    ids = store.ids if store is not None else [getattr(item, "id", None) for item in items]
    digest = None if any(i is None for i in ids) else \
        hashlib.sha256("\n".join(map(str, ids)).encode()).hexdigest()[:16]
    return {"conversations": len(ids), "ids": digest}


def _global_counters(accelerator, counters: dict) -> dict:
    """The counts (tokens, skipped, truncated, dropped) summed over every process (each counts its own share)."""
    if accelerator.num_processes == 1:
        return dict(counters)
    keys = sorted(counters)
    totals = accelerator.reduce(torch.tensor([float(counters[k]) for k in keys], dtype=torch.float64,
                                             device=accelerator.device), reduction="sum")
    return {k: int(v) for k, v in zip(keys, totals.tolist())}


def has_assistant_text(conversations) -> bool:
    """Whether some conversation has an assistant turn with text and not of weight 0 (the loss is on those tokens);
    items that are not chat conversations are taken as trainable."""
    for conv in conversations:
        messages = getattr(conv, "messages", None)
        if messages is None:
            return True
        if any(m.get("role") == "assistant" and m.get("weight", 1) != 0 and str(m.get("content") or "").strip()
               for m in messages):
            return True
    return False


def _sync_context(accelerator, head, micro: int, cfg: TrainConfig):
    """Gradients are all-reduced only on the last micro-batch of an optimizer step."""
    if accelerator.num_processes > 1 and micro < cfg.grad_accum - 1:
        return accelerator.no_sync(head)
    return contextlib.nullcontext()


def zero_backward(accelerator, dummy_loss, micro: int, cfg: TrainConfig) -> None:
    """A skipped micro-batch still runs a zero-weighted forward and backward through every parameter,
    so all processes make the same collective calls (DDP would otherwise pair them up wrongly)."""
    if accelerator.num_processes > 1 and micro == cfg.grad_accum - 1:
        accelerator.backward(dummy_loss())


def _dummy_loss(head, embed, lm_weight, lm_bias, device, amp):
    """0 x (a tiny forward through the whole head, under the loop's autocast `amp`), for `zero_backward`."""
    core = getattr(head, "module", head)

    def loss():
        with amp():
            return core.dummy_loss(head, embed, lm_weight, lm_bias, device)

    return loss


def _trackers(cfg: TrainConfig):
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


class TrainingInterrupted(TrainingError):
    """SIGINT or SIGTERM stopped a run after a step, with a checkpoint of that step (the message names it)."""


@contextlib.contextmanager
def _stop_on_signals():
    """Yield a list that SIGINT/SIGTERM append to instead of stopping the process at once (so the step in progress
    ends and is saved); a second signal acts as usual. Only in the main thread, where signals are delivered."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    before = {}

    def handler(signum, frame):
        got.append(signum)
        for sig, old in before.items():
            signal.signal(sig, old)

    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # one the process was started to ignore (nohup) stays so
            before[sig] = signal.signal(sig, handler)
    try:
        yield got
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


def train(cfg: TrainConfig, resume: bool = False, model_and_tokenizer=None, conversations=None, progress=True,
          allow_changes: bool = False, overwrite: bool = False):
    """Train an EAGLE head; returns (head, summary dict). `model_and_tokenizer`/`conversations` are for tests.

    A fresh run refuses an out_dir that holds a run unless `overwrite` (`checkpoints.check_run_dir`). A resume
    refuses a config whose run-defining keys differ from the checkpoint's, unless `allow_changes` (then the new
    values apply from the checkpoint's step on); keys that set the head's shape or start never change. SIGINT and
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
    bf16 = precision == "bf16"
    # bf16 autocast is applied below (`amp`) rather than through accelerate's mixed_precision, which fixes
    # one precision per process (a second train() call with another precision would be refused); "no"
    # also overrides ACCELERATE_MIXED_PRECISION / an `accelerate launch` config, so the config decides.
    accelerator = Accelerator(log_with=log_with, cpu=cfg.device == "cpu", mixed_precision="no")
    set_seed(cfg.seed)
    device = accelerator.device
    if model_and_tokenizer is None:
        model, tok = load_target(cfg.target, dtype=torch.bfloat16 if bf16 else torch.float32, device=device)
    else:
        model, tok = model_and_tokenizer
    model.requires_grad_(False)
    store = None
    if cfg.features_dir:
        store = FeatureStore(cfg.features_dir, cfg, model.config)
        train_convs = list(range(len(store)))
    elif conversations is None:
        train_convs = training_conversations(cfg)
    else:
        train_convs = conversations
    if not train_convs:
        raise TrainingError(f"dataset {cfg.dataset!r} has no training conversations (heldout_fraction="
                            f"{cfg.heldout_fraction}, max_conversations={cfg.max_conversations})")
    if store is None and not has_assistant_text(train_convs):
        raise TrainingError(f"dataset {cfg.dataset!r}: none of its {len(train_convs)} training conversations has an "
                            "assistant turn with text; the head learns from assistant tokens, so there is nothing to "
                            "train on")
    stream = Stream(train_convs, cfg.seed)

    data = data_fingerprint(train_convs, store)
    ckpt, head, state, saved_cfg = resume_point(out, model.config, accelerator.is_main_process) if resume \
        else (None,) * 4
    if resume and ckpt is None:
        accelerator.print(f"--resume: no checkpoint in {out / 'checkpoints'}; starting from step 0", file=sys.stderr)
    changes = changed_run_keys(saved_cfg, cfg) if ckpt is not None else {}
    if ckpt is not None:
        head = head.train()
        if head.config.head_type != cfg.head_type:  # no flag changes this
            raise TrainingError(f"checkpoint {ckpt} holds a {head.config.head_type!r} head but the config asks for "
                                f"head_type {cfg.head_type!r}")
        fixed = {k: v for k, v in changes.items() if k in HEAD_DEFINING}
        if fixed:  # the checkpoint's head already has its shape and start: no flag changes these either
            listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in fixed.items())
            raise TrainingError(f"--resume from {ckpt}: {listed} would change the head's shape or start, which the "
                                "checkpoint fixes; keep the checkpoint's values, or start a new run in another out_dir")
        saved_data = state.get("data")  # (checkpoints before this key record none)
        if saved_data is not None and saved_data != data:
            before, now = saved_data["conversations"], data["conversations"]
            counts = f"{before} -> {now} conversations" if before != now else f"{now} conversations, other ones"
            what = (f"the training data changed since the checkpoint ({counts}), so the rest of the run takes them in "
                    "another order than a straight run")
            if not allow_changes:
                raise TrainingError(f"--resume from {ckpt}: {what}; pass --allow-changes to continue on the new data, "
                                    "or give the run another out_dir")
            warnings.warn(f"--resume from {ckpt}: {what}", stacklevel=2)
        if changes and not allow_changes:
            listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
            raise TrainingError(f"--resume from {ckpt} with changed run-defining keys: {listed}; pass "
                                "--allow-changes to continue with the new values, or give the run another out_dir")
    elif cfg.init_head:
        head = _initial_head(cfg, model.config)
    else:
        set_seed(cfg.seed)  # the head's initial weights depend on the seed only, not on what ran before
        draft_tokens = None
        if cfg.draft_vocab:
            draft_tokens = build_draft_vocab(_assistant_tokens(tok, stream, cfg, store), cfg.draft_vocab,
                                             model.config.vocab_size, always=_special_ids(tok))
        head = head_class(cfg.head_type).create(model, cfg, draft_tokens)
    head = head.to(device).train()
    embed = model.get_input_embeddings()
    lm = model.get_output_embeddings()
    rows = head.d2t.to(device) if head.config.draft_vocab_size else None
    lm_weight = lm.weight.detach() if rows is None else lm.weight.detach()[rows]
    lm_bias = None if getattr(lm, "bias", None) is None else (lm.bias.detach() if rows is None else lm.bias.detach()[rows])

    if head.fused_layers and store is not None:
        raise TrainingError(f"{head.head_type!r} heads read target layers {head.fused_layers}: they train on online "
                            "features (the feature cache holds the last layer only)")
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    noise_gen = torch.Generator().manual_seed(cfg.seed + 17 + accelerator.process_index)
    step, counters = 0, {"tokens": 0, "skipped": 0, "truncated": 0, "dropped": 0}
    if ckpt is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if changes:
            apply_changes(optimizer, scheduler, cfg)
            accelerator.print(f"resuming with changed keys: {', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changes.items())}")
        # the checkpoint holds the whole run's counts: the main process carries them on, the others count afresh
        step, counters = state["step"], (state["counters"] if accelerator.is_main_process
                                         else dict.fromkeys(state["counters"], 0))
        set_rng_state(state["rng"], noise_gen)
        if state.get("precision", precision) != precision:  # (checkpoints before the precision key record none)
            warnings.warn(f"{ckpt} was trained in {state['precision']} and continues in {precision} (precision="
                          f"{cfg.precision!r} on this machine): the run will not match a straight {state['precision']} "
                          "run exactly; pass precision=... to keep it", stacklevel=2)
        accelerator.print(f"resumed from {ckpt} at step {step}")
    clear_run(overwritten)
    out.mkdir(parents=True, exist_ok=True)
    core = head  # the head itself; `head` may become a DDP wrapper, which is what gets called
    head, optimizer = accelerator.prepare(head, optimizer)
    if log_with:
        accelerator.init_trackers("eagletree", config=asdict(cfg))

    world, rank = accelerator.num_processes, accelerator.process_index
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
    dummy_loss = _dummy_loss(head, embed, lm_weight, lm_bias, device, amp)
    end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    bar = tqdm(total=end, initial=step, desc="train", disable=not (progress and accelerator.is_main_process))
    t0, tokens0 = time.perf_counter(), counters["tokens"]
    last_ckpt = ckpt
    history, written = [], 0
    history_path = out / "history.jsonl"
    if accelerator.is_main_process:
        keep_history(history_path, step)  # a fresh run starts it empty; a resumed one redoes the steps after its checkpoint
    with _stop_on_signals() as signals:
        while step < end:
            stats = {"loss": 0.0, "l1": 0.0, "ce": 0.0, "acc": 0.0, "n": 0}
            for micro in range(cfg.grad_accum):
                index = (step * cfg.grad_accum + micro) * world + rank
                if store is not None:
                    ids, loss_mask, feats = store[stream[index]]
                    ids, loss_mask, feats = ids.to(device), loss_mask.to(device), feats.to(device)
                else:
                    try:
                        r = render_item(tok, stream[index], cfg.max_len if cfg.long == "truncate" else None)
                    except RenderError:
                        counters["skipped"] += 1
                        zero_backward(accelerator, dummy_loss, micro, cfg)
                        continue
                    if cfg.long == "drop" and r.input_ids.numel() > cfg.max_len:
                        counters["dropped"] += 1
                        zero_backward(accelerator, dummy_loss, micro, cfg)
                        continue
                    counters["truncated"] += int(r.truncated)
                    ids, loss_mask = r.input_ids.to(device), r.loss_mask.to(device)
                    with torch.no_grad():
                        feats = core.target_features(model, ids)
                # Noise seeded by the global micro-batch index: the same whatever the process count or resumes.
                noise_gen.manual_seed(cfg.seed * 1_000_003 + index)
                with amp():
                    result = core.training_loss(head, (lm_weight, lm_bias), embed, feats.float(), ids, loss_mask, cfg,
                                                noise_gen)
                if result is None:
                    zero_backward(accelerator, dummy_loss, micro, cfg)
                    continue
                loss, parts = result
                if not torch.isfinite(loss):
                    raise TrainingError(f"loss is {float(loss.detach())} at step {step + 1} (micro-batch {micro}); stopped. "
                                        f"The last good checkpoint is {last_ckpt or 'none (no checkpoint yet)'}")
                with _sync_context(accelerator, head, micro, cfg):
                    accelerator.backward(loss / cfg.grad_accum)
                stats["loss"] += loss.item()
                stats["l1"] += float(parts["l1"])
                stats["ce"] += float(parts["ce"])
                stats["acc"] += float(parts["acc"])
                stats["n"] += 1
                counters["tokens"] += parts["tokens"]
            # Sum over processes, so the logged numbers are those of the global batch (and every process learns
            # of a signal any of them got, so that all stop after the same step).
            totals = torch.tensor([stats[k] for k in ("loss", "l1", "ce", "acc", "n")] + [float(bool(signals))],
                                  dtype=torch.float64, device=device)
            if world > 1:
                totals = accelerator.reduce(totals, reduction="sum")
            stopping = bool(totals[5] > 0)
            n = int(totals[4])  # sequences with assistant tokens in the global batch
            if 0 < n < cfg.grad_accum * world:  # the gradient is the mean over the sequences that had a loss
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(cfg.grad_accum * world / n)
            if accelerator.sync_gradients and cfg.clip:
                accelerator.clip_grad_norm_(params, cfg.clip)
            lr = scheduler.get_last_lr()[0]  # the rate this step used (after scheduler.step() it is the next one's)
            if n:  # a step without a loss leaves the weights (and AdamW's moments) as they are
                optimizer.step()
            with warnings.catch_warnings():  # (after a first step without a loss torch warns that the schedule's
                # first value was skipped; LambdaLR counts steps, so nothing is)
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            # a step where none had any (all cut, dropped or without an answer) has no loss: null, not 0
            record = {k: float(v) / n if n else None for k, v in zip(("loss", "l1", "ce", "acc"), totals[:4])} | {
                "lr": lr, "step": step, "sequences": n}
            history.append(record)
            elapsed = time.perf_counter() - t0
            record["tokens_per_s"] = (counters["tokens"] - tokens0) * world / max(elapsed, 1e-9)
            bar.update(1)
            if n:
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.2f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
            if log_with and step % cfg.log_every == 0:
                accelerator.log({k: v for k, v in record.items() if v is not None}, step=step)
            if step % cfg.save_every == 0 or step == end or stopping:
                accelerator.wait_for_everyone()
                totals = _global_counters(accelerator, counters)  # (a collective: every process takes part)
                if accelerator.is_main_process:
                    # history first: a kill between the two leaves records past the checkpoint, which a resume drops
                    written = append_history(history_path, history, written)
                    last_ckpt = save_checkpoint(out, accelerator.unwrap_model(head), optimizer, scheduler, step, totals,
                                                noise_gen, cfg, cfg.keep_checkpoints, precision, data)
            if stopping and step < end:  # at the last step the run is done: the head is written as usual
                bar.close()
                name = signal.Signals(signals[0]).name if signals else "a signal to another process"
                raise TrainingInterrupted(f"interrupted by {name} after step {step} of {cfg.steps}: saved "
                                          f"{out / 'checkpoints' / f'step-{step:07d}'}; run the same command with "
                                          "--resume to continue")
    bar.close()
    counters = _global_counters(accelerator, counters)  # the run's, not this process's share
    if counters["tokens"] == 0 and step > 0:
        raise TrainingError(f"dataset {cfg.dataset!r}: {step} steps saw no assistant token to train on "
                            f"({counters['skipped']} conversations skipped, {counters['dropped']} dropped as longer "
                            f"than max_len={cfg.max_len}); no head was saved")
    head = accelerator.unwrap_model(head).eval()
    if accelerator.is_main_process:
        head.save_pretrained(out / "head")
        append_history(history_path, history, written)
    if log_with:
        accelerator.end_training()
    summary = {"steps": step, **counters, "final": next((h for h in reversed(history) if h["loss"] is not None), None)}
    return head, summary


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
        raise TrainingError(f"init_head {cfg.init_head!r} holds a {head.config.head_type!r} head but the config asks "
                            f"for head_type {cfg.head_type!r}")
    if cfg.widen_vocab:
        try:
            head.widen_vocab()
        except HeadError as e:
            raise TrainingError(f"init_head {cfg.init_head!r}: {e}") from e
    size = head.config.draft_vocab_size or 0
    if cfg.draft_vocab and cfg.draft_vocab != size:
        keep = f"set draft_vocab={size} or 0" if size else "set draft_vocab=0"
        over = f"{size} tokens" if size else "the full vocabulary"
        raise TrainingError(f"init_head {cfg.init_head!r} drafts over {over} but the config asks for "
                            f"draft_vocab={cfg.draft_vocab}; {keep} to keep the head's")
    head.source_dir = None  # a new head: the old one's calibration.json does not describe it
    return head


def training_conversations(cfg: TrainConfig):
    """The training side of the held-out split, cut to max_conversations. What was recovered or skipped reading a
    data file is warned about; the shipped ShareGPT file's known cut is not."""
    train_convs, _ = split(load_training_data(cfg.dataset), cfg.heldout_fraction)
    return train_convs[: cfg.max_conversations] if cfg.max_conversations else train_convs


def _assistant_tokens(tok, stream, cfg, store=None):
    """Assistant tokens of the first conversations in training order (to pick the draft vocabulary)."""
    for i in range(min(cfg.draft_vocab_sample, len(stream.conversations))):
        if store is not None:
            ids, mask, _ = store[stream[i]]
            yield ids[mask].tolist()
            continue
        try:
            r = render_item(tok, stream[i], cfg.max_len)
        except RenderError:
            continue
        yield r.input_ids[r.loss_mask].tolist()


def _special_ids(tok) -> list[int]:
    """The tokenizer's eos, bos and pad ids: always in the draft vocabulary."""
    ids = [tok.eos_token_id, tok.bos_token_id, tok.pad_token_id]
    return [i for i in ids if i is not None]

"""One optimizer step: `grad_accum` micro-batches per process, each `micro_batch` conversations (one padded target
pass) through the head's own objective (`DraftHead.batch_loss`: the step never asks which kind of head it trains),
the gradient rescaled to the mean over the sequences that had a loss, then the update.

A micro-batch without a loss (its conversations cut, dropped or without an answer) still takes part in the
collective calls of a multi-process run (`zero_backward`).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from .config import TrainConfig, TrainingError
from .render import RenderError, render_item

STATS = ("loss", "l1", "ce", "acc", "n")  # summed over a step's micro-batches; n: those with a loss


def zero_backward(accelerator, dummy_loss, micro: int, cfg: TrainConfig) -> None:
    """A skipped micro-batch still runs a zero-weighted forward and backward through every parameter,
    so all processes make the same collective calls (DDP would otherwise pair them up wrongly)."""
    if accelerator.num_processes > 1 and micro == cfg.grad_accum - 1:
        accelerator.backward(dummy_loss())


def _sync_context(accelerator, head, micro: int, cfg: TrainConfig):
    """Gradients are all-reduced only on the last micro-batch of an optimizer step."""
    if accelerator.num_processes > 1 and micro < cfg.grad_accum - 1:
        return accelerator.no_sync(head)
    return contextlib.nullcontext()


@dataclass
class Stepper:
    """What a step reads and changes. `head` is what gets called (a DDP wrapper in multi-process runs), `core`
    the head itself; `target_lm` (weight [V', H], bias [V'] or None) the frozen target's lm_head rows of the
    draft vocabulary; `amp` the autocast context of the run's precision; `counters` the run's counts of tokens
    and of skipped, truncated and dropped conversations (this process's share)."""

    cfg: TrainConfig
    accelerator: object
    model: torch.nn.Module  # the frozen target
    tok: object
    stream: object  # inputs.Stream
    store: object  # features.FeatureStore, or None: online features
    head: torch.nn.Module
    core: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    params: list
    embed: torch.nn.Module
    target_lm: tuple
    amp: object
    noise_gen: torch.Generator
    counters: dict

    def accumulate(self, step: int, last_ckpt) -> list[float]:
        """Forward and backward over this process's micro-batches of optimizer step `step` (0-based); returns the
        sums of STATS over their sequences. A loss that is not finite stops the run, naming `last_ckpt`."""
        cfg, accelerator = self.cfg, self.accelerator
        world, rank = accelerator.num_processes, accelerator.process_index
        stats = dict.fromkeys(STATS, 0.0) | {"n": 0}
        for micro in range(cfg.grad_accum):
            index = (step * cfg.grad_accum + micro) * world + rank
            results = [r for r in self._micro_batch_losses(index) if r is not None]
            if not results:
                zero_backward(accelerator, self.dummy_loss, micro, cfg)
                continue
            for loss, _ in results:
                if not torch.isfinite(loss):
                    raise TrainingError(
                        f"loss is {float(loss.detach())} at step {step + 1} (micro-batch {micro}); "
                        f"stopped. The last good checkpoint is {last_ckpt or 'none (no checkpoint yet)'}"
                    )
            total = results[0][0] if len(results) == 1 else torch.stack([loss for loss, _ in results]).sum()
            with _sync_context(accelerator, self.head, micro, cfg):
                accelerator.backward(total / (cfg.grad_accum * cfg.micro_batch))
            for loss, parts in results:
                stats["loss"] += loss.item()
                for key in ("l1", "ce", "acc"):
                    stats[key] += float(parts[key])
                stats["n"] += 1
                self.counters["tokens"] += parts["tokens"]
        return [stats[k] for k in STATS]

    def _micro_batch_losses(self, index: int) -> list:
        """[(loss, parts) or None] of the head's objective on the conversations of micro-batch `index` (stream
        positions index x micro_batch onwards) that can be trained on: one target pass and one `batch_loss`."""
        rows = self._features(range(index * self.cfg.micro_batch, (index + 1) * self.cfg.micro_batch))
        if not rows:
            return []
        # Noise seeded by the conversation's stream position: the same whatever the process count, packing or resumes.
        generators = []
        for position, *_ in rows:
            generator = self.noise_gen if not generators else torch.Generator()
            generators.append(generator.manual_seed(self.cfg.seed * 1_000_003 + position))
        batch = [(feats.float(), ids, loss_mask) for _, ids, loss_mask, feats in rows]
        with self.amp():
            return self.core.batch_loss(self.head, self.target_lm, self.embed, batch, self.cfg, generators)

    def _features(self, positions) -> list:
        """[(stream position, ids [T], loss_mask [T], target features)] of the conversations at `positions`: cached, or
        the target run on them now (one padded pass); one that cannot be rendered or is too long is counted and left
        out."""
        cfg, device = self.cfg, self.accelerator.device
        if self.store is not None:
            rows = [(p, *self.store[self.stream[p]]) for p in positions]
            return [(p, ids.to(device), loss_mask.to(device), feats.to(device)) for p, ids, loss_mask, feats in rows]
        rendered = []
        for position in positions:
            try:
                r = render_item(self.tok, self.stream[position], cfg.max_len if cfg.long == "truncate" else None)
            except RenderError:
                self.counters["skipped"] += 1
                continue
            if cfg.long == "drop" and r.input_ids.numel() > cfg.max_len:
                self.counters["dropped"] += 1
                continue
            self.counters["truncated"] += int(r.truncated)
            rendered.append((position, r.input_ids.to(device), r.loss_mask.to(device)))
        if not rendered:
            return []
        with torch.no_grad():
            feats = self.core.target_features_batch(self.model, [ids for _, ids, _ in rendered])
        return [(p, ids, loss_mask, f) for (p, ids, loss_mask), f in zip(rendered, feats)]

    def dummy_loss(self):
        """0 x (a tiny forward through the whole head, under `amp`), for `zero_backward`."""
        with self.amp():
            return self.core.dummy_loss(self.head, self.embed, *self.target_lm, self.accelerator.device)

    def update(self, n: int) -> float:
        """Apply the step whose global batch had `n` sequences with a loss; returns the learning rate it used."""
        cfg, accelerator = self.cfg, self.accelerator
        world = accelerator.num_processes
        full = cfg.grad_accum * cfg.micro_batch * world
        if 0 < n < full:  # the gradient is the mean over the sequences that had a loss
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(full / n)
        if accelerator.sync_gradients and cfg.clip:
            accelerator.clip_grad_norm_(self.params, cfg.clip)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step used (after scheduler.step() it is the next one's)
        if n:  # a step without a loss leaves the weights (and AdamW's moments) as they are
            self.optimizer.step()
        with warnings.catch_warnings():  # (after a first step without a loss torch warns that the schedule's
            # first value was skipped; LambdaLR counts steps, so nothing is)
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr

"""The training loop: the same code on CPU, one GPU or many (accelerate), resumable bit for bit.

One optimizer step = `grad_accum` micro-batches per process; a micro-batch is one rendered
conversation. Online features: the frozen target runs inside the loop.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import EagletreeError
from .render import RenderError, render_item


class TrainingError(EagletreeError, RuntimeError):
    """Training cannot go on (bad loss, bad config); the message names the step or key."""


@dataclass
class TrainConfig:
    target: str = "smollm2-135m"
    head_type: str = "eagle"  # "eagle" (EAGLE-1/2), "eagle3" or "medusa"
    # training-time test: drafting steps unrolled per position (step k reads step k-1's predicted features);
    # 0 = the head type's default: 3 for eagle3, 1 (the original one-step objective) for eagle
    ttt_steps: int = 0
    ttt_decay: float = 0.8  # weight of step k is ttt_decay ** (k - 1)
    medusa_heads: int = 4
    fc_bias: bool = False  # EAGLE-1/2 fc bias; vLLM's EAGLE loader has none
    dataset: str = "sharegpt"
    eval_dataset: str = ""  # held-out conversations and prompts for evaluation; "" = dataset's own held-out split
    init_head: str = ""  # start from this saved head's weights (fine-tuning, e.g. on distilled answers); "" = fresh
    heldout_fraction: float = 0.04
    max_conversations: int = 0  # 0 = all training conversations
    max_len: int = 512
    long: str = "truncate"  # or "drop": what to do with conversations longer than max_len
    features_dir: str = ""  # "" = online features; else a cache written by `eagletree features`
    feature_dtype: str = "bf16"  # of cached features: bf16, fp16 or fp32
    draft_vocab: int = 0  # 0 = the full target vocabulary; else the V' most frequent tokens
    draft_vocab_sample: int = 2000  # conversations counted to pick the draft vocabulary
    steps: int = 1000  # optimizer steps (the schedule's length)
    stop_after: int = 0  # stop (with a checkpoint) after this many steps; 0 = run to `steps`; resume later
    grad_accum: int = 4
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    clip: float = 0.5
    noise: float = 0.2  # uniform noise on input features: U(-noise/2, noise/2)
    l1_weight: float = 1.0
    ce_weight: float = 0.1
    seed: int = 0
    save_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_conversations: int = 20
    out_dir: str = "runs/smollm2-135m-eagle"
    report_to: str = "wandb"  # or "none"
    device: str = ""  # "" = accelerate's choice
    # "auto" = bf16 on CUDA and on CPUs with native bf16 (target features in bf16, head under bf16 autocast with
    # fp32 weights: about twice the tokens/s on 2 cores), else fp32. Only applies to a target this run loads.
    precision: str = "auto"

    @classmethod
    def from_sources(cls, path=None, overrides=()) -> "TrainConfig":
        """Defaults, then a YAML file, then key=value overrides; an unknown key is an error listing valid keys."""
        import yaml

        valid = {f.name: f for f in fields(cls)}
        values = {}
        if path:
            try:
                loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
            except (OSError, UnicodeDecodeError) as e:
                raise TrainingError(f"config file {str(path)!r} cannot be read ({e})") from e
            except yaml.YAMLError as e:
                raise TrainingError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(e).split())}") from e
            if not isinstance(loaded, dict):
                raise TrainingError(f"{path}: expected a mapping of config keys, got {type(loaded).__name__}")
            values.update(loaded)
        for item in overrides:
            if "=" not in item:
                raise TrainingError(f"override {item!r} must look like key=value")
            key, raw = item.split("=", 1)
            # a text key takes the text as written (`init_head=` clears it; `out_dir=2024` stays a name)
            try:
                values[key] = raw if key in valid and isinstance(getattr(cls(), key), str) else yaml.safe_load(raw)
            except yaml.YAMLError:
                values[key] = raw  # not YAML: the type check below names the key and the value
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise TrainingError(f"unknown config keys {unknown}; valid keys: {sorted(valid)}")
        for key, value in values.items():
            kind = type(getattr(cls(), key))
            if kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
                try:  # YAML reads 1e-4 (no dot) as text: take every number float() takes
                    values[key] = value = float(value)
                except ValueError:
                    raise TrainingError(f"config key {key!r} must be a number, got {value!r}") from None
                if not math.isfinite(value):
                    raise TrainingError(f"config key {key!r} must be a finite number, got {value!r}")
            elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TrainingError(f"config key {key!r} must be {kind.__name__}, got {value!r}")
        if values.get("head_type", "eagle") not in ("eagle", "eagle3", "medusa"):
            raise TrainingError(f"head_type must be 'eagle', 'eagle3' or 'medusa', got {values['head_type']!r}")
        positive = ("steps", "grad_accum", "save_every", "keep_checkpoints", "log_every", "max_len", "medusa_heads")
        for key in positive:
            if key in values and isinstance(values[key], int) and values[key] < 1:
                raise TrainingError(f"config key {key!r} must be >= 1, got {values[key]}")
        ranges = {"lr": (0.0, False), "weight_decay": (0.0, True), "noise": (0.0, True), "clip": (0.0, True),
                  "l1_weight": (0.0, True), "ce_weight": (0.0, True), "ttt_decay": (0.0, False),
                  "warmup_steps": (0, True), "max_conversations": (0, True), "draft_vocab": (0, True),
                  "draft_vocab_sample": (1, True), "eval_conversations": (1, True), "stop_after": (0, True),
                  "seed": (0, True)}
        for key, (low, inclusive) in ranges.items():
            if key in values and (values[key] < low if inclusive else values[key] <= low):
                raise TrainingError(f"config key {key!r} must be {'>=' if inclusive else '>'} {low}, got {values[key]}")
        for key in ("min_lr_ratio", "heldout_fraction"):
            if key in values and not 0.0 <= values[key] <= 1.0:
                raise TrainingError(f"config key {key!r} must be in [0, 1], got {values[key]}")
        if values.get("ttt_steps", 0) < 0:
            raise TrainingError(f"config key 'ttt_steps' must be >= 0 (0 = the head type's default), "
                                f"got {values['ttt_steps']}")
        if values.get("feature_dtype", "bf16") not in ("bf16", "fp16", "fp32"):
            raise TrainingError(f"feature_dtype must be bf16, fp16 or fp32, got {values['feature_dtype']!r}")
        if values.get("precision", "auto") not in ("auto", "bf16", "fp32"):
            raise TrainingError(f"precision must be 'auto', 'bf16' or 'fp32', got {values['precision']!r}")
        if values.get("long", "truncate") not in ("truncate", "drop"):
            raise TrainingError(f"long must be 'truncate' or 'drop', got {values['long']!r}")
        return cls(**values)


# ---------------------------------------------------------------------------------------------
# Objective
# ---------------------------------------------------------------------------------------------


def eagle_loss(head, target_lm, embed, features, ids, mask, cfg: TrainConfig, generator=None):
    """EAGLE-1/2 objective on one sequence: smooth-L1 to the next feature + w x CE to the target's distribution.

    features [T, H]: the target's post-norm features; ids [T]; mask [T] bool (assistant tokens).
    The head at position t reads (f_t + noise, x_{t+1}) and predicts f_{t+1}. With `ttt_steps` k > 1 the
    drafting steps are unrolled (the training-time test of EAGLE-3 and HASS): step k at position t reads
    step k-1's predicted f_t instead of the target's, attends as a depth-k draft node does, and is held to
    the same targets; step k's loss is weighted ttt_decay ** (k - 1). The reported l1/ce/acc are step 1's.
    """
    f_in, f_next, tok_next = features[:-1], features[1:], ids[1:]
    m = mask[1:]
    if not m.any():
        return None
    if cfg.noise:
        noise = torch.rand(f_in.shape, generator=generator, dtype=torch.float32).to(f_in) - 0.5
        f_in = f_in + noise * cfg.noise
    weight, bias = target_lm
    target = f_next[m]
    with torch.no_grad():
        p_target = torch.softmax(F.linear(target, weight, bias).float(), -1)
    positions = torch.arange(f_in.shape[0], device=f_in.device)
    total, weights, first = 0.0, 0.0, None
    for k, out in unroll_drafts(head, f_in, tok_next, embed, cfg.ttt_steps or 1):
        keep = (positions >= k - 1)[m]  # step k needs k-1 drafted positions before it
        if not keep.any():
            continue
        pred = out[m][keep]
        l1 = F.smooth_l1_loss(pred.float(), target[keep].float())
        logp = torch.log_softmax(F.linear(pred, weight, bias).float(), -1)
        ce = -(p_target[keep] * logp).sum(-1).mean()
        w = cfg.ttt_decay ** (k - 1)
        total = total + w * (cfg.l1_weight * l1 + cfg.ce_weight * ce)
        weights += w
        if first is None:
            acc = (logp.argmax(-1) == p_target[keep].argmax(-1)).float().mean()
            first = {"l1": l1.detach(), "ce": ce.detach(), "acc": acc.detach(), "tokens": int(m.sum())}
    return total / weights, first


def medusa_loss(head, target_lm, embed, features, ids, mask, cfg: TrainConfig, generator=None):
    """Medusa: head k at position t matches the target's distribution k steps later (soft labels)."""
    weight, bias = target_lm
    t_len = features.shape[0]
    k_max = getattr(head, "module", head).num_heads  # DDP wraps the head in multi-process runs
    if t_len <= k_max + 1:
        return None
    with torch.no_grad():
        p_all = torch.softmax(F.linear(features, weight, bias).float(), -1)  # [T, V'] after each position
    logits = head(features[: t_len - k_max], weight, bias).float()  # [K, T-K, V']
    total, acc, n = 0.0, 0.0, 0
    for k in range(1, k_max + 1):
        m = mask[k : t_len - k_max + k]
        if not m.any():
            continue
        target = p_all[k : t_len - k_max + k][m]
        logp = torch.log_softmax(logits[k - 1][m], -1)
        total = total + (-(target * logp).sum(-1).mean()) / k_max
        acc += float((logp.argmax(-1) == target.argmax(-1)).float().mean())
        n += 1
    if n == 0:
        return None
    tokens = int(mask[1 : t_len - k_max + 1].sum())
    return total, {"l1": torch.zeros(()), "ce": total.detach(), "acc": torch.tensor(acc / n), "tokens": tokens}


def ttt_mask(t: int, k: int, device=None) -> torch.Tensor:
    """[t, k*t] bool: step k's query at position p sees step 1's keys at positions <= p-k+1 (the
    committed context) and step j's key at position p-k+j for j = 2..k (its own drafted chain),
    exactly what it sees when drafting k tokens ahead at inference."""
    p = torch.arange(t, device=device)[:, None]
    q = torch.arange(t, device=device)[None, :]
    blocks = [q <= p - k + 1] + [q == p - k + j for j in range(2, k + 1)]
    return torch.cat(blocks, dim=1)


def unroll_drafts(head, hidden, tokens, embed, steps: int):
    """Yield (k, out [t, H]) for drafting steps k = 1..steps over one sequence.

    Step 1 reads `hidden` [t, H] (features at positions 0..t-1) with tokens x_{p+1}; step k > 1 reads step
    k-1's output at position p-1, attending under `ttt_mask`. steps == 1 is the plain causal call.
    """
    t = hidden.shape[0]
    positions = torch.arange(t, device=hidden.device)
    cache = getattr(head, "module", head).new_cache() if steps > 1 else None
    for k in range(1, steps + 1):
        if k > 1:  # step k at position p continues from step k-1's prediction at p-1
            hidden = torch.cat([out[:1], out[:-1]])
        allowed = ttt_mask(t, k, hidden.device) if steps > 1 else None
        out = head(hidden[None], tokens[None], positions, embed, allowed=allowed, cache=cache)[0]
        yield k, out


def eagle3_loss(head, target_lm, embed, features, ids, mask, cfg: TrainConfig, generator=None):
    """EAGLE-3 training-time test: unroll `ttt_steps` drafting steps; step k reads step k-1's outputs.

    features [T, H + 3H]: the target's final hidden state and its three fused layers, concatenated.
    """
    core = getattr(head, "module", head)
    h_size = core.config.hidden_size
    final, layers = features[:, :h_size], features[:, h_size:]
    t = features.shape[0] - 1
    if t < 2:
        return None
    with torch.no_grad():
        weight, bias = target_lm
        p_target = torch.softmax(F.linear(final[1:], weight, bias).float(), -1)  # [t, V'] after position p+1
    hidden = core.fuse(layers[:-1])  # positions p = 0..t-1, tokens x_{p+1}
    if cfg.noise:
        noise = torch.rand(hidden.shape, generator=generator, dtype=torch.float32).to(hidden) - 0.5
        hidden = hidden + noise * cfg.noise
    tokens, positions = ids[1:], torch.arange(t, device=features.device)
    total, weights, acc = 0.0, 0.0, []
    for k, out in unroll_drafts(head, hidden, tokens, embed, cfg.ttt_steps or 3):
        valid = (positions >= k - 1) & mask[1:]
        if not valid.any():
            continue
        logp = torch.log_softmax(core.draft_logits(out[valid]).float(), -1)
        w = cfg.ttt_decay ** (k - 1)
        total = total + w * (-(p_target[valid] * logp).sum(-1).mean())
        weights += w
        acc.append((logp.argmax(-1) == p_target[valid].argmax(-1)).float().mean())
    if not acc:
        return None
    loss = total / weights
    return loss, {"l1": torch.zeros(()), "ce": loss.detach(), "acc": acc[0].detach(), "tokens": int(mask[1:].sum())}


# ---------------------------------------------------------------------------------------------
# Data order
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def _rng_state(noise_gen):
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "noise": noise_gen.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state, noise_gen):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    noise_gen.set_state(state["noise"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(folder: Path, head, optimizer, scheduler, step, counters, noise_gen, cfg, keep: int,
                    precision: str = "fp32"):
    """Write checkpoints/step-N atomically (temporary folder, then rename) and prune old ones."""
    from ..files import building, publish

    root = folder / "checkpoints"
    final = root / f"step-{step:07d}"
    with building(final) as tmp:  # also removes what a killed save left in `root`
        head.save_pretrained(tmp / "head")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step,
                    "counters": counters, "rng": _rng_state(noise_gen), "precision": precision}, tmp / "trainer.pt")
        (tmp / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
    publish(tmp, final, keep_others=False)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: Path) -> Path | None:
    found = sorted((folder / "checkpoints").glob("step-*"))
    return found[-1] if found else None


# Keys that may differ on --resume without changing the run (where and how it is written, when it stops).
NOT_RUN_DEFINING = ("out_dir", "stop_after", "save_every", "keep_checkpoints", "log_every", "eval_conversations",
                    "eval_dataset", "report_to", "device", "precision", "features_dir")


def changed_run_keys(saved: dict, cfg: TrainConfig) -> dict:
    """{key: (checkpoint's value, config's value)} for the run-defining keys that differ."""
    now = asdict(cfg)
    return {k: (saved[k], v) for k, v in now.items() if k in saved and k not in NOT_RUN_DEFINING and saved[k] != v}


def resume_point(folder: Path, target_config):
    """(checkpoint, head, trainer state, saved config) of the newest intact checkpoint, or Nones when there is none.

    A damaged checkpoint (a file cut or missing) is skipped, saying so; TrainingError when none is intact.
    """
    import pickle
    import sys

    from ..draft_heads import HeadError, load_head

    found = sorted((folder / "checkpoints").glob("step-*"), reverse=True)
    damaged = []
    for ckpt in found:
        try:
            head = load_head(ckpt / "head")
            state = torch.load(ckpt / "trainer.pt", weights_only=False)
            saved = json.loads((ckpt / "config.json").read_text())
            if not isinstance(state, dict) or not {"optimizer", "scheduler", "step", "counters", "rng"} <= set(state):
                raise ValueError("trainer.pt lacks the trainer state")
        except (HeadError, OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
            damaged.append(f"{ckpt.name} ({' '.join(str(e).split())[:160]})")
            print(f"warning: checkpoint {ckpt} is damaged ({damaged[-1]}); trying the one before it", file=sys.stderr)
            continue
        head.check_target(target_config)  # another target is a wrong run, not a damaged checkpoint
        if damaged:
            print(f"warning: resuming from {ckpt}, the newest intact checkpoint", file=sys.stderr)
        return ckpt, head, state, saved
    if damaged:
        raise TrainingError(f"no intact checkpoint in {folder / 'checkpoints'} to resume from: {'; '.join(damaged)}")
    return None, None, None, None


def apply_changes(optimizer, scheduler, cfg: TrainConfig) -> None:
    """After loading a checkpoint's optimizer and scheduler, follow the config's lr, weight decay and schedule."""
    for group in optimizer.param_groups:
        group["initial_lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    scheduler.lr_lambdas = [_lr_lambda(cfg)] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def has_assistant_text(conversations) -> bool:
    """Whether some conversation has an assistant turn with text (the loss is on assistant tokens); items that
    are not chat conversations are taken as trainable."""
    for conv in conversations:
        messages = getattr(conv, "messages", None)
        if messages is None:
            return True
        if any(m.get("role") == "assistant" and str(m.get("content") or "").strip() for m in messages):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def _sync_context(accelerator, head, micro: int, cfg: TrainConfig):
    """Gradients are all-reduced only on the last micro-batch of an optimizer step."""
    import contextlib

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
    h = core.config.hidden_size

    def loss():
        with amp():
            return _zero_forward()

    def _zero_forward():
        if core.config.head_type == "medusa":
            out = head(torch.zeros(2, h, device=device), lm_weight, lm_bias)
        else:
            hidden = core.fuse(torch.zeros(1, 2, 3 * h, device=device)) if hasattr(core, "fuse") \
                else torch.zeros(1, 2, h, device=device)
            out = head(hidden, torch.zeros(1, 2, dtype=torch.long, device=device), torch.arange(2, device=device), embed)
            out = core.draft_logits(out) if hasattr(core, "draft_logits") else out
        return out.float().sum() * 0.0

    return loss


def _lr_lambda(cfg: TrainConfig):
    def f(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


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


def train(cfg: TrainConfig, resume: bool = False, model_and_tokenizer=None, conversations=None, progress=True,
          allow_changes: bool = False):
    """Train an EAGLE head; returns (head, summary dict). `model_and_tokenizer`/`conversations` are for tests.

    A resume refuses a config whose run-defining keys differ from the checkpoint's, unless `allow_changes`
    (then the new values apply from the checkpoint's step on)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from ..draft_heads import Eagle3Head, EagleHead, MedusaHead, build_draft_vocab
    from ..target import checked_device, load_target

    out = Path(cfg.out_dir)  # made once the run's inputs are read, so a refused run leaves no empty folder
    if cfg.device:
        checked_device(cfg.device)  # a CUDA device on a machine without one is an error, not a CPU run
    if not cfg.features_dir and conversations is None:
        conversations = training_conversations(cfg)  # a bad dataset fails before the target is loaded
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
        from .features import FeatureStore

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

    ckpt, head, state, saved_cfg = resume_point(out, model.config) if resume else (None,) * 4
    changes = changed_run_keys(saved_cfg, cfg) if ckpt is not None else {}
    if ckpt is not None:
        head = head.train()
        if head.config.head_type != cfg.head_type:  # no flag changes this
            raise TrainingError(f"checkpoint {ckpt} holds a {head.config.head_type!r} head but the config asks for "
                                f"head_type {cfg.head_type!r}")
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
        if cfg.head_type == "medusa":
            head = MedusaHead.for_target(model.config, draft_tokens, num_heads=cfg.medusa_heads)
        elif cfg.head_type == "eagle3":
            head = Eagle3Head.for_target(model, draft_tokens)
        else:
            head = EagleHead.for_target(model.config, draft_tokens, fc_bias=cfg.fc_bias)
    head = head.to(device).train()
    embed = model.get_input_embeddings()
    lm = model.get_output_embeddings()
    rows = head.d2t.to(device) if head.config.draft_vocab_size else None
    lm_weight = lm.weight.detach() if rows is None else lm.weight.detach()[rows]
    lm_bias = None if getattr(lm, "bias", None) is None else (lm.bias.detach() if rows is None else lm.bias.detach()[rows])

    fused_layers = getattr(head, "fused_layers", None)
    if fused_layers and store is not None:
        raise TrainingError("EAGLE-3 heads train on online features (the feature cache holds the last layer only)")
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    noise_gen = torch.Generator().manual_seed(cfg.seed + 17 + accelerator.process_index)
    step, counters = 0, {"tokens": 0, "skipped": 0, "truncated": 0, "dropped": 0}
    if ckpt is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if changes:
            apply_changes(optimizer, scheduler, cfg)
            accelerator.print(f"resuming with changed keys: {', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in changes.items())}")
        step, counters = state["step"], state["counters"]
        _set_rng_state(state["rng"], noise_gen)
        if state.get("precision", precision) != precision:  # (checkpoints before the precision key record none)
            warnings.warn(f"{ckpt} was trained in {state['precision']} and continues in {precision} (precision="
                          f"{cfg.precision!r} on this machine): the run will not match a straight {state['precision']} "
                          "run exactly; pass precision=... to keep it", stacklevel=2)
        accelerator.print(f"resumed from {ckpt} at step {step}")
    out.mkdir(parents=True, exist_ok=True)
    head, optimizer = accelerator.prepare(head, optimizer)
    if log_with:
        accelerator.init_trackers("eagletree", config=asdict(cfg))

    world, rank = accelerator.num_processes, accelerator.process_index
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
    dummy_loss = _dummy_loss(head, embed, lm_weight, lm_bias, device, amp)
    bar = tqdm(total=cfg.steps, initial=step, desc="train", disable=not (progress and accelerator.is_main_process))
    t0, tokens0 = time.perf_counter(), counters["tokens"]
    last_ckpt = ckpt
    history, written = [], 0
    history_path = out / "history.jsonl"
    if accelerator.is_main_process:
        _keep_history(history_path, step)  # a fresh run starts it empty; a resumed one redoes the steps after its checkpoint
    end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
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
                    feats = _target_features(model, ids, fused_layers)
            # Noise seeded by the global micro-batch index: the same whatever the process count or resumes.
            noise_gen.manual_seed(cfg.seed * 1_000_003 + index)
            with amp():
                objective = {"medusa": medusa_loss, "eagle3": eagle3_loss}.get(cfg.head_type, eagle_loss)
                result = objective(head, (lm_weight, lm_bias), embed, feats.float(), ids, loss_mask, cfg, noise_gen)
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
        if accelerator.sync_gradients and cfg.clip:
            accelerator.clip_grad_norm_(params, cfg.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        # Sum over processes, so the logged numbers are those of the global batch.
        totals = torch.tensor([stats[k] for k in ("loss", "l1", "ce", "acc", "n")], dtype=torch.float64, device=device)
        if world > 1:
            totals = accelerator.reduce(totals, reduction="sum")
        n = max(float(totals[4]), 1.0)
        record = {k: float(v) / n for k, v in zip(("loss", "l1", "ce", "acc"), totals[:4])} | {
            "lr": scheduler.get_last_lr()[0], "step": step}
        history.append(record)
        elapsed = time.perf_counter() - t0
        record["tokens_per_s"] = (counters["tokens"] - tokens0) * world / max(elapsed, 1e-9)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.2f}", tok_s=f"{record['tokens_per_s']:.0f}")
        if log_with and step % cfg.log_every == 0:
            accelerator.log(record, step=step)
        if step % cfg.save_every == 0 or step == end:
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                # history first: a kill between the two leaves records past the checkpoint, which a resume drops
                written = _append_history(history_path, history, written)
                last_ckpt = save_checkpoint(out, accelerator.unwrap_model(head), optimizer, scheduler, step, counters,
                                            noise_gen, cfg, cfg.keep_checkpoints, precision)
    bar.close()
    if counters["tokens"] == 0 and step > 0:
        raise TrainingError(f"dataset {cfg.dataset!r}: {step} steps saw no assistant token to train on "
                            f"({counters['skipped']} conversations skipped, {counters['dropped']} dropped as longer "
                            f"than max_len={cfg.max_len}); no head was saved")
    head = accelerator.unwrap_model(head).eval()
    if accelerator.is_main_process:
        head.save_pretrained(out / "head")
        _append_history(history_path, history, written)
    if log_with:
        accelerator.end_training()
    summary = {"steps": step, **counters, "final": history[-1] if history else None}
    return head, summary


def _keep_history(path: Path, step: int) -> None:
    """Rewrite history.jsonl (atomically) with only the records of steps <= `step`."""
    lines = path.read_text().splitlines() if path.is_file() else []
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut by a kill
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _append_history(path: Path, history: list, written: int) -> int:
    """Append the records not yet written; returns how many are written now."""
    if written < len(history):
        with open(path, "a") as f:
            f.write("".join(json.dumps(h) + "\n" for h in history[written:]))
            f.flush()
            os.fsync(f.fileno())
    return len(history)


def _initial_head(cfg: TrainConfig, target_config):
    """The head named by `init_head`, in fp32 for training; it must suit the config and the target."""
    from ..draft_heads import HeadError, load_head

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
    size = head.config.draft_vocab_size or 0
    if cfg.draft_vocab and cfg.draft_vocab != size:
        keep = f"set draft_vocab={size} or 0" if size else "set draft_vocab=0"
        over = f"{size} tokens" if size else "the full vocabulary"
        raise TrainingError(f"init_head {cfg.init_head!r} drafts over {over} but the config asks for "
                            f"draft_vocab={cfg.draft_vocab}; {keep} to keep the head's")
    head.source_dir = None  # a new head: the old one's calibration.json does not describe it
    return head


def on_cpu(device: str | None) -> bool:
    """Whether a run asked for `device` (None: the default) runs on the CPU."""
    return (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")


def resolve_precision(precision: str, cpu: bool) -> str:
    """'auto' -> 'bf16' on CUDA and on CPUs that multiply bf16 natively, else 'fp32'."""
    from ..target import cpu_has_bf16

    if precision != "auto":
        return precision
    return "bf16" if not cpu or cpu_has_bf16() else "fp32"


def _target_features(model, ids, fused_layers=None):
    """[T, H] post-norm features, or [T, H + 3H] with the fused layers' outputs appended (EAGLE-3)."""
    if not fused_layers:
        return model.get_decoder()(input_ids=ids[None]).last_hidden_state[0]
    states = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    return torch.cat([states[-1][0]] + [states[i + 1][0] for i in fused_layers], dim=-1)


def training_conversations(cfg: TrainConfig):
    """The training side of the held-out split, cut to max_conversations."""
    from .data import load_dataset, split

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_convs, _ = split(load_dataset(cfg.dataset), cfg.heldout_fraction)
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
    ids = [tok.eos_token_id, tok.bos_token_id, tok.pad_token_id]
    return [i for i in ids if i is not None]

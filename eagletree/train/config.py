"""The training run's settings: defaults, a YAML file, key=value overrides, all checked; the lr schedule and the
precision they resolve to on this machine."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import yaml

from ..draft import head_class, head_types
from ..errors import EagletreeError
from ..target import cpu_has_bf16


class TrainingError(EagletreeError, RuntimeError):
    """Training cannot go on (bad loss, bad config); the message names the step or key."""


@dataclass
class TrainConfig:
    target: str = "smollm2-135m"
    head_type: str = "eagle"  # "eagle" (EAGLE-1/2), "eagle3", "medusa" or "dflash" (a block drafter)
    # training-time test: drafting steps unrolled per position (step k reads step k-1's predicted features);
    # 0 = the head type's default: 3 for eagle3, 1 (the original one-step objective) for eagle
    ttt_steps: int = 0
    ttt_decay: float = 0.8  # weight of step k is ttt_decay ** (k - 1)
    medusa_heads: int = 4
    # block (dflash) heads: the block's size k (the root and k-1 drafted tokens), its draft layers, the blocks
    # trained per sequence, the decay of the loss over a block's positions (0: the anchors' choice for k), and the
    # target token embedded at masked positions (-1: the target's pad token, else its BOS)
    block_size: int = 8
    draft_layers: int = 2  # (one layer cannot mix the root with the context before its attention reads it)
    block_anchors: int = 16
    block_gamma: float = 0.0
    mask_token_id: int = -1
    fc_bias: bool = False  # EAGLE-1/2 fc bias; vLLM's EAGLE loader has none
    dataset: str = "sharegpt"
    eval_dataset: str = ""  # held-out conversations and prompts for evaluation; "" = dataset's own held-out split
    init_head: str = ""  # start from this saved head's weights (fine-tuning, e.g. on distilled answers); "" = fresh
    # with init_head: train it over the target's whole vocabulary (its draft vocabulary widened: DraftHead.widen_vocab)
    widen_vocab: bool = False
    # a fresh EAGLE-1/2 head starts as a copy of the target's last decoder layer, its fc passing the feature through
    init_from_target: bool = False
    heldout_fraction: float = 0.04
    max_conversations: int = 0  # 0 = all training conversations
    max_len: int = 512
    long: str = "truncate"  # or "drop": what to do with conversations longer than max_len
    features_dir: str = ""  # "" = online features; else a cache written by `eagletree features`
    feature_dtype: str = "bf16"  # of cached features: bf16, fp16 or fp32
    # features_dir: its shards dealt into this many groups (shard i to group i mod N), micro-batch b reading group
    # b mod N, so that each of N processes reads only its own shards; 0 = one group per process
    feature_groups: int = 0
    draft_vocab: int = 0  # 0 = the full target vocabulary; else the V' most frequent tokens
    draft_vocab_sample: int = 2000  # conversations counted to pick the draft vocabulary
    steps: int = 1000  # optimizer steps (the schedule's length)
    stop_after: int = 0  # stop (with a checkpoint) after this many steps; 0 = run to `steps`; resume later
    grad_accum: int = 4
    # conversations per micro-batch, padded into one target pass and (eagle, eagle3) one head call per drafting step;
    # the optimizer step's global batch is grad_accum x micro_batch x processes conversations, in the same order
    micro_batch: int = 1
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
    # fp32 weights; faster where bf16 is native: docs/results.md, "Training speed"), else fp32. Only applies to a
    # target this run loads.
    precision: str = "auto"

    @classmethod
    def from_sources(cls, path=None, overrides=()) -> TrainConfig:
        """Defaults, then a YAML file, then key=value overrides; an unknown key is an error listing valid keys."""
        defaults = cls()
        values = _read_values(path, overrides, defaults)
        _check_types(values, defaults)
        _check_ranges(values)
        _check_choices(values, defaults)
        return cls(**values)


def _read_values(path, overrides, defaults: TrainConfig) -> dict:
    """The keys a YAML file (`path`, optional) and then key=value `overrides` set, not yet checked."""
    valid = {f.name for f in fields(defaults)}
    values = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise TrainingError(f"config file {str(path)!r} cannot be read ({e})") from e
        except yaml.YAMLError as e:
            raise TrainingError(f"config file {str(path)!r} is not valid YAML: {' '.join(str(e).split())}") from e
        if loaded is None:  # (an empty file, or comments only: every key would be its default, unasked)
            raise TrainingError(
                f"config file {str(path)!r} sets no key (empty, or comments only); give TrainConfig keys "
                "(key: value lines), or leave --config out to train on the defaults"
            )
        if not isinstance(loaded, dict):
            raise TrainingError(f"{path}: expected a mapping of config keys, got {type(loaded).__name__}")
        values.update(loaded)
    for item in overrides:
        if "=" not in item:
            raise TrainingError(f"override {item!r} must look like key=value")
        key, raw = item.split("=", 1)
        # a text key takes the text as written (`init_head=` clears it; `out_dir=2024` stays a name)
        try:
            values[key] = raw if key in valid and isinstance(getattr(defaults, key), str) else yaml.safe_load(raw)
        except yaml.YAMLError:
            values[key] = raw  # not YAML: the type check below names the key and the value
    return values


def _check_types(values: dict, defaults: TrainConfig) -> None:
    """Every key is a config key, of its default's type (a whole number or a number in text is taken as a float
    where one is expected: `values` is updated)."""
    valid = {f.name for f in fields(defaults)}
    unknown = sorted(set(values) - set(valid), key=str)  # (a YAML key may be a number)
    if unknown:
        raise TrainingError(f"unknown config keys {unknown}; valid keys: {sorted(valid)}")
    for key, value in values.items():
        kind = type(getattr(defaults, key))
        if kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
            try:  # YAML reads 1e-4 (no dot) as text: take every number float() takes
                values[key] = value = float(value)
            except ValueError:
                raise TrainingError(f"config key {key!r} must be a number, got {value!r}") from None
            if not math.isfinite(value):
                raise TrainingError(f"config key {key!r} must be a finite number, got {value!r}")
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise TrainingError(f"config key {key!r} must be {kind.__name__}, got {value!r}")


def _check_ranges(values: dict) -> None:
    """Each key's value is one it can take."""
    kinds = head_types()
    if values.get("head_type", "eagle") not in kinds:
        listed = ", ".join(repr(k) for k in kinds[:-1]) + f" or {kinds[-1]!r}"
        raise TrainingError(f"head_type must be {listed}, got {values['head_type']!r}")
    positive = (
        *("steps", "grad_accum", "save_every", "keep_checkpoints", "log_every", "max_len", "medusa_heads"),
        *("draft_layers", "block_anchors", "micro_batch"),
    )
    for key in positive:
        if key in values and isinstance(values[key], int) and values[key] < 1:
            raise TrainingError(f"config key {key!r} must be >= 1, got {values[key]}")
    ranges = {
        "lr": (0.0, False),
        "weight_decay": (0.0, True),
        "noise": (0.0, True),
        "clip": (0.0, True),
        "l1_weight": (0.0, True),
        "ce_weight": (0.0, True),
        "ttt_decay": (0.0, False),
        "warmup_steps": (0, True),
        "max_conversations": (0, True),
        "draft_vocab": (0, True),
        "draft_vocab_sample": (1, True),
        "feature_groups": (0, True),
        "eval_conversations": (1, True),
        "stop_after": (0, True),
        "seed": (0, True),
        "block_size": (2, True),
        "block_gamma": (0.0, True),
        "mask_token_id": (-1, True),
    }
    for key, (low, inclusive) in ranges.items():
        if key in values and (values[key] < low if inclusive else values[key] <= low):
            raise TrainingError(f"config key {key!r} must be {'>=' if inclusive else '>'} {low}, got {values[key]}")
    if "min_lr_ratio" in values and not 0.0 <= values["min_lr_ratio"] <= 1.0:
        raise TrainingError(f"config key 'min_lr_ratio' must be in [0, 1], got {values['min_lr_ratio']}")
    if "heldout_fraction" in values and not 0.0 < values["heldout_fraction"] < 1.0:
        raise TrainingError(
            f"config key 'heldout_fraction' must be in (0, 1): the held-out conversations are "
            f"never trained on and evaluation needs some, got {values['heldout_fraction']}"
        )
    for key in ("out_dir", "dataset", "target"):
        if key in values and not str(values[key]).strip():
            expected = {
                "out_dir": "the run's folder",
                "dataset": "'sharegpt', a data file or several joined by commas",
                "target": "a target alias, HF model folder or .gguf file",
            }[key]
            raise TrainingError(f"config key {key!r} is empty; expected {expected}")
    if values.get("ttt_steps", 0) < 0:
        raise TrainingError(
            f"config key 'ttt_steps' must be >= 0 (0 = the head type's default), got {values['ttt_steps']}"
        )
    if values.get("feature_dtype", "bf16") not in ("bf16", "fp16", "fp32"):
        raise TrainingError(f"feature_dtype must be bf16, fp16 or fp32, got {values['feature_dtype']!r}")
    if values.get("precision", "auto") not in ("auto", "bf16", "fp32"):
        raise TrainingError(f"precision must be 'auto', 'bf16' or 'fp32', got {values['precision']!r}")


def _check_choices(values: dict, defaults: TrainConfig) -> None:
    """The keys that depend on one another agree (where the head starts, its vocabulary, what its type reads), and
    the keys naming a choice name a known one."""
    kind = head_class(values.get("head_type", "eagle"))
    if values.get("init_from_target") and not kind.starts_from_target:
        starts = [k for k in head_types() if head_class(k).starts_from_target]
        raise TrainingError(
            f"init_from_target starts a head from the target's last layer, which {', '.join(map(repr, starts))} "
            f"heads can; head_type is {values['head_type']!r}"
        )
    if values.get("init_from_target") and values.get("init_head"):
        raise TrainingError(
            f"init_from_target and init_head {values['init_head']!r} both say where the head starts: set one"
        )
    if values.get("widen_vocab") and not values.get("init_head"):
        raise TrainingError(
            "widen_vocab widens the draft vocabulary of init_head's head: set init_head (a fresh "
            "head drafts over the full vocabulary with draft_vocab=0)"
        )
    if values.get("widen_vocab") and not kind.widens_vocab:
        raise TrainingError(
            f"widen_vocab: a {kind.head_type!r} head scores tokens with its own lm_head over its draft "
            "vocabulary, so it cannot be widened; drop widen_vocab"
        )
    if values.get("widen_vocab") and values.get("draft_vocab"):
        raise TrainingError(
            f"widen_vocab trains over the full vocabulary, but draft_vocab is "
            f"{values['draft_vocab']}: set draft_vocab=0"
        )
    head_type = kind.head_type
    others = [k for name in head_types() for k in head_class(name).own_train_keys if k not in kind.own_train_keys]
    not_read = tuple(dict.fromkeys((*kind.ignored_train_keys, *others)))
    ignored = [
        k
        for k in not_read
        if k in values and values[k] != getattr(defaults, k) and not (k == "noise" and values[k] == 0)
    ]  # no noise: what such a head does anyway
    if ignored:
        raise TrainingError(
            f"{', '.join(f'{k}={values[k]!r}' for k in ignored)}: "
            f"{'has' if len(ignored) == 1 else 'have'} no effect on {head_type!r} heads "
            f"({_why_ignored(kind, ignored)}); remove "
            f"{'it' if len(ignored) == 1 else 'them'} from the config"
        )
    if values.get("report_to", "wandb") not in ("wandb", "none"):
        raise TrainingError(f"report_to must be 'wandb' or 'none', got {values['report_to']!r}")
    if values.get("long", "truncate") not in ("truncate", "drop"):
        raise TrainingError(f"long must be 'truncate' or 'drop', got {values['long']!r}")


def _why_ignored(kind, keys: list[str]) -> str:
    """Why a head of `kind` ignores `keys`: the keys it never reads, and whose keys the others are."""
    reasons = [f"it ignores {', '.join(kind.ignored_train_keys)}"] if set(keys) & set(kind.ignored_train_keys) else []
    for key in keys:
        owners = [repr(name) for name in head_types() if key in head_class(name).own_train_keys]
        if owners and key not in kind.ignored_train_keys:
            reasons.append(f"{key} is a key of {' and '.join(owners)} heads")
    return "; ".join(reasons)


def lr_lambda(cfg: TrainConfig):
    """The learning-rate factor at each optimizer step: linear warm-up, then cosine down to min_lr_ratio."""

    def f(step):
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def on_cpu(device: str | None) -> bool:
    """Whether a run asked for `device` (None: the default) runs on the CPU."""
    return (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")


def resolve_precision(precision: str, cpu: bool) -> str:
    """'auto' -> 'bf16' on CUDA and on CPUs that multiply bf16 natively, else 'fp32'."""
    if precision != "auto":
        return precision
    return "bf16" if not cpu or cpu_has_bf16() else "fp32"

"""What every draft head shares: its config (with the target's identity), save/load, target checks."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from os import PathLike
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import EagletreeError, InvalidType
from ..files import building, publish
from ..target import target_identity
from .vocab import check_draft_vocab

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
_REGISTRY: dict[str, type] = {}  # head_type -> DraftHead subclass, filled by the package (draft/__init__.py)


class HeadError(EagletreeError, ValueError):
    """A head that does not fit its target, or files that cannot be loaded."""


def rope_base(config) -> float | None:
    """A config's RoPE base (`rope_theta`, in transformers-5 `rope_parameters` or at the top level; a config
    object or a saved dict), or None when it has one per layer type or none."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    params = get("rope_parameters")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = get("rope_theta") if theta is None else theta
    return float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else None


@dataclass
class HeadConfig:
    head_type: str  # the class that loads it: "eagle" (EAGLE-1/2), "eagle3" or "medusa"
    hidden_size: int
    target: dict  # target_identity() of the target it was built for
    layer_config: dict  # the target's config with one layer (to rebuild the decoder layer)
    draft_vocab_size: int | None = None  # None: the full target vocabulary
    fc_bias: bool = True
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FeatureSpec:
    """The target features a head reads at each position: the target's post-norm last hidden state (`layers` None),
    or the outputs of the decoder `layers` (0-based) concatenated in that order, which the head fuses itself."""

    hidden_size: int
    layers: tuple[int, ...] | None = None

    @property
    def width(self) -> int:
        """Features per position the head's drafter takes: H, or H per fused layer."""
        return self.hidden_size * (len(self.layers) if self.layers else 1)

    def from_states(self, hidden_states) -> torch.Tensor:
        """[..., width] from a target pass's `hidden_states` (embeddings first, the post-norm last state last)."""
        if not self.layers:
            return hidden_states[-1]
        return torch.cat([hidden_states[i + 1] for i in self.layers], dim=-1)

    @property
    def training_width(self) -> int:
        """Features per position training reads: the post-norm last hidden state, then the fused layers' outputs."""
        return self.hidden_size + (self.width if self.layers else 0)

    def training_features(self, model, ids: torch.Tensor) -> torch.Tensor:
        """[T, training_width] for one sequence ids [T]: what a head trains on (online, or cached offline)."""
        if not self.layers:
            return model.get_decoder()(input_ids=ids[None]).last_hidden_state[0]
        states = model.get_decoder()(input_ids=ids[None], output_hidden_states=True).hidden_states
        return torch.cat([states[-1][0], self.from_states(states)[0]], dim=-1)

    def training_features_batch(self, model, ids: list) -> list:
        """`training_features` of several sequences ids [T_i] in one target pass, right-padded: under causal
        attention no real token sees the padding after it, and position ids count from 0 as alone, so no padding
        mask is passed (the target keeps its fast causal attention path). [T_i, width] each."""
        if len(ids) == 1:
            return [self.training_features(model, ids[0])]
        lengths = [int(x.numel()) for x in ids]
        batch = ids[0].new_zeros(len(ids), max(lengths))
        for row, x in enumerate(ids):
            batch[row, : lengths[row]] = x
        out = model.get_decoder()(input_ids=batch, output_hidden_states=bool(self.layers))
        if self.layers:
            full = torch.cat([out.hidden_states[-1], self.from_states(out.hidden_states)], dim=-1)
        else:
            full = out.last_hidden_state
        return [full[row, :n] for row, n in enumerate(lengths)]


@dataclass(frozen=True)
class Drafting:
    """What a head's drafter does in one decoding step, for the loop, the searches and their cost rules.

    A step's drafting costs `catch_up` head calls on the tokens the last verify pass accepted, then per tree
    level searched `level_calls` calls (a drafter that drafts a whole block of levels in one call has
    level_calls 0 and block_calls 1)."""

    max_depth: int | None = None  # the deepest level it drafts (None: as deep as asked)
    follows_drafts: bool = True  # a level reads the head's own prediction at its parent, so a chain can be followed
    batched: bool = False  # its batch drafter drafts several sequences' levels in one head call
    catch_up: int = 1  # head calls a step makes on the accepted tokens before the tree
    level_calls: int = 1  # head calls per tree level
    block_calls: int = 0  # head calls a step makes for all its levels at once (a block drafter, in its `extend`)

    def calls(self, levels: int) -> int:
        """Head calls of a step that searches `levels` tree levels (the root's own level included)."""
        return self.catch_up + self.block_calls + self.level_calls * max(levels - 1, 0)


def register_head(cls: type) -> type:
    """Make `cls` the class that loads saved heads of its `head_type`."""
    if not cls.head_type:
        raise HeadError(f"{cls.__name__} sets no head_type, so saved heads cannot name it")
    _REGISTRY[cls.head_type] = cls
    return cls


def head_types() -> list[str]:
    """The registered head types, sorted."""
    return sorted(_REGISTRY)


def head_class(head_type: str):
    """The DraftHead subclass for a saved head_type."""
    if head_type not in _REGISTRY:
        raise HeadError(f"unknown head_type {head_type!r}; known: {head_types()}")
    return _REGISTRY[head_type]


class DraftHead(nn.Module):
    """Base of the draft heads: `config` is a HeadConfig; subclasses set `head_type` and the methods below.

    Everything that differs between kinds of head (how it is made for a training run, its objective, the
    target features it reads, its drafter) is a method here, so training and decoding never ask which kind
    a head is.
    """

    head_type = ""
    # Training: the TrainConfig keys its model and objective never read (a run that sets one is refused; with the
    # keys other kinds own), the keys only it reads, whether a
    # fresh head can start from the target's last layer (init_from_target), whether it can draft over the target's
    # whole vocabulary (widen_vocab: it scores tokens with the target's lm_head).
    ignored_train_keys: tuple[str, ...] = ()
    own_train_keys: tuple[str, ...] = ()  # TrainConfig keys only this kind reads (every other kind ignores them)
    starts_from_target = False
    widens_vocab = True
    folder: Path | None = None  # the folder the head was loaded from, where its companion files live; None: built here
    widened = False  # `widen_vocab` made it draft over the target's whole vocabulary
    _lm_slice = None  # the drafter's cached rows of the target's lm_head (drafter.sliced_lm_head), with their key

    @classmethod
    def create(cls, target_model, cfg, draft_tokens: torch.Tensor | None = None) -> DraftHead:
        """A freshly initialized head for a training run: `cfg` is the run's TrainConfig."""
        raise NotImplementedError(f"{cls.__name__} does not define create()")

    @classmethod
    def new(cls, target_model, draft_tokens: torch.Tensor | None = None) -> DraftHead:
        """A head of this kind in its default shape with fresh weights (profiles, checks), over `draft_tokens` or the
        target's whole vocabulary."""
        raise NotImplementedError(f"{cls.__name__} does not define new()")

    def training_loss(self, module, target_lm, embed, features, ids, mask, cfg, generator=None):
        """(loss, parts) of the training objective on one sequence, or None when it has nothing to learn from.

        `module` is this head or the wrapper to call it through (DDP, for the gradient sync); `features` is
        what `target_features` returned; parts: l1, ce, acc (step 1's) and tokens.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define training_loss()")

    def batch_loss(self, module, target_lm, embed, batch: list, cfg, generators: list) -> list:
        """[(loss, parts) or None] of the training objective on each sequence of a packed micro-batch `batch`
        [(features, ids, mask)], sequence i's randomness drawn from `generators[i]` as `training_loss` alone draws
        it. This default calls `training_loss` per sequence; a head whose objective batches overrides it."""
        return [
            self.training_loss(module, target_lm, embed, features, ids, mask, cfg, generator)
            for (features, ids, mask), generator in zip(batch, generators)
        ]

    def dummy_loss(self, module, embed, lm_weight, lm_bias, device) -> torch.Tensor:
        """0 x a tiny forward through every parameter (through `module`), for a skipped micro-batch."""
        raise NotImplementedError(f"{type(self).__name__} does not define dummy_loss()")

    @property
    def feature_spec(self) -> FeatureSpec:
        """The target features this head reads (decoding's passes, training, offline features, evaluation ask it)."""
        return FeatureSpec(self.config.hidden_size)

    @classmethod
    def check_config(cls, config: HeadConfig) -> None:
        """HeadError when a saved config cannot build a head of this kind (read before any weights)."""

    @classmethod
    def feature_spec_for(cls, target_config, cfg=None) -> FeatureSpec:
        """The features a new head of this kind (`create`, with the run's TrainConfig `cfg` where given) reads for
        this target: what an offline cache must hold."""
        return FeatureSpec(target_config.hidden_size)

    @property
    def drafting(self) -> Drafting:
        """What this head's drafter does per step (depth, calls, batching)."""
        return Drafting()

    def target_features(self, model, ids: torch.Tensor) -> torch.Tensor:
        """The target's features the head trains on for one sequence ids [T]: [T, H] post-norm last hidden state,
        then (for a head reading fused layers) those layers' outputs (`FeatureSpec.training_features`)."""
        return self.feature_spec.training_features(model, ids)

    def target_features_batch(self, model, ids: list) -> list:
        """`target_features` of several sequences [T_i] in one target pass (a packed micro-batch)."""
        return self.feature_spec.training_features_batch(model, ids)

    def make_drafter(self, target_model):
        """The `Drafter` (draft/drafter.py) that drafts trees with this head."""
        raise NotImplementedError(f"{type(self).__name__} does not define make_drafter()")

    def make_batch_drafter(self, target_model):
        """The batch drafter (draft/batch_drafter.py) for several sequences: one `make_drafter` drafter per
        row unless the head drafts a batch in one call."""
        from .batch_drafter import PerRowDrafter

        return PerRowDrafter(self, target_model)

    def set_draft_vocab(self, draft_tokens: torch.Tensor) -> None:
        check_draft_vocab(draft_tokens, self.config.target["vocab_size"])
        self.d2t = draft_tokens.to(self.d2t.device, torch.long).clone()
        self.config.draft_vocab_size = int(draft_tokens.numel())

    def drafted_vocab_size(self) -> int:
        """How many tokens the head drafts over now: its draft vocabulary, or the target's whole one (widened)."""
        return int(self.config.draft_vocab_size or self.config.target["vocab_size"])

    def is_widened(self) -> bool:
        """Whether `widen_vocab` made this head draft over more tokens than the draft vocabulary it was saved with."""
        return self.widened

    def has_own_lm_head(self) -> bool:
        """Whether the head scores tokens with an lm_head of its own (EAGLE-3; Medusa with own_lm_head), not the
        target's."""
        return False

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target features the head reads [m, H] from what decoding hands it (EAGLE-3 fuses several layers)."""
        return features

    def companion_file(self, name: str) -> Path | None:
        """The file `name` saved next to the head (e.g. calibration.json), or None when there is none."""
        path = None if self.folder is None else self.folder / name
        return path if path is not None and path.is_file() else None

    def can_widen_vocab(self) -> bool:
        """Whether `widen_vocab` would add tokens: a draft vocabulary, scored with the target's lm_head."""
        return self.config.draft_vocab_size is not None and not self.has_own_lm_head()

    def widen_vocab(self) -> DraftHead:
        """Draft over the target's whole vocabulary instead of the head's draft vocabulary (in place; returns self).

        A head that predicts features and reads the target's lm_head (EAGLE-1/2, Medusa without lm_heads of
        its own) can score every target token, not only the V' it was trained on: tokens outside its draft
        vocabulary become draftable, at V/V' the lm_head's cost per drafting level. A head with its own
        lm_head over its draft vocabulary (EAGLE-3) has no rows for the other tokens and is refused.
        """
        if self.has_own_lm_head():
            size = self.config.draft_vocab_size or self.config.target["vocab_size"]
            raise HeadError(
                f"a {self.head_type} head scores tokens with its own lm_head ({size} rows), so it cannot "
                "draft over the target's full vocabulary (--draft-vocab full, widen_vocab=true); "
                "keep its own (--draft-vocab head or auto)"
            )
        self.d2t = torch.arange(self.config.target["vocab_size"], device=self.d2t.device)
        self.config.draft_vocab_size = None
        self.widened = True
        self.__dict__.pop("_lm_slice", None)  # a cached lm_head slice of the narrower vocabulary
        return self

    def check_target(self, target_config) -> None:
        """Raise HeadError naming both values when the target is not the one this head was built for."""
        check_head_target(self.config, target_config)

    # -- persistence --------------------------------------------------------------------------

    def save_pretrained(self, directory, dtype=None, keep_others: bool = False, replace: bool = True) -> None:
        """Write config.json + model.safetensors atomically (a temporary folder, then rename); an existing
        folder is replaced as a whole, or with `keep_others` only these two files are; replace=False: the folder
        must still be absent or empty when it is written (`files.publish`)."""
        directory = Path(directory)
        state = {
            k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
            for k, v in self.state_dict().items()
        }
        with building(directory) as tmp:
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt", "eagletree": "head"})
            (tmp / CONFIG).write_text(json.dumps(asdict(self.config), indent=2, default=str))
        publish(tmp, directory, keep_others=keep_others, replace=replace)

    @classmethod
    def from_pretrained(cls, directory, target_config=None, dtype=None, device=None) -> DraftHead:
        """Load a saved head; with `target_config`, refuse a head built for another target."""
        directory = Path(directory)
        config = read_head_config(directory, target_config)
        try:
            state = load_file(str(directory / WEIGHTS))
        except (SafetensorError, OSError, ValueError) as e:
            raise HeadError(f"{directory / WEIGHTS} is truncated or corrupted ({e}); nothing was loaded") from e
        head = head_class(config.head_type)(config)
        expected = head.state_dict()
        missing, unexpected = set(expected) - set(state), set(state) - set(expected)
        bad_shape = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
        if missing or unexpected or bad_shape:
            raise HeadError(
                f"{directory / WEIGHTS} does not match its config: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}, wrong shape {sorted(bad_shape)}"
            )
        if "d2t" in state:
            head.d2t = state["d2t"].clone()
        head.load_state_dict(state)
        head.folder = directory
        head = head.to(device=device) if device is not None else head
        if dtype is not None:
            head = head.to(dtype)
        return head.eval()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def read_head_config(directory, target_config=None) -> HeadConfig:
    """The HeadConfig of a saved head folder, read without its weights; HeadError naming the folder or file when
    it is not a head folder, or (with `target_config`) when the head was built for another target."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HeadError(f"{str(directory)!r} is not a head folder: no such folder (expected {CONFIG} and {WEIGHTS})")
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise HeadError(f"{str(directory)!r} is not a head folder: expected {CONFIG} and {WEIGHTS}")
    try:
        config = HeadConfig(**json.loads((directory / CONFIG).read_text()))
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
        raise HeadError(f"{directory / CONFIG} is not a valid head config: {e}") from e
    try:
        head_class(config.head_type).check_config(config)
    except HeadError as e:
        raise HeadError(f"{directory / CONFIG}: {e}") from e
    if target_config is not None:
        check_head_target(config, target_config)
    return config


def check_loaded(head) -> None:
    """InvalidType unless `head` is a loaded DraftHead or None (a folder's path is loaded first)."""
    if head is not None and not isinstance(head, DraftHead):
        hint = (
            "load a head folder with eagletree.loading.load_head(path, target.config)"
            if isinstance(head, (str, PathLike))
            else "pass a DraftHead, or None to decode without one"
        )
        raise InvalidType(f"head must be a loaded DraftHead or None, got {type(head).__name__} {head!r:.60}; {hint}")


def check_head_target(config: HeadConfig, target_config) -> None:
    """HeadError naming both values when the head of `config` was built for another target than `target_config`."""
    mine, theirs = config.target, target_identity(target_config)
    for key in ("model_type", "hidden_size", "vocab_size", "fingerprint"):
        if mine[key] != theirs[key]:
            raise HeadError(
                f"head was trained for a target with {key} = {mine[key]!r}, but this target has {key} = {theirs[key]!r}"
            )
    # The fingerprint predates transformers 5, where the RoPE base moved into rope_parameters; the head's
    # layer config records it.
    head_base, target_base = rope_base(config.layer_config), rope_base(target_config)
    if head_base is not None and target_base is not None and head_base != target_base:
        raise HeadError(
            f"head was trained for a target with rope_theta = {head_base!r}, "
            f"but this target has rope_theta = {target_base!r}"
        )

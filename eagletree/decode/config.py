"""Decoding options in one place: `DecodeConfig` (tree, budget, depth, top-k, `Sampling`, `CopyOptions`).

The config is validated once, when it is built; the library (`Decoder`, `generate`) and the command line
(`DecodeConfig.from_args`) share its defaults and its rules, so no other layer checks a decoding option.
A budget of None means "chosen by device" (`default_budget`): 60 nodes on a GPU, where a pass over 60 nodes
is expected to cost about a one-token pass (EAGLE-2's setting), and 8 on a CPU; with the default tree, `auto`,
the budget is a ceiling and trees are drafted only while they beat a plain one-token pass on this machine.
`hf_generation_config` sets transformers' `generate` to the plain decoding that eagletree's is compared against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path

from ..errors import EagletreeError, InvalidType, InvalidValue

MIN_TEMPERATURE = 1e-20  # a sampling temperature below this turns float32 logits / T into inf (then NaN)
GPU_BUDGET, CPU_BUDGET = 60, 8


class TreeKind(str, Enum):
    """The tree a step verifies: searched per step (dynamic) or a fixed shape (static)."""

    EAGLE2 = "eagle2"  # EAGLE-2's dynamic tree: the budget's best nodes found by a beam of top-k per level
    OPTIMAL = "optimal"  # the exact best budget nodes under the same drafter
    CHAIN = "chain"  # one drafted run
    SEQUOIA = "sequoia"  # Sequoia's static shape (or given rank paths)
    AUTO = "auto"  # the cost-aware tree: the optimal tree's prefix that pays on this device, or none

    @property
    def static(self) -> bool:
        """A fixed shape: copied spans cannot be grafted into it."""
        return self in (TreeKind.CHAIN, TreeKind.SEQUOIA)

    @classmethod
    def parse(cls, value) -> TreeKind:
        """The kind named `value`, or OptionError listing the kinds."""
        try:
            return cls(value)
        except ValueError:
            raise OptionError("tree", f"must be one of {TREE_KINDS}, got {value!r}") from None

    def __str__(self) -> str:
        return self.value


TREE_KINDS = tuple(kind.value for kind in TreeKind)


class OptionError(EagletreeError, ValueError):
    """A decoding option outside its range; `option` is its Python name (the CLI names the flag instead)."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option} {problem}")
        self.option, self.problem = option, problem

    def for_cli(self) -> InvalidValue:
        """The same error naming the command-line flag (`--max-new-tokens`) instead of the keyword."""
        return InvalidValue(f"{CLI_FLAGS.get(self.option, self.option)} {self.problem}")


# keyword -> the flag that sets it
CLI_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "budget": "--budget",
    "depth": "--depth",
    "top_k_draft": "--top-k-draft",
    "seed": "--seed",
    "tree": "--tree",
}
# name: (kind, smallest, largest, may be None); "> 0" marks a float range whose lower end is exclusive
_RANGES = {
    "max_new_tokens": (int, 0, None, False),
    "temperature": (float, 0.0, None, False),
    "top_k": (int, 0, None, True),
    "top_p": (float, "> 0", 1.0, True),
    "budget": (int, 1, None, True),
    "depth": (int, 1, None, False),
    "top_k_draft": (int, 1, None, False),
    "seed": (int, 0, 2**64 - 1, True),
}


def check_option(name: str, value) -> None:
    """Raise OptionError for a numeric decoding option outside its range."""
    kind, low, high, optional = _RANGES[name]
    if value is None and optional:
        return
    ok_type = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok_type or (kind is float and not math.isfinite(value)):
        raise OptionError(name, f"must be {'a finite number' if kind is float else 'an integer'}, got {value!r}")
    if (low == "> 0" and value <= 0) or (low != "> 0" and value < low) or (high is not None and value > high):
        lower = "> 0" if low == "> 0" else f">= {low}"
        where = f"{lower} and <= {high}" if high is not None else lower
        raise OptionError(
            name, f"must be {where}, got {value!r}" + (" (0 = no top-k filter)" if name == "top_k" else "")
        )
    if name == "temperature" and 0 < value < MIN_TEMPERATURE:
        raise OptionError(
            name,
            f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {value!r}: below that, logits "
            "divided by it overflow float32 (use 0 for greedy decoding)",
        )


def check_options(cli: bool = False, **options) -> None:
    """Raise ValueError for a decoding option outside its range, named as given (`cli`: as its --flag)."""
    try:
        for name, value in options.items():
            check_option(name, value)
    except OptionError as e:
        raise (e.for_cli() if cli else e) from None


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: temperature 0 is greedy; top_k / top_p filter as HF's `generate` does (None: off)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # fixes the draws (with a searched tree whose shape does not follow live timings)

    def __post_init__(self):
        for f in fields(self):
            check_option(f.name, getattr(self, f.name))

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (temperature 0)."""
        return self.temperature == 0


@dataclass(frozen=True)
class CopyOptions:
    """Copied spans of earlier text as extra tree candidates, and a corpus (datastore) copied from too.

    enabled None: on for the searched trees (eagle2, optimal, auto), off for the fixed shapes. `datastore`:
    "auto" = the head folder's datastore.npz when it has one, None = none, a TokenStore, or a file's path.
    """

    enabled: bool | None = None
    spans: int = 3  # copied spans per step
    length: int = 64  # the most tokens a copied span drafts
    datastore: object = "auto"

    def __post_init__(self):
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise OptionError("copy", f"must be True, False or None (the tree's default), got {self.enabled!r}")
        for name, value in (("copy_spans", self.spans), ("copy_len", self.length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise OptionError(name, f"must be an integer >= 1, got {value!r}")
        store = self.datastore
        if not (store is None or store == "auto" or isinstance(store, (str, Path)) or _is_token_store(store)):
            raise OptionError("store", f"must be 'auto', None, a TokenStore or a datastore file's path, got {store!r}")


def _is_token_store(value) -> bool:
    from ..search.store import TokenStore  # (torch: not needed to parse a command line)

    return isinstance(value, TokenStore)


@dataclass(frozen=True)
class DecodeConfig:
    """Everything a decoding run is asked to do, checked once here.

    tree: a TreeKind (or its name); budget: tree nodes per target pass, root included (None: by device,
    `default_budget`); depth: the deepest drafted level; top_k_draft: candidates expanded per drafted node;
    stop: extra stop tokens (ids, or strings of one token each); tree_paths: the rank paths of a fixed
    Sequoia shape; accept_by_rank: the per-rank acceptance Sequoia's shape is built for; truncate_prompt:
    keep a too-long prompt's last tokens instead of refusing it.
    """

    tree: TreeKind = TreeKind.AUTO
    budget: int | None = None
    depth: int = 6
    top_k_draft: int = 10
    max_new_tokens: int = 128
    sampling: Sampling = field(default_factory=Sampling)
    copy: CopyOptions = field(default_factory=CopyOptions)
    stop: tuple | None = None
    tree_paths: tuple | None = None
    accept_by_rank: tuple | None = None
    truncate_prompt: bool = False

    def __post_init__(self):
        object.__setattr__(self, "tree", TreeKind.parse(self.tree))  # (a frozen dataclass normalizing a field)
        for name in ("budget", "depth", "top_k_draft", "max_new_tokens"):
            check_option(name, getattr(self, name))
        if not isinstance(self.sampling, Sampling) or not isinstance(self.copy, CopyOptions):
            raise InvalidType(
                f"sampling must be a Sampling and copy a CopyOptions, got {type(self.sampling).__name__} "
                f"and {type(self.copy).__name__}"
            )
        if self.copy.enabled and self.tree.static:
            raise OptionError(
                "copy=True",
                f"needs a searched tree (eagle2, optimal or auto); tree={self.tree.value!r} is a fixed shape",
            )
        if self.copy.datastore not in ("auto", None) and not self.copies:
            raise OptionError(
                "store",
                "adds retrieved spans to the copied ones, so it needs copying on (copy=True, or "
                "the default copy=None with an eagle2, optimal or auto tree); copying is off here",
            )
        if self.stop is not None:
            object.__setattr__(self, "stop", _stop_tuple(self.stop))
        if self.tree_paths is not None:
            self._check_tree_paths()

    def _check_tree_paths(self) -> None:
        from ..search.static import choices_shape  # (torch: not needed to parse a command line)

        if self.tree is not TreeKind.SEQUOIA:
            raise OptionError("tree_paths", f"gives the fixed shape of tree='sequoia', got tree={self.tree.value!r}")
        nodes = len(choices_shape(self.tree_paths).parents)  # (checks the paths)
        object.__setattr__(self, "tree_paths", tuple(tuple(p) for p in self.tree_paths))
        if self.budget is not None and nodes > self.budget:
            raise OptionError(
                "tree_paths", f"make a tree of {nodes} nodes with the root, more than budget={self.budget}"
            )

    @property
    def copies(self) -> bool:
        """Whether copied spans are drafted: as asked, else on for the searched trees."""
        return not self.tree.static if self.copy.enabled is None else self.copy.enabled

    def for_device(self, device) -> DecodeConfig:
        """This config with the budget chosen for `device` ("cuda", "cpu" or a torch.device) when it is None."""
        return self if self.budget is not None else replace(self, budget=default_budget(device))

    @classmethod
    def from_options(cls, **options) -> DecodeConfig:
        """A config from keyword options: its own fields, or the flat names `generate` takes (temperature, top_k,
        top_p, seed; copy=True/False/None, copy_spans, copy_len, store)."""
        sampling = {k: options.pop(k) for k in ("temperature", "top_k", "top_p", "seed") if k in options}
        copy = {
            new: options.pop(old)
            for old, new in (
                ("copy", "enabled"),
                ("copy_spans", "spans"),
                ("copy_len", "length"),
                ("store", "datastore"),
            )
            if old in options and not isinstance(options[old], CopyOptions)
        }
        if sampling:
            options["sampling"] = replace(options.get("sampling", Sampling()), **sampling)
        if copy:
            options["copy"] = replace(options.get("copy", CopyOptions()), **copy)
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidType(
                f"unknown decoding option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; known: "
                f"{', '.join(OPTION_NAMES)}"
            )
        return cls(**options)

    @classmethod
    def from_args(cls, args) -> DecodeConfig:
        """The config a command's parsed flags ask for (errors name the flags). `--head none` decodes plainly
        unless `--copy on` asks for copied spans alone; `--datastore` must name an existing file."""
        copy = {"on": True, "off": False}.get(args.copy)
        if copy is None and args.head == "none":
            copy = False
        store = {"auto": "auto", "none": None}.get(args.datastore, args.datastore)
        try:
            if args.copy == "on" and TreeKind.parse(args.tree).static:
                raise InvalidValue(
                    f"--copy on needs a searched tree (--tree eagle2, optimal or auto); --tree {args.tree} "
                    "is a fixed shape"
                )
            if store not in ("auto", None) and (copy is False or TreeKind.parse(args.tree).static):
                raise InvalidValue(
                    f"--datastore {store} adds retrieved spans to the copied ones; it needs copying on "
                    f"(--copy auto or on with --tree eagle2, optimal or auto; with --head none, --copy on),"
                    f" not --copy {args.copy} --tree {args.tree}" + (" --head none" if args.head == "none" else "")
                )
            if store not in ("auto", None) and not Path(store).is_file():
                what = "a folder" if Path(store).is_dir() else "no such file"
                raise InvalidValue(
                    f"--datastore {store!r}: {what}; expected auto, none, or the file `eagletree datastore` made "
                    "(datastore.npz, in a head's folder by default)"
                )
            if args.max_new_tokens < 1:  # (the Python API returns an empty answer for 0)
                raise OptionError("max_new_tokens", f"must be >= 1, got {args.max_new_tokens}")
            return cls(
                tree=args.tree,
                budget=args.budget,
                depth=args.depth,
                top_k_draft=args.top_k_draft,
                max_new_tokens=args.max_new_tokens,
                sampling=Sampling(args.temperature, args.top_k, args.top_p, args.seed),
                copy=CopyOptions(enabled=copy, datastore=store),
            )
        except OptionError as e:
            raise e.for_cli() from None


OPTION_NAMES = tuple(f.name for f in fields(DecodeConfig)) + (
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "copy_spans",
    "copy_len",
    "store",
)


def default_budget(device) -> int:
    """Tree nodes per pass when none is given: 60 on a GPU (EAGLE-2's setting, where a pass over 60 nodes is
    expected to cost about a one-token pass), 8 elsewhere (on a CPU a pass's cost grows with its nodes:
    docs/results.md). With tree `auto` this is a ceiling: auto keeps the prefix that pays on this machine's
    measured latency profile, down to the root alone (plain decoding) where no tree pays."""
    kind = device if isinstance(device, str) else getattr(device, "type", str(device))
    return GPU_BUDGET if kind.split(":")[0] == "cuda" else CPU_BUDGET


def _stop_tuple(stop) -> tuple:
    if isinstance(stop, (str, int)) or not isinstance(stop, (list, tuple, set)):
        raise InvalidType(f"stop must be a list of token ids or token strings, got {stop!r}")
    return tuple(stop)


def hf_generation_config(max_new_tokens: int, temperature: float, eos_token_id, top_k=None, top_p=None, **extra):
    """A transformers GenerationConfig for plain decoding as eagletree decodes: every logits-shaping value set
    (`generate` fills the unset ones from the model's own generation_config, where a repetition_penalty or a
    top_k would make "plain decoding" another decoder than the one compared against)."""
    from transformers import GenerationConfig

    sample = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        do_sample=sample,
        temperature=temperature if sample else 1.0,
        top_k=(top_k or 0) if sample else 50,
        top_p=(top_p or 1.0) if sample else 1.0,
        typical_p=1.0,
        min_p=None,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        **extra,
    )

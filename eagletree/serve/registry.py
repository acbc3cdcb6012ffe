"""The serving engines `eagletree plan` writes settings for, by name: each engine's module (vllm.py, sglang.py,
eagle.py) makes an `Engine` that says whether it drafts a tree or a chain, over which vocabulary, and its settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InvalidValue

_ENGINES: dict[str, Engine] = {}  # in registration order (`plan --engine` lists them so)


@dataclass(frozen=True)
class Engine:
    """A serving engine as `plan` sees it.

    `chain`: it drafts one token per level (no token tree), so its plan is the best chain. `full_vocab`: it scores
    an export whose head reads the target's lm_head over the target's whole vocabulary (it reads no token map), so
    plan measures such a head widened. `settings(plan, export_dir, eagle3, draft_vocab, export_format)`: the
    engine's own configuration for the plan's tree, the head exported to `export_dir` (`eagle3`: a head that fuses
    target layers; `draft_vocab`: the head has a draft vocabulary; `export_format`: the format it was exported in).
    `formats`: the export formats it loads, preferred first (a head is exported in the first that takes its kind:
    `format_for`). `measured_costs`: its plan comes from the engine's own measured costs (`plan --profile`,
    eagletree/plan_llamacpp.py), not from eagletree's latency profile.
    """

    name: str
    chain: bool
    full_vocab: bool
    settings: Callable[..., dict]
    formats: tuple[str, ...] = ()
    measured_costs: bool = False

    def format_for(self, head_type: str) -> str:
        """The export format this engine loads a `head_type` head in; ValueError when none of its formats takes it."""
        from ..export import formats_taking

        taking = [f for f in self.formats if f in formats_taking(head_type)]
        if not taking:
            raise InvalidValue(
                f"{self.name} loads {', '.join(self.formats)} exports, none of which takes {head_type!r} heads"
            )
        return taking[0]


def register(engine: Engine) -> Engine:
    """Make `engine` one `plan --engine` takes."""
    _ENGINES[engine.name] = engine
    return engine


def engine_names() -> tuple[str, ...]:
    """The registered engines, in registration order."""
    return tuple(_ENGINES)


def engine(name: str) -> Engine:
    """The engine called `name`; ValueError naming the engines for another name."""
    if name not in _ENGINES:
        raise InvalidValue(f"engine must be one of {engine_names()}, got {name!r}")
    return _ENGINES[name]

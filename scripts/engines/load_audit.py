"""Auditing one load of an export by an engine's own loader: which checkpoint tensor reached which parameter, what
was never loaded, skipped or of the wrong shape, and whether RoPE, fused layers and draft token ids are the head's."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .standins import RopeRecorder


@dataclass
class Audit:
    """What one engine did with one export."""

    engine: str
    export: str
    model_class: str = "-"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        status = "ok" if not self.problems else f"{len(self.problems)} problem(s)"
        lines = [f"[{self.engine}] {self.export}: {self.model_class}: {status}"]
        lines += [f"    {n}" for n in self.notes] + [f"    PROBLEM {p}" for p in self.problems]
        return "\n".join(lines)


@dataclass
class Export:
    """An export folder and what the head it came from expects of an engine."""

    folder: Path
    fmt: str  # "sglang" (EAGLE-1/2) or "eagle3"
    layers: list[int] | None  # EAGLE-3: the target layers whose outputs the head fuses
    draft_ids: list[int] | None  # the target id of each draft token; None: the full vocabulary


class LoadRecorder:
    """Wraps every parameter's weight_loader to record which checkpoint tensor reached which parameter.

    Floating parameters are filled with NaN first, so a parameter the loader never (or only partly) wrote
    still holds NaN afterwards. Parameters without a weight_loader get `default_loader`, the engine's own
    default_weight_loader, which is what the engine's `getattr(param, "weight_loader", default_weight_loader)`
    falls back to. A shape mismatch is recorded and the load goes on (the engine would stop at the first)."""

    def __init__(self, model: nn.Module, state: dict[str, torch.Tensor], default_loader):
        self.by_pointer = {t.data_ptr(): name for name, t in state.items()}
        self.reached: set[str] = set()  # checkpoint names that reached some parameter
        self.written: set[int] = set()  # ids of parameters written
        self.mismatches: list[str] = []
        for name, param in model.named_parameters():
            if param.is_floating_point():
                param.data.fill_(math.nan)
            param.weight_loader = self._wrap(name, getattr(param, "weight_loader", default_loader))

    def _wrap(self, param_name, loader):
        def recording_loader(param, loaded_weight, *args, **kwargs):
            source = self.by_pointer.get(loaded_weight.data_ptr(), "<a tensor not in the checkpoint>")
            self.reached.add(source)
            try:
                loader(param, loaded_weight, *args, **kwargs)
            except AssertionError as e:
                self.mismatches.append(f"{source} -> {param_name}: {e}")
                return
            self.written.add(id(param))

        return recording_loader


def audit_load(
    audit: Audit, model: nn.Module, state: dict, load, default_loader, dropped: dict[str, str], after_load=None
):
    """Run the engine's `load` over `state`, then `after_load` (the engine's own sharing of target weights); record
    in `audit` unloaded parameters, skipped tensors and shape mismatches. `dropped`: checkpoint names the engine's
    code consumes without a weight_loader, with where (never reported as skipped)."""
    recorder = LoadRecorder(model, state, default_loader)
    before = {id(p): name for name, p in model.named_parameters()}
    try:
        load(iter(state.items()))
    except Exception as e:  # noqa: BLE001 the engine's loader raising is itself the finding: reported
        audit.problems.append(f"the engine's load_weights raised {type(e).__name__}: {e}")
        return
    audit.problems += [f"shape mismatch: {m}" for m in recorder.mismatches]
    skipped = [n for n in state if n not in recorder.reached and not any(d in n for d in dropped)]
    if skipped:
        audit.problems.append(f"checkpoint tensors the engine skipped: {skipped}")
    if after_load is not None:
        try:
            after_load()
        except Exception as e:  # noqa: BLE001 reported as the finding
            audit.problems.append(f"the engine's sharing of the target's weights raised {type(e).__name__}: {e}")
            return
    shared, missing = [], []
    after = dict(model.named_parameters(remove_duplicate=False))
    shared += [f"{name} (now a plain tensor)" for name in before.values() if name not in after]
    shared += [name for name, param in after.items() if id(param) not in before]
    for name, param in model.named_parameters():
        if id(param) not in before:
            continue
        if param.is_floating_point() and torch.isnan(param).any():
            left = int(torch.isnan(param).sum())
            missing.append(name if left == param.numel() else f"{name} ({left} of {param.numel()} values)")
        elif not param.is_floating_point() and id(param) not in recorder.written:
            missing.append(name)
    if missing:
        audit.problems.append(f"parameters never loaded: {missing}")
    audit.notes.append(
        f"{len(state)} tensors -> {len(recorder.written)} parameters"
        + (f"; taken from the target after loading: {shared}" if shared else "")
        + (f"; consumed otherwise: {sorted(d for d in dropped if any(d in n for n in state))}" if dropped else "")
    )


def check_rope(audit: Audit, rope: RopeRecorder, theta: float):
    if not rope.bases:
        audit.problems.append("no RoPE was built")
    elif any(abs(b - theta) > 1e-6 * theta for b in rope.bases):
        audit.problems.append(f"RoPE base {rope.bases}, the target's is {theta}")
    else:
        audit.notes.append(f"RoPE base {rope.bases[0]:g} (the target's)")


def check_fused(audit: Audit, captured: list[int], head_layers: list[int], how: str):
    if sorted(captured) != sorted(head_layers):
        audit.problems.append(
            f"fuses the outputs of target layers {captured} ({how}); the head was trained on {sorted(head_layers)}"
        )
    else:
        audit.notes.append(f"fuses the outputs of target layers {captured} ({how})")


def check_vocab(audit: Audit, ids: torch.Tensor | None, expected: list[int] | None, how: str):
    """The target id the engine gives each draft token must be the head's."""
    if expected is None:
        return
    if ids is None:
        audit.problems.append(f"the engine has no draft-to-target map ({how}); the head drafts {len(expected)} tokens")
    elif ids.long().tolist() != expected:
        audit.problems.append(f"the engine maps draft tokens to other target ids than the head ({how})")
    else:
        audit.notes.append(f"draft token i -> target id as the head's, for all {len(expected)} ({how})")


def drop_rule(source: str, name: str, origin: str) -> dict[str, str]:
    """A checkpoint name the engine's code drops on purpose (`if "name" in name: continue`), confirmed in its source."""
    if not re.search(rf'if "{name}" in name:\s*\n\s*continue', source):
        raise SystemExit(f"error: {origin} no longer skips {name!r} the way this script expects; re-read it")
    return {name: origin}

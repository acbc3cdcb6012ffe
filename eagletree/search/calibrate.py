"""Calibration: map draft confidence to the acceptance actually seen, so predicted tokens/pass is right.

Logged pairs (draft probability of a tried node, accepted?) fit a monotone map: isotonic
regression (scipy) or temperature scaling of the confidence's log-odds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InvalidValue
from ..verify import DraftTree

METHODS = ("identity", "isotonic", "temperature")


def acceptance_pairs(tree: DraftTree, accepted: list[int]) -> tuple[list[float], list[bool]]:
    """(draft prob, accepted?) for every node that was tried: its parent is on the accepted path."""
    on_path = set(accepted)
    probs, hits = [], []
    for v, u in enumerate(tree.parents.tolist()[1:], start=1):
        if u in on_path:
            probs.append(float(tree.draft_probs[v]))
            hits.append(v in on_path)
    return probs, hits


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class Calibrator:
    method: str = "identity"
    xs: list[float] = field(default_factory=list)  # isotonic knots (draft prob, ascending)
    ys: list[float] = field(default_factory=list)  # acceptance at each knot
    scale: float = 1.0  # temperature method: sigmoid(scale * logit(q) + bias)
    bias: float = 0.0

    def __post_init__(self):
        if self.method not in METHODS:
            raise InvalidValue(f"calibration method {self.method!r} is not one of {METHODS}")

    def check(self) -> None:
        """Raise ValueError unless the fitted numbers make a calibration (as `fit` writes them)."""
        if self.method == "isotonic":
            xs, ys = self.xs, self.ys
            if not (isinstance(xs, list) and isinstance(ys, list) and xs and len(xs) == len(ys)):
                raise InvalidValue(f"isotonic needs equally many knots xs and ys (> 0), got {xs!r} and {ys!r}")
            if not all(_number(v) and 0.0 <= v <= 1.0 for v in xs + ys) or xs != sorted(xs):
                raise InvalidValue("isotonic knots must be numbers in [0, 1], xs ascending")
        elif self.method == "temperature":
            if not all(_number(v) and math.isfinite(v) for v in (self.scale, self.bias)):
                raise InvalidValue(f"temperature needs finite scale and bias, got {self.scale!r} and {self.bias!r}")

    @classmethod
    def fit(cls, probs, accepted, method: str = "isotonic") -> Calibrator:
        q = np.asarray(probs, dtype=np.float64)
        y = np.asarray(accepted, dtype=np.float64)
        if q.size == 0 or q.shape != y.shape:
            raise InvalidValue(f"need equally many probabilities and outcomes (> 0), got {q.size} and {y.size}")
        if method == "identity":
            return cls("identity")
        if method == "isotonic":
            from scipy.optimize import isotonic_regression  # only fitting needs scipy, not applying a calibration

            order = np.argsort(q, kind="stable")
            fitted = isotonic_regression(y[order], increasing=True).x
            # Collapse equal x to one knot so interpolation is a function.
            xs, idx = np.unique(q[order], return_index=True)
            ys = np.array([fitted[i:j].mean() for i, j in zip(idx, list(idx[1:]) + [q.size])])
            return cls("isotonic", xs.tolist(), ys.tolist())
        if method == "temperature":
            from scipy.optimize import minimize

            z = np.log(np.clip(q, 1e-9, 1 - 1e-9)) - np.log1p(-np.clip(q, 1e-9, 1 - 1e-9))

            def loss(params):
                a = 1.0 / (1.0 + np.exp(-(params[0] * z + params[1])))
                a = np.clip(a, 1e-12, 1 - 1e-12)
                return -np.mean(y * np.log(a) + (1 - y) * np.log1p(-a))

            res = minimize(loss, x0=[1.0, 0.0], method="Nelder-Mead")
            return cls("temperature", scale=float(res.x[0]), bias=float(res.x[1]))
        raise InvalidValue(f"calibration method {method!r} is not one of {METHODS}")

    def __call__(self, q) -> torch.Tensor:
        """Estimated acceptance probability for draft probabilities q (any shape)."""
        q = torch.as_tensor(q, dtype=torch.float64)
        if self.method == "identity":
            return q
        if self.method == "isotonic":
            out = np.interp(q.cpu().numpy(), *self._knots())
            return torch.as_tensor(out, dtype=torch.float64, device=q.device)
        qc = q.clamp(1e-9, 1 - 1e-9)
        return torch.sigmoid(self.scale * (qc.log() - (-qc).log1p()) + self.bias)

    def _knots(self) -> tuple[np.ndarray, np.ndarray]:
        """The isotonic knots as arrays, made once (a fitted head's calibration has thousands of knots, and
        converting the lists cost more than the interpolation, at every search); remade when the lists are replaced."""
        key = (id(self.xs), id(self.ys), len(self.xs), len(self.ys))
        cached = self.__dict__.get("_arrays")
        if cached is None or cached[0] != key:
            cached = (key, np.asarray(self.xs, dtype=np.float64), np.asarray(self.ys, dtype=np.float64))
            self.__dict__["_arrays"] = cached
        return cached[1], cached[2]

    def expected_tokens(self, tree: DraftTree) -> float:
        """Predicted tokens per pass: 1 + sum over nodes of the product of calibrated acceptance."""
        a = self(tree.draft_probs).clamp(1e-30, 1.0)
        a[0] = 1.0
        products = torch.exp(tree.ancestors().double() @ a.log())
        return float(products[1:].sum()) + 1.0


def calibration_report(steps, calibrator: Calibrator) -> dict:
    """Predicted vs measured tokens/pass over logged steps [(tree, accepted node list)], raw and calibrated."""
    if not steps:
        raise InvalidValue("no logged steps to report on")
    measured = float(np.mean([len(acc) for _, acc in steps]))  # accepted nodes incl. root = tokens emitted
    raw = float(np.mean([tree.expected_tokens for tree, _ in steps]))
    calibrated = float(np.mean([calibrator.expected_tokens(tree) for tree, _ in steps]))
    return {
        "steps": len(steps),
        "measured_tokens_per_pass": measured,
        "predicted_raw": raw,
        "predicted_calibrated": calibrated,
        "error_raw": raw / measured - 1.0,
        "error_calibrated": calibrated / measured - 1.0,
        "method": calibrator.method,
    }

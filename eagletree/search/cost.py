"""Cost-aware budget: pick the tree size that maximizes tokens per second, not tokens per pass.

E[tokens](N) grows with the budget N while the verify pass t(N) grows too (slowly on a GPU, fast
on a CPU); drafting costs per depth level. The profile is measured on the running device
(`eagletree.verify.profile.measure_profile`) and cached as JSON.
"""

from __future__ import annotations

import bisect
import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from ..errors import InvalidValue
from ..files import write_json_atomic


def _interpolate(xs: list[float], ys: list[float], n) -> torch.Tensor:
    """ys at n (a number or a tensor), piecewise linear in xs (ascending); beyond the last x the last slope goes
    on. A number is interpolated on the host (the search asks once or twice a step, and each small tensor operation
    costs more), in the float64 arithmetic the tensor path does."""
    if isinstance(n, numbers.Real):
        n = float(n)
        if len(xs) == 1:
            return torch.tensor(float(ys[0]) * n / xs[0], dtype=torch.float64)
        i = min(max(bisect.bisect_left(xs, min(n, xs[-1])), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], float(ys[i - 1]), float(ys[i])
        return torch.tensor(y0 + (n - x0) * (y1 - y0) / (x1 - x0), dtype=torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    xt, yt = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    if xt.numel() == 1:
        return yt[0] * n / xt[0]
    i = torch.searchsorted(xt, n.clamp(max=xs[-1])).clamp(1, xt.numel() - 1)
    x0, x1, y0, y1 = xt[i - 1], xt[i], yt[i - 1], yt[i]
    return y0 + (n - x0) * (y1 - y0) / (x1 - x0)


def read_profile_json(path):
    """The JSON of a latency profile file, or a ValueError that says what the file is instead (missing, a folder,
    binary or not JSON) and what a profile file is."""
    path = Path(path)
    what = "a LatencyProfile JSON (cached under $EAGLETREE_CACHE/profiles) or `eagletree profile`'s profile.json"
    if not path.is_file():
        raise InvalidValue(
            f"latency profile {str(path)!r}: {'a folder' if path.is_dir() else 'no such file'}; expected {what}"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InvalidValue(f"latency profile {str(path)!r} is not text (a binary file?); expected {what}") from None
    except json.JSONDecodeError as e:
        raise InvalidValue(f"latency profile {str(path)!r} is not JSON ({e}); expected {what}") from None
    except OSError as e:
        raise InvalidValue(f"cannot read latency profile {str(path)!r}: {e.strerror or e}") from None


@dataclass
class LatencyProfile:
    sizes: list[int]  # node counts N measured, ascending
    verify_s: list[float]  # seconds of one verify pass (mask + forward + accept + commit) at each N
    draft_s_per_level: float = 0.0  # seconds of one drafter call (one depth level)
    # seconds of the head calls a drafted step makes besides its levels' (its catch-up on the accepted tokens: the
    # head's `Drafting`), 0 where they are counted as one more level (auto's live estimate)
    draft_s_per_step: float = 0.0
    search_s_per_level: float = 0.0  # seconds of tree-search bookkeeping per level
    device: str = "cpu"
    model: str = ""
    notes: dict = field(default_factory=dict)
    # batch size (as a string: JSON keys) -> seconds of one ragged pass of that many sequences with `sizes[i]`
    # nodes each (batch x sizes[i] rows), for the sizes measured (a prefix of `sizes`)
    batch_verify_s: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.sizes) != len(self.verify_s) or not self.sizes:
            raise InvalidValue(f"profile needs one time per size, got sizes {self.sizes} and times {self.verify_s}")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise InvalidValue(f"profile sizes must be distinct, ascending and >= 1, got {self.sizes}")

    def verify(self, n) -> torch.Tensor:
        """t_verify(n), piecewise linear in n; beyond the last size the last slope continues."""
        return _interpolate([float(x) for x in self.sizes], self.verify_s, n)

    def batch_time(self, batch: int, rows) -> torch.Tensor:
        """Seconds of one pass verifying `rows` nodes of `batch` sequences: t(rows) for one sequence; else from
        the measured batch size nearest to `batch` (by ratio), piecewise linear in rows (the last slope goes on)."""
        if batch == 1 or not self.batch_verify_s:
            return self.verify(rows)
        measured = min(self.batch_verify_s, key=lambda b: abs(math.log(int(b) / batch)))
        times = self.batch_verify_s[measured]
        return _interpolate([float(int(measured) * n) for n in self.sizes[: len(times)]], times, rows)

    def has_batch(self, batch: int) -> bool:
        return batch == 1 or str(batch) in self.batch_verify_s

    def step_time(self, n, depth) -> torch.Tensor:
        """Seconds of one decoding step: drafting (its catch-up, where depth > 0) and searching `depth` levels, then
        verifying n nodes."""
        drafting = depth * (self.draft_s_per_level + self.search_s_per_level) + (self.draft_s_per_step if depth else 0)
        return drafting + self.verify(n)

    def save(self, path) -> None:
        """Write atomically (temporary file, then rename)."""
        write_json_atomic(path, asdict(self))

    @classmethod
    def from_measurements(cls, medians: dict[int, dict[str, float]], **info) -> LatencyProfile:
        """From `eagletree.verify.profile.measure_verify` output (greedy acceptance)."""
        sizes = sorted(medians)
        verify = [sum(medians[n][c] for c in ("mask", "forward", "accept", "commit")) for n in sizes]
        return cls(sizes, verify, **info)

    @classmethod
    def load_or_measure(cls, path, measure) -> LatencyProfile:
        """The cached profile at `path`, or `measure()` saved there for next time."""
        if Path(path).is_file():
            return cls.load(path)
        profile = measure()
        profile.save(path)
        return profile

    @classmethod
    def load(cls, path) -> LatencyProfile:
        data = read_profile_json(path)
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not {"sizes", "verify_s"} <= data.keys() or data.keys() - known:
            found = f"keys {', '.join(sorted(data)[:6])}" if isinstance(data, dict) else type(data).__name__
            raise InvalidValue(
                f"{str(path)!r} is not a latency profile: expected a JSON object of "
                f"{', '.join(f.name for f in fields(cls))} (sizes and verify_s required), got {found}"
            )
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise InvalidValue(f"latency profile {str(path)!r}: {e}") from None


def choose_budget(values: torch.Tensor, profile: LatencyProfile, depth: int, max_budget: int | None = None):
    """Best N for one step given the candidate node values (any order) of a tree drafted to `depth`.

    Returns (budget, expected tokens, expected tokens per second). Budget counts the root.
    """
    v = torch.sort(values.double().flatten(), descending=True).values
    v = v[torch.isfinite(v)]
    if max_budget is not None:
        v = v[: max_budget - 1]
    expected = 1.0 + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(v, 0)])  # N = 1..len+1
    n = torch.arange(1, expected.numel() + 1)
    rate = expected / profile.step_time(n, depth)
    best = int(rate.argmax())
    return best + 1, float(expected[best]), float(rate[best])


def choose_batch(
    values: list[torch.Tensor],
    profile: LatencyProfile,
    levels: int,
    max_nodes: int | None = None,
    fixed: float = 0.0,
    others: int = 0,
):
    """Nodes per sequence for one pass of a batch, by the rate rule of `choose_budget`: expected tokens over the
    step's seconds, drafting `levels` batched levels and a pass costing `profile.batch_time(batch, rows)`.

    One sequence: its best nodes (`choose_budget`'s choice). Several: a ragged pass's attention is padded to its
    largest tree (every sequence's queries are computed in an [S, n_max] block), so a pass with trees of at most
    m nodes costs about a pass of m nodes per sequence, the size the profile measured; at that cost every
    sequence takes its best m - 1 candidates, and the rule picks m. values: each sequence's candidate node
    values, best first; `fixed`: seconds any pass with drafted nodes costs on top (the copied spans' lookups);
    max_nodes: the most nodes of the pass; `others`: sequences in the same pass without candidates (one row and one
    token each). Returns (nodes per sequence of `values`, roots included; expected tokens of the pass; expected
    tokens per second).
    """
    batch = len(values) + others
    per_level = profile.draft_s_per_level + profile.search_s_per_level
    if batch == 1:
        return _choose_one(values[0], profile, levels * per_level, max_nodes, fixed)
    else:
        sums = [
            torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(v.double()[torch.isfinite(v)], 0)])
            for v in values
        ]
        widest = max(s.numel() for s in sums)  # m - 1 drafted nodes per sequence at most
        if max_nodes is not None:
            widest = max(min(widest, (max_nodes - others) // len(values)), 1)
        expected = torch.tensor(
            [batch + sum(float(s[min(m, s.numel() - 1)]) for s in sums) for m in range(widest)], dtype=torch.float64
        )
        rows = len(values) * torch.arange(1, widest + 1) + others
    cost = levels * per_level + profile.batch_time(batch, rows) + fixed * (rows > batch)
    rate = expected / cost
    best = int(rate.argmax())
    counts = [1 + min(best, s.numel() - 1) for s in sums]
    return counts, float(expected[best]), float(rate[best])


def _choose_one(values: torch.Tensor, profile: LatencyProfile, drafting: float, max_nodes, fixed: float):
    """`choose_batch` for one sequence, on host lists (asked every step; a tree has tens of candidates, and each
    small tensor operation costs more than the Python it replaces): its best nodes, by the same rule."""
    v = sorted((x for x in values.double().flatten().tolist() if math.isfinite(x)), reverse=True)
    if max_nodes is not None:
        v = v[: max(max_nodes - 1, 0)]
    expected, total = [1.0], 0.0
    for x in v:
        total += x
        expected.append(1.0 + total)
    times = profile.verify(torch.arange(1, len(expected) + 1)).tolist()
    rate = [e / (drafting + t + (fixed if n else 0.0)) for n, (e, t) in enumerate(zip(expected, times))]
    best = max(range(len(rate)), key=rate.__getitem__)  # (the first of equal rates, as argmax)
    return [best + 1], expected[best], rate[best]


def choose_depth_and_budget(expected: dict[tuple[int, int], float], profile: LatencyProfile):
    """From measured E[tokens/pass] per (depth, budget), the pair with the most tokens per second."""
    if not expected:
        raise InvalidValue("no (depth, budget) measurements to choose from")
    rate = {k: e / float(profile.step_time(k[1], k[0])) for k, e in expected.items()}
    best = max(rate, key=rate.get)
    return best, rate[best]

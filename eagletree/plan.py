"""`eagletree plan`: the best static tree for a head on a device, written as a serving engine's configuration.

1. Acceptance by depth and rank, measured on held-out prompts: the target answers greedily; at every
   position of its answer the head drafts a chain along the true tokens (depth d reads the head's own
   features of depths < d, exactly as when it drafts that path in a tree), and the rank of each true
   token in the head's draft distribution is recorded until one falls outside the top-k. A static tree
   accepts, at a position, 1 + the length of the longest prefix of that rank path among its nodes.
2. So a tree's expected tokens per pass is 1 + the sum over its nodes of how often the true rank path
   passes through the node (measured, no independence between depths assumed; `accept[d][r]`, the
   per-depth acceptance Sequoia's DP takes, is reported too). Those frequencies never grow along a path,
   so the best tree of N nodes and depth <= D is the N - 1 most frequent paths; the latency profile
   gives a step's time t(N, D), and the plan is the (N, D) with the most tokens per second. Its
   prediction is the tokens per pass of decoding the measured answers with it (a pass starts where the
   last one ended, as in `generate`, rather than at every position).
3. The engine's configuration (`eagletree.serve`, one module per engine): vLLM 0.33 drafts chains only (its
   SpeculativeConfig has no token tree), so its plan is the best chain; SGLang (steps, top-k, draft tokens)
   and EAGLE (total_token, depth, top_k) build EAGLE-2 trees of that size and width.
4. The check: the same static tree through eagletree's own `generate` on other held-out prompts; the
   measured tokens per pass against the prediction.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from . import serve
from .bench.profile import measure_drafting, step_drafting
from .decode import encode_prompt, generate, head_features
from .decode.resources import latency_profile
from .draft import make_drafter, target_to_draft
from .errors import InvalidValue
from .search import LatencyProfile
from .search.cost import read_profile_json
from .target import new_cache
from .verify import prefill

CHECK_TOLERANCE = 0.05
# Answer positions below which the measured acceptance is warned about: at ~185 positions (8 held-out prompts x
# 48 tokens) a plan's prediction missed vLLM's measured acceptance at depth >= 2 by up to 24%.
MIN_POSITIONS = 1000


@dataclass
class Acceptance:
    """What a head's drafts hit on the target's own answers, by depth and rank.

    paths["r1,r2,..."]: positions whose true tokens were the head's rank-r1 draft at depth 1, rank r2 at
    depth 2, ... (a prefix of their rank path); accept[d][r]: P(rank r at depth d + 1 | the parent is on
    the path), reached[d]: positions with every true token above depth d + 1 in the top-k.
    """

    paths: dict[str, int]
    positions: int
    accept: list[list[float]]
    reached: list[int]
    top_k: int
    prompts: int
    rank_paths: list[list[list[int]]] | None = None  # per prompt, per answer position: the true rank path

    def decoded_tokens_per_pass(self, tree: set[tuple[int, ...]]) -> float | None:
        """Tokens per pass of greedy decoding with this static tree on the measured answers: passes start where
        the last one ended (not at every position), each accepting 1 + the longest prefix of its rank path in
        the tree, as `generate` does on these prompts."""
        if not self.rank_paths:
            return None
        tokens = passes = 0
        for answer in self.rank_paths:
            t = 0
            while t < len(answer):
                m = 0
                while m < len(answer[t]) and tuple(answer[t][: m + 1]) in tree:
                    m += 1
                step = min(1 + m, len(answer) - t)
                tokens, passes, t = tokens + step, passes + 1, t + step
        return tokens / passes

    @classmethod
    def from_dict(cls, data: dict) -> Acceptance:
        keys = ("paths", "positions", "accept", "reached", "top_k", "prompts")
        try:
            table = cls(**{k: data[k] for k in keys}, rank_paths=data.get("rank_paths"))
            bad = [k for k, v in table.paths.items() if not _is_path(k) or not 0 <= int(v) <= table.positions]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidValue(f"an acceptance table needs {', '.join(keys)}: {e}") from None
        if not isinstance(table.positions, int) or isinstance(table.positions, bool) or table.positions < 1:
            raise InvalidValue(f"acceptance: positions must be an integer >= 1, got {table.positions!r}")
        if bad:
            raise InvalidValue(
                f"acceptance: path counts must lie in [0, positions={table.positions}], keys like '0,1'; bad: {bad[:3]}"
            )
        rank_paths = table.rank_paths
        if rank_paths is not None and not (
            isinstance(rank_paths, list)
            and all(
                isinstance(answer, list)
                and all(
                    isinstance(path, list)
                    and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)
                    for path in answer
                )
                for answer in rank_paths
            )
        ):
            raise InvalidValue(
                "acceptance: rank_paths must be a list (per prompt) of lists (per answer position) of "
                "rank paths such as [0, 1] (ranks >= 0)"
            )
        return table

    def frequency(self, path: tuple[int, ...]) -> float:
        return self.paths.get(",".join(map(str, path)), 0) / self.positions


def _is_path(key: str) -> bool:
    return all(part.isdigit() for part in key.split(","))


def _rank(probs: torch.Tensor, index: int) -> int:
    """0-based rank of entry `index` in a distribution (entries strictly more probable come first)."""
    return int((probs > probs[index]).sum())


@torch.inference_mode()
def measure_acceptance(
    target, tokenizer, head, prompts, max_new_tokens: int = 48, depth: int = 8, top_k: int = 10, progress=True
) -> Acceptance:
    """Teacher-forced chain drafting along the target's own greedy answers (see the module's docstring); a
    progress bar per prompt on stderr unless progress=False. A head whose levels do not read its drafts (a block
    head: one distribution per block position, whatever the parent) is measured the same way, as deep as it drafts."""
    if not prompts:
        raise InvalidValue("measuring acceptance needs at least one prompt")
    for name, value in (("max_new_tokens", max_new_tokens), ("depth", depth), ("top_k", top_k)):
        if not isinstance(value, int) or value < 1:
            raise InvalidValue(f"{name} must be an integer >= 1, got {value!r}")
    depth = min(depth, head.drafting.max_depth or depth)  # (a block head drafts its block's positions, no deeper)
    rank_paths = [
        _answer_rank_paths(target, head, ids, answer, depth, top_k)
        for ids, answer in greedy_answers(
            target, tokenizer, head, prompts, max_new_tokens, "plan: acceptance", progress
        )
    ]
    return _tally(rank_paths, depth, top_k, len(prompts))


def greedy_answers(target, tokenizer, head, prompts, max_new_tokens: int, desc: str, progress=True):
    """(prompt ids, the target's greedy answer) of every prompt that gets an answer, a progress bar on stderr: greedy
    decoding is the target's own answer whatever the tree (a chain keeps it cheap)."""
    device = next(target.parameters()).device
    for prompt in tqdm(prompts, desc=desc, unit="prompt", file=sys.stderr, disable=not progress):
        ids = encode_prompt(tokenizer, prompt).to(device)
        answer = generate(
            target, tokenizer, head, ids, max_new_tokens=max_new_tokens, temperature=0.0, tree="chain", depth=4
        ).token_ids
        if answer:
            yield ids, answer


def answer_drafter(target, head, ids, answer: list[int]):
    """The prompt and its answer as one sequence, the head's features of it (one target pass) and a fresh drafter."""
    layers = head.feature_spec.layers
    seq = torch.cat([ids, torch.tensor(answer, device=ids.device)])
    out = prefill(target, new_cache(target), seq[:-1], layers=layers)
    feats = head_features(out.hidden[0], out.layer_hidden and {k: v[0] for k, v in out.layer_hidden.items()}, layers)
    return seq, feats, make_drafter(head, target)


def _answer_rank_paths(target, head, ids, answer: list[int], depth: int, top_k: int) -> list[list[int]]:
    """At each position of `answer` (the target's answer to `ids`), the ranks of the true tokens in the head's draft
    distributions along the true path, depth by depth, until one falls outside the top-k."""
    device = ids.device
    seq, feats, drafter = answer_drafter(target, head, ids, answer)
    to_draft = (
        None
        if drafter.token_map is None
        else target_to_draft(drafter.token_map.cpu(), target.config.vocab_size).to(device)
    )
    p = ids.numel()
    probs = drafter.extend(feats[: p - 1], seq[1:p])
    paths = []
    for t in range(len(answer)):  # the root is seq[p - 1 + t]; its true continuation seq[p + t:]
        path = []
        for d in range(min(depth, seq.numel() - (p + t))):
            if d > 0:
                node = torch.tensor([d], device=device)
                probs = drafter(node, seq[p + t + d - 1 : p + t + d], node - 1, d + 1)[0]
            true = int(seq[p + t + d])
            index = true if to_draft is None else int(to_draft[true])
            rank = top_k if index < 0 else _rank(probs, index)
            if rank >= top_k:
                break
            path.append(rank)
        paths.append(path)
        if t + 1 < len(answer):
            probs = drafter.extend(feats[p - 1 + t : p + t], seq[p + t : p + t + 1])
    return paths


def _tally(rank_paths: list[list[list[int]]], depth: int, top_k: int, prompts: int) -> Acceptance:
    """The acceptance table of the rank paths measured per answer position: a position reached depth d + 1 when its
    path went that deep or broke there (or the answer ended below it)."""
    hits = [[0] * top_k for _ in range(depth)]
    reached = [0] * depth
    paths: dict[str, int] = {}
    positions = 0
    for answer in rank_paths:
        for t, path in enumerate(answer):
            positions += 1
            for d in range(min(len(path) + 1, depth, len(answer) - t)):
                reached[d] += 1
            for d, rank in enumerate(path):
                hits[d][rank] += 1
                key = ",".join(map(str, path[: d + 1]))
                paths[key] = paths.get(key, 0) + 1
    if positions == 0:
        raise InvalidValue("the target answered none of the prompts (each stopped at once)")
    accept = [[h / reached[d] if reached[d] else 0.0 for h in hits[d]] for d in range(depth)]
    return Acceptance(paths, positions, accept, reached, top_k, prompts, rank_paths)


@dataclass
class Plan:
    engine: str
    nodes: int  # tree nodes per pass, root included
    depth: int
    width: int  # the top-k that drafts every planned node: its largest rank + 1, or more expanded nodes on a level
    paths: list[list[int]]  # each non-root node as its rank path from the root, e.g. [0], [1], [0, 0]
    expected_tokens: float  # per pass, averaged over every measured position
    decoded_tokens: float | None  # per pass when decoding the measured answers (passes start where one ended)
    step_s: float  # predicted seconds per step under the latency profile
    tokens_per_s: float
    plain_tokens_per_s: float  # one token per one-node pass, same profile


def best_plan(acceptance: Acceptance, profile, engine: str, max_nodes: int = 64, max_depth: int = 8) -> Plan:
    """The (nodes, depth) with the most expected tokens per second and its tree (a chain for vLLM).

    A node's value is how often the true rank path passes through it; values never grow along a path, so
    the most valuable n - 1 paths (shorter first on ties) form the best connected tree of n nodes.
    """
    chain = serve.engine(engine).chain  # (ValueError naming the engines for another name)
    if max_nodes < 2 or max_depth < 1:
        raise InvalidValue(f"max_nodes must be >= 2 and max_depth >= 1, got {max_nodes} and {max_depth}")
    candidates = [tuple(int(r) for r in key.split(",")) for key in acceptance.paths]
    if chain:  # one draft token per level
        candidates = [p for p in candidates if not any(p)]
    best = None
    for depth in range(1, max_depth + 1):
        ranked = sorted((p for p in candidates if len(p) <= depth), key=lambda p: (-acceptance.frequency(p), len(p), p))
        ranked = ranked[: max_nodes - 1]
        if not ranked or max(map(len, ranked)) < depth:
            continue  # this depth adds nothing: scored at its own depth with fewer drafting levels
        expected = 1.0
        for n, path in enumerate(ranked, start=2):
            expected += acceptance.frequency(path)
            tree = ranked[: n - 1]
            if max(map(len, tree)) < depth:
                continue
            step = float(profile.step_time(n, depth))
            if best is None or expected / step > best[0] * (1 + 1e-12):
                best = (expected / step, tree, expected, depth, step)
    if best is None:
        raise InvalidValue("the head's drafts were never accepted on these prompts: no tree beats plain decoding")
    rate, tree, expected, depth, step = best
    paths = sorted(tree, key=lambda p: (len(p), p))
    # the top-k an engine must draft at for every planned node to be among its candidates: the largest rank + 1
    # (more than the most children of one node when the chosen ranks have gaps, e.g. ranks 0, 1 and 3), and at
    # least the planned nodes of one level that have children (SGLang and EAGLE expand top-k nodes per level)
    parents = {p[:-1] for p in paths if len(p) > 1}
    width = max([max(p) + 1 for p in paths] + [sum(1 for q in parents if len(q) == d) for d in range(1, depth)])
    plain = 1.0 / float(profile.step_time(1, 0))
    decoded = acceptance.decoded_tokens_per_pass(set(paths))
    return Plan(engine, len(paths) + 1, depth, width, [list(p) for p in paths], expected, decoded, step, rate, plain)


def engine_config(
    plan: Plan, export_dir: str, eagle3: bool, draft_vocab: bool, export_format: str | None = None
) -> dict:
    """The engine's own settings for the plan's tree (`eagletree.serve`: each engine's `settings`), the head exported
    in `export_format`."""
    return serve.engine(plan.engine).settings(plan, export_dir, eagle3, draft_vocab, export_format)


def load_profile(path):
    """A LatencyProfile JSON, or the profile.json of `eagletree profile` (rows per tree size)."""
    data = read_profile_json(path)
    if not isinstance(data, dict) or "rows" not in data:
        return LatencyProfile.load(path)
    rows = data["rows"]
    try:
        sizes = [int(r["n"]) for r in rows]
        # bench's engine_ms holds the search's share too; a LatencyProfile counts search per level apart.
        verify = [(r["forward_ms"] + r["engine_ms"] - r["search_ms"]) / 1e3 for r in rows]
        levels = [r["draft_level_ms"] / 1e3 for r in rows if r["n"] > 1]
        search = [r["search_ms"] / 1e3 / max(int(data.get("depth", 6)), 1) for r in rows if r["n"] > 1]
        catch_ups = [r.get("catch_up_ms", 0.0) / 1e3 for r in rows if r["n"] > 1]  # (a profile from before: none)
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidValue(
            f"{str(path)!r}: bench profile rows need n, forward_ms, engine_ms, search_ms and draft_level_ms ({e})"
        ) from None
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
    return LatencyProfile(
        sizes,
        verify,
        draft_s_per_level=median(levels),
        search_s_per_level=median(search),
        draft_s_per_step=median(catch_ups),
        device=str(data.get("device", "")),
        model=str(data.get("config", "")),
        notes={"from": str(path)},
    )


def measure_profile(target, head):
    """The latency profile of `target` and `head` on the target's device: the verify pass (measured once and
    cached) and the head's drafting, timed on the features the head reads: per level, and what a step's commit of
    the accepted tokens costs the head besides (its catch-up)."""
    profile = latency_profile(target)
    drafting = measure_drafting(target, head, [16], prefix=128, reps=3)[16]
    profile.draft_s_per_level = drafting["level"]
    profile.draft_s_per_step = step_drafting(head.drafting, drafting, 1)  # (depth 1: no level below the root)
    return profile


def check_plan(target, tokenizer, head, plan: Plan, prompts, max_new_tokens: int, progress=True) -> dict:
    """The plan's static tree through eagletree's `generate` on `prompts`: measured tokens per pass."""
    new = passes = 0
    for prompt in tqdm(prompts, desc="plan: check", unit="prompt", file=sys.stderr, disable=not progress):
        stats = generate(
            target,
            tokenizer,
            head,
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            tree="sequoia",
            tree_paths=plan.paths,
            budget=plan.nodes,
            depth=plan.depth,
        ).stats
        new, passes = new + stats.new_tokens, passes + stats.passes
    measured = new / passes if passes else 0.0
    predicted = plan.decoded_tokens if plan.decoded_tokens is not None else plan.expected_tokens
    error = measured / predicted - 1.0
    return {
        "prompts": len(prompts),
        "new_tokens": new,
        "passes": passes,
        "measured_tokens_per_pass": measured,
        "predicted_tokens_per_pass": predicted,
        "relative_error": error,
        "within_tolerance": abs(error) <= CHECK_TOLERANCE,
    }


def read_acceptance(path) -> tuple[dict, Acceptance]:
    """The JSON an earlier plan wrote at `path` (`plan -o`), and its acceptance; ValueError naming the file (as
    --acceptance) when it cannot be read or holds no acceptance."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidValue(f"cannot read --acceptance {path!r}: {e}") from e
    if not isinstance(data, dict):
        raise InvalidValue(f"--acceptance {path!r}: expected a plan's JSON object, got {type(data).__name__}")
    try:
        return data, Acceptance.from_dict(data.get("acceptance", data))
    except ValueError as e:
        raise InvalidValue(f"--acceptance {path!r}: {e} (expected a plan's JSON, as plan -o writes it)") from None


def check_reused_acceptance(data: dict, head, source: str, engine: str | None = None) -> None:
    """Refuse an earlier plan's acceptance measured over another draft vocabulary than `head` drafts over now
    (its ranks are ranks among other tokens). A plan written before plans recorded it is taken as it is."""
    measured = data.get("draft_vocab_size")
    if measured is not None and int(measured) != head.drafted_vocab_size():
        full = head.config.target["vocab_size"]
        match = "full" if int(measured) == full else "head"
        # vLLM and EAGLE's code draft an EAGLE-1/2 export over the full vocabulary: ranks among the head's own
        # draft vocabulary are not the ones they see, whatever --draft-vocab says
        engine_full = (
            engine is not None and serve.engine(engine).full_vocab and (head.can_widen_vocab() or head.is_widened())
        )
        if match == "head" and engine_full:
            raise InvalidValue(
                f"--acceptance {source}: measured drafting over {measured} tokens (the head's draft "
                f"vocabulary), but {engine} drafts this head over all {full}: measure anew without "
                "--acceptance"
            )
        raise InvalidValue(
            f"--acceptance {source}: measured drafting over {measured} tokens, but the head drafts "
            f"over {head.drafted_vocab_size()} here; pass --draft-vocab {match} to reuse it, or measure "
            "anew without --acceptance"
        )


@dataclass(frozen=True)
class PlanOptions:
    """What `make_plan` plans: the engine (`eagletree.serve`), the export folder its settings name, the tree's
    limits (nodes with the root, depth), the ranks measured per depth, the tokens of each measured or checked
    answer."""

    engine: str
    export_dir: str
    max_nodes: int = 64
    max_depth: int = 8
    top_k: int = 10
    max_new_tokens: int = 48

    def __post_init__(self):
        serve.engine(self.engine)  # ValueError naming the engines for another name


def make_plan(
    target, tokenizer, head, profile, prompts, check_prompts, options: PlanOptions, acceptance: Acceptance | None = None
) -> dict:
    """Measure (unless given) the acceptance, choose the tree, write the engine's settings, check the tree."""
    export_format = serve.engine(options.engine).format_for(head.head_type)  # (refuses a head it cannot load)
    if acceptance is None:
        acceptance = measure_acceptance(
            target, tokenizer, head, prompts, options.max_new_tokens, options.max_depth, options.top_k
        )
    plan = best_plan(acceptance, profile, options.engine, options.max_nodes, options.max_depth)
    check = check_plan(target, tokenizer, head, plan, check_prompts, options.max_new_tokens) if check_prompts else None
    eagle3 = head.feature_spec.layers is not None  # the engines' EAGLE-3 reads fused target layers
    draft_vocab = head.config.draft_vocab_size is not None
    return {
        "engine": options.engine,
        "config": engine_config(plan, options.export_dir, eagle3, draft_vocab, export_format),
        "export_format": export_format,
        "draft_vocab_size": head.drafted_vocab_size(),
        "tree": {"nodes": plan.nodes, "depth": plan.depth, "width": plan.width, "paths": plan.paths},
        "expected_tokens_per_pass": plan.expected_tokens,
        "decoded_tokens_per_pass": plan.decoded_tokens,
        "predicted_step_ms": plan.step_s * 1e3,
        "predicted_tokens_per_s": plan.tokens_per_s,
        "predicted_plain_tokens_per_s": plan.plain_tokens_per_s,
        "check": check,
        "acceptance": asdict(acceptance),
        "profile": {
            "device": profile.device,
            "model": profile.model,
            "sizes": profile.sizes,
            "verify_s": profile.verify_s,
            "draft_s_per_level": profile.draft_s_per_level,
            "search_s_per_level": profile.search_s_per_level,
        },
    }


def summary(result: dict) -> str:
    """The plan as a few lines of text: the engine's settings, the tree, predicted and measured tokens per pass."""
    tree, check = result["tree"], result["check"]
    lines = [
        f"{result['engine']}: {json.dumps(result['config'])}",
        f"tree: {tree['nodes']} nodes, depth {tree['depth']}, width {tree['width']}; paths "
        f"{[tuple(p) for p in tree['paths']]}",
        f"expected {result['expected_tokens_per_pass']:.3f} tokens/pass over all measured positions "
        f"({_x(result['decoded_tokens_per_pass'])} decoding the measured answers), "
        f"{result['predicted_tokens_per_s']:.1f} tokens/s under the profile (plain decoding "
        f"{result['predicted_plain_tokens_per_s']:.1f})",
    ]
    positions = result["acceptance"]["positions"]
    if positions < MIN_POSITIONS:
        lines.append(
            f"warning: the acceptance was measured on {positions} answer positions; below {MIN_POSITIONS} the "
            "prediction is uncertain (more --prompts or --max-new-tokens)"
        )
    slower = 1 - result["predicted_tokens_per_s"] / result["predicted_plain_tokens_per_s"]
    if slower > 0:
        lines.append(
            f"warning: under this profile even the best tree is predicted {slower:.1%} slower than plain "
            f"decoding: on this device leave speculative decoding off for this head"
        )
    if check is not None:
        verdict = "within" if check["within_tolerance"] else "NOT within"
        lines.append(
            f"check: eagletree generate with this tree on {check['prompts']} other prompts: measured "
            f"{check['measured_tokens_per_pass']:.3f} tokens/pass, predicted "
            f"{check['predicted_tokens_per_pass']:.3f} ({check['relative_error']:+.1%}, {verdict} "
            f"{CHECK_TOLERANCE:.0%})"
        )
    return "\n".join(lines)


def _x(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def split_prompts(prompts: list) -> tuple[list, list]:
    """The first half measures the acceptance, the second checks the tree (disjoint prompts)."""
    if len(prompts) < 2:
        raise InvalidValue(f"plan needs at least 2 prompts (one to measure, one to check), got {len(prompts)}")
    half = math.ceil(len(prompts) / 2)
    return prompts[:half], prompts[half:]

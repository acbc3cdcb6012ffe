"""`eagletree plan --engine llamacpp`: what to serve a GGUF target with in llama.cpp, from llama.cpp's own measured
costs: the head (its `--spec-draft-n-max` k and `--spec-draft-p-min` p), an n-gram mode, or plain decoding.

Terms. A *step* is one verify pass of llama.cpp with a drafter: it drafts n <= k tokens (greedy, one draft call per
token for EAGLE-3, one call for the whole block for a block head; a draft whose top probability is below p ends the
chain, and for EAGLE-3 the call that drafted it is paid), verifies them with the root and accepts 1 + a tokens.

1. Chains (`own_chains`): on the target's own greedy answers, at every answer position eagletree drafts the head's
   greedy chain of K as llama.cpp does (each level fed the head's own token), recording each draft's top probability
   and how many leading drafts equal the answer's next tokens. `simulate` replays llama.cpp's schedule on them for a
   (k, p): steps, drafts, draft calls and tokens (the answer's first token comes from the prefill, undrafted).
2. Costs (`LlamaCosts`, measured by scripts/profile_llamacpp.py in llama.cpp itself): ms per plain token; a step
   that drafted nothing (a plain token's pass, its bookkeeping and any draft call), a step that verifies one draft
   (the target's pass over 2 tokens, the draft model's work, its calls), each further draft, and an EAGLE-3 chain's
   call past its last draft (cut by p_min): fitted to timed runs at several (k, p), whose steps are counted in
   debug-verbosity runs of the same settings; the n-gram modes' tokens/s.
3. The plan: predicted tokens/s of every (threads, k, p) and of plain decoding (the n-gram modes' measured rates are
   listed, not chosen: prompt-dependent); a head setting is chosen only when predicted at least `MARGIN` faster than
   plain (its prediction's tolerance), so the choice is not below plain. `projected` scales the target's terms (a
   plain token, its share of the steps) by the weights of a larger GGUF target, keeping the head's and the
   acceptance: a projection, not a measurement.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import serve
from .errors import InvalidValue
from .plan import answer_drafter, greedy_answers

MARGIN = 0.05  # a mode other than plain must be predicted this much faster to be chosen (the check's tolerance)
P_MINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class Chain:
    """At one answer position: the head's greedy drafts (depth 1..K, target ids), the top probability of each, and
    how many leading drafts are the answer's next tokens."""

    tokens: list[int]
    probs: list[float]
    matched: int


@torch.inference_mode()
def own_chains(target, tokenizer, head, prompts, max_new_tokens: int, depth: int, progress=True) -> list[list[Chain]]:
    """Per prompt, per position of the target's greedy answer: the head's own greedy chain of `depth` drafts (see
    the module's docstring); a progress bar per prompt on stderr unless progress=False."""
    if not prompts:
        raise InvalidValue("measuring chains needs at least one prompt")
    deepest = head.drafting.max_depth
    if deepest is not None and depth > deepest:
        raise InvalidValue(f"depth {depth} is more than the {deepest} tokens this head drafts a step")
    chains = [
        _answer_chains(target, head, ids, answer, depth)
        for ids, answer in greedy_answers(target, tokenizer, head, prompts, max_new_tokens, "plan: chains", progress)
    ]
    if not chains:
        raise InvalidValue("the target answered none of the prompts (each stopped at once)")
    return chains


def _answer_chains(target, head, ids, answer: list[int], depth: int) -> list[Chain]:
    device = ids.device
    seq, feats, drafter = answer_drafter(target, head, ids, answer)
    d2t = drafter.token_map
    p = ids.numel()
    drafter.extend(feats[: p - 1], seq[1:p])
    chains = []
    for t in range(len(answer)):  # the root is seq[p - 1 + t]; the answer's next tokens seq[p + t:]
        probs, tokens = [], []
        for d in range(depth):
            node = torch.tensor([d], device=device)
            before = seq[p - 1 + t : p + t] if d == 0 else torch.tensor(tokens[-1:], device=device)
            dist = drafter(node, before, node - 1, d + 1)[0]  # level d + 1: the root's children at d = 0
            top = int(dist.argmax())
            probs.append(float(dist[top]))
            tokens.append(top if d2t is None else int(d2t[top]))
        truth = seq[p + t : p + t + depth].tolist()
        matched = next((i for i, (a, b) in enumerate(zip(tokens, truth)) if a != b), min(len(truth), depth))
        chains.append(Chain(tokens, probs, matched))
        if t + 1 < len(answer):
            drafter.extend(feats[p - 1 + t : p + t], seq[p + t : p + t + 1])
    return chains


def simulate(chains: list[list[Chain]], k: int, p_min: float, call_per_draft: bool, n_predict: int | None = None):
    """llama.cpp's steps over the measured answers with --spec-draft-n-max k and --spec-draft-p-min p_min: passes
    start where the last ended, from the answer's second token (its first comes from the prefill), and draft at most
    the tokens still to produce before `n_predict` less one, as llama-server does. Returns the answers' tokens, the
    steps, `sizes[m]`: the steps whose target pass verified m tokens (1 + its drafts), the drafts, and `calls[m]`: the
    draft calls of those steps (`call_per_draft`: EAGLE-3's one call a draft, plus the one whose draft fell below
    p_min; otherwise one call a step that may draft)."""
    tokens = steps = drafts = 0
    sizes, calls = [0] * (k + 2), [0] * (k + 2)
    for answer in chains:
        tokens += len(answer)
        t = 1
        while t < len(answer):
            chain = answer[t]  # rooted at the answer's token t - 1, drafting token t on
            most = k if n_predict is None else max(min(k, n_predict - t - 1), 0)
            n = next((i for i, q in enumerate(chain.probs[:most]) if q < p_min), min(most, len(chain.probs)))
            steps, drafts, sizes[1 + n] = steps + 1, drafts + n, sizes[1 + n] + 1
            if most:
                calls[1 + n] += (n + (n < most)) if call_per_draft else 1
            t += 1 + min(chain.matched, n)
    return {"tokens": tokens, "steps": steps, "sizes": sizes, "drafts": drafts, "calls": calls}


@dataclass
class LlamaCosts:
    """llama.cpp's measured costs at one thread count, in ms: a plain token; steps that drafted nothing (`empty_ms`),
    that verified one draft (`one_ms`, its draft calls included), each further draft (`draft_ms`, its call included),
    an EAGLE-3 chain's call past its last draft (`stop_call_ms`); the n-gram modes' tokens/s. `target_share`: the part
    of a drafting step's time that is the target's pass (from the step timestamps), for `projected`."""

    threads: int
    plain_ms: float
    empty_ms: float
    one_ms: float
    draft_ms: float
    stop_call_ms: float
    target_share: float
    ngram: dict[str, float]

    def step_ms(self, counts: dict) -> float:
        """The ms of `simulate`'s steps."""
        terms = self.terms(counts)
        return sum(terms[key] * value for key, value in self.unit_costs().items())

    def unit_costs(self) -> dict[str, float]:
        return {"empty": self.empty_ms, "drafted": self.one_ms, "further": self.draft_ms, "stops": self.stop_call_ms}

    @staticmethod
    def terms(counts: dict) -> dict[str, int]:
        """`simulate`'s counts as the costs' terms: steps that drafted nothing, steps that drafted, drafts past each
        step's first, and (EAGLE-3: more calls than drafts) calls past a chain's last draft."""
        sizes, calls = counts["sizes"], counts["calls"]
        drafted = sum(sizes[2:])
        stops = sum(max(c - n * (m - 1), 0) for m, (n, c) in enumerate(zip(sizes, calls)) if m >= 2)
        further = sum(n * (m - 2) for m, n in enumerate(sizes) if m >= 2)
        return {"empty": sizes[1] if len(sizes) > 1 else 0, "drafted": drafted, "further": further, "stops": stops}

    def projected(self, scale: float) -> LlamaCosts:
        """These costs for a target `scale` times the weights: a plain token, and the target's share of the other
        terms, scale; the draft model's work does not."""
        grow = lambda ms: ms * (self.target_share * scale + 1 - self.target_share)  # noqa: E731
        extra = self.empty_ms - self.plain_ms  # (an empty step: a plain token's pass and the drafter's bookkeeping)
        return LlamaCosts(
            self.threads,
            self.plain_ms * scale,
            self.plain_ms * scale + extra,
            grow(self.one_ms),
            grow(self.draft_ms),
            self.stop_call_ms,
            self.target_share,
            {},
        )


def read_costs(path) -> dict:
    """The cost profile scripts/profile_llamacpp.py wrote: {"costs": [LlamaCosts fields, per thread count], "spec_type",
    "target_bytes", "max_k", ...}; ValueError naming the file and what it lacks."""
    try:
        data = json.loads(Path(path).read_text())
        data["costs"] = [LlamaCosts(**c) for c in data["costs"]]
        for key in ("spec_type", "target_bytes", "head_type", "max_k"):
            data[key]  # noqa: B018 (present)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise InvalidValue(
            f"--profile {str(path)!r}: expected llama.cpp's cost profile as scripts/profile_llamacpp.py writes it "
            f"(costs per thread count, spec_type, target_bytes, head_type, max_k): {e}"
        ) from None
    if not data["costs"]:
        raise InvalidValue(f"--profile {str(path)!r}: no thread count was measured")
    return data


def options(chains, costs: list[LlamaCosts], max_k: int, call_per_draft: bool, n_predict: int | None) -> list[dict]:
    """Every mode's predicted tokens/s: plain, each n-gram mode, and the head at each (threads, k, p_min)."""
    rows = []
    for c in costs:
        rows.append({"mode": "plain", "threads": c.threads, "tokens_per_s": 1e3 / c.plain_ms})
        rows += [{"mode": m, "threads": c.threads, "tokens_per_s": r} for m, r in c.ngram.items()]
        for k in range(1, max_k + 1):
            for p in P_MINS:
                counts = simulate(chains, k, p, call_per_draft, n_predict)
                rate = counts["tokens"] / c.step_ms(counts) * 1e3
                rows.append({"mode": "head", "threads": c.threads, "k": k, "p_min": p, "tokens_per_s": rate, **counts})
    return rows


def choose(rows: list[dict]) -> dict:
    """The fastest plain row, unless a head setting is predicted at least MARGIN faster than it. The n-gram modes are
    listed, never chosen: their gain depends on how much each answer repeats, and what they gained on the profile's
    prompts did not hold on others (docs/results.md)."""
    plain = max((r for r in rows if r["mode"] == "plain"), key=lambda r: r["tokens_per_s"])
    best = max((r for r in rows if r["mode"] in ("plain", "head")), key=lambda r: r["tokens_per_s"])
    return best if best["tokens_per_s"] >= plain["tokens_per_s"] * (1 + MARGIN) else plain


def plan_llamacpp(
    chains, profile: dict, export_dir: str, call_per_draft: bool, n_predict: int, project_gb: float | None = None
) -> dict:
    """The plan's JSON: the choice and its llama-server flags, every option's prediction, the fitted costs and,
    given `project_gb`, the same choice for a target of that many GB of GGUF weights (a projection).
    `call_per_draft`: the head makes a draft call per drafted token (its `drafting.level_calls`)."""
    depth = len(chains[0][0].probs)  # the chains' depth bounds k, and so do the sizes llama.cpp was measured at
    max_k = min(int(profile["max_k"]), depth)
    rows = options(chains, profile["costs"], max_k, call_per_draft, n_predict)
    choice = choose(rows)
    plain = max(r["tokens_per_s"] for r in rows if r["mode"] == "plain")
    result = {
        "engine": "llamacpp",
        "choice": choice,
        "config": serve.engine("llamacpp").settings(choice, export_dir, profile["spec_type"]),
        "predicted_tokens_per_s": choice["tokens_per_s"],
        "predicted_plain_tokens_per_s": plain,
        "best_head": max((r for r in rows if r["mode"] == "head"), key=lambda r: r["tokens_per_s"]),
        "options": rows,
        "costs": [asdict(c) for c in profile["costs"]],
        "profile": {k: v for k, v in profile.items() if k != "costs"},
        "answer_positions": sum(map(len, chains)),
    }
    if project_gb is not None:
        scale = project_gb * 1e9 / profile["target_bytes"]
        projected = options(chains, [c.projected(scale) for c in profile["costs"]], max_k, call_per_draft, n_predict)
        result["projection"] = {"weights_gb": project_gb, "scale": scale, "choice": choose(projected)}
        result["projection"]["plain_tokens_per_s"] = max(r["tokens_per_s"] for r in projected if r["mode"] == "plain")
        result["projection"]["best_head"] = max(
            (r for r in projected if r["mode"] == "head"), key=lambda r: r["tokens_per_s"]
        )
    return result


def summary(result: dict) -> str:
    """The llama.cpp plan in a few lines."""
    c, head = result["choice"], result["best_head"]
    lines = [
        f"llamacpp: {result['config']['command']}",
        f"choice: {_row(c)} (plain {result['predicted_plain_tokens_per_s']:.1f} tokens/s, predicted)",
        f"best head setting: {_row(head)} = {head['tokens_per_s'] / result['predicted_plain_tokens_per_s']:.2f}x "
        f"plain, {head['tokens'] / head['steps']:.2f} tokens a step",
    ]
    if "projection" in result:
        p = result["projection"]
        lines.append(
            f"projection, a {p['weights_gb']:g} GB target ({p['scale']:.1f}x the weights): {_row(p['choice'])}; "
            f"best head {_row(p['best_head'])} against plain {p['plain_tokens_per_s']:.1f}"
        )
    return "\n".join(lines)


def _row(r: dict) -> str:
    what = r["mode"] if r["mode"] != "head" else f"head k={r['k']} p_min={r['p_min']:g}"
    return f"{what}, {r['threads']} threads, {r['tokens_per_s']:.1f} tokens/s"

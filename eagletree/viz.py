"""`eagletree viz`: one real drafting step as a self-contained HTML page.

The page shows the draft tree, its tree-attention mask, and replays the acceptance walk of
eagletree/verify/accept.py (top-k drafted trees) on the target's real distributions of that step.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import torch

from .decode import Decoder, GenerationStats, encode_prompt
from .decode.config import DecodeConfig
from .errors import InvalidValue
from .target import new_cache
from .verify import DraftTree, accept_tree, prefill, target_probs, verify_tree

MASS = 0.999  # each node's target distribution is kept down to this much mass ...
MAX_ENTRIES = 64  # ... but at most this many entries (plus the children's tokens), the rest as "other"


def show_token(text: str) -> str:
    """Token text with spaces, newlines, tabs and control characters made visible."""
    text = text.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text) or "\u2205"


def step_data(
    tree: DraftTree, logits: torch.Tensor, tokenizer, prefix_len: int, temperature: float = 0.0, top_k=None, top_p=None
) -> dict:
    """The page's data for a verified tree; logits [N, vocab], row v = the target's logits after node v.

    Target distributions are warped with temperature (1.0 when greedy), top_k and top_p, as sampling uses them.
    """
    if tree.sampled:
        raise InvalidValue("viz replays top-k drafted trees; got a tree with sampled=True")
    tree, logits = tree.to("cpu"), logits.detach().float().cpu()
    accepted, next_token = accept_tree(tree, logits)  # greedy: the page's greedy walk must give the same
    probs = target_probs(logits, temperature or 1.0, top_k, top_p).double()  # [N, vocab]
    tokens, parents, children = tree.tokens.tolist(), tree.parents.tolist(), tree.children()
    dists, other = [], []
    for v in range(len(tree)):
        top, top_ids = torch.topk(probs[v], min(MAX_ENTRIES, probs.shape[1]))
        k = min(int((top.cumsum(0) < MASS).sum()) + 1, len(top_ids))
        ids = top_ids[:k].tolist()
        # The walk needs the exact probability of every child's token, however small.
        ids += [t for t in dict.fromkeys(tokens[c] for c in children[v]) if t not in ids]
        p = probs[v, ids]
        dists.append([[t, float(f"{x:.7g}")] for t, x in zip(ids, p.tolist())])
        other.append(max(0.0, float(f"{1.0 - float(p.sum()):.7g}")))
    # A top-k child is accepted with its parent's p(token) whatever its sibling rank, so the target's
    # expected tokens per pass is 1 + the sum of root-path products of those probabilities.
    under_target = [1.0] * len(tree)
    for v in range(1, len(tree)):
        under_target[v] = under_target[parents[v]] * float(probs[parents[v], tokens[v]])
    argmax = logits.argmax(dim=-1).tolist()
    mask = tree.attention_mask(prefix_len)[:, prefix_len:]  # [N, N]; the prefix columns are all True
    ids = set(tokens) | set(argmax) | {t for d in dists for t, _ in d}
    has_q = tree.draft_probs is not None
    return {
        "tokens": tokens,
        "parents": parents,
        "depths": tree.depths.tolist(),
        "copied": [info is not None for info in tree.copy_info] if tree.copy_info else [False] * len(tree),
        "q": [float(f"{x:.6g}") for x in tree.draft_probs.tolist()] if has_q else None,
        "path": [float(f"{x:.6g}") for x in tree.path_products().tolist()] if has_q else None,
        "expected": tree.expected_tokens if has_q else None,
        "target_expected": sum(under_target),
        "context_len": prefix_len,
        "mask": [row.nonzero().flatten().tolist() for row in mask],
        "argmax": argmax,
        "dist": dists,
        "other": other,
        "greedy": {"accepted": accepted, "next": next_token},
        "temperature": temperature,
        "sample_temperature": temperature or 1.0,
        "top_k": top_k,
        "top_p": top_p,
        "text": {str(i): show_token(tokenizer.decode([i])) for i in sorted(ids)},
    }


def viz_step(target, tokenizer, head, prompt, step: int = 1, config: DecodeConfig | None = None, **options) -> dict:
    """Data of the `step`-th pass (1 = the first) of a real speculative generation of `prompt`.

    `config`, or `options` as `generate` takes them (default: an EAGLE-2 tree of 60 nodes); copied nodes are marked.
    """
    if config is None:
        config = DecodeConfig.from_options(**{"tree": "eagle2", "budget": 60, **options})
    if head is None:
        raise InvalidValue("viz needs a draft head (got none): the page shows the tree the head drafts")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise InvalidValue(f"step must be an integer >= 1 (1 = the first decoding step), got {step!r}")
    ids = encode_prompt(tokenizer, prompt)
    stats = GenerationStats(steps=[])
    emitted = []
    for pass_ in Decoder(target, tokenizer, head, config).steps(ids, stats):
        if stats.passes == step:
            break
        emitted += pass_.tokens
    else:
        raise InvalidValue(
            f"step {step} is past the end of the generation: it stopped after {stats.passes} steps "
            f"({stats.new_tokens} tokens, max_new_tokens={config.max_new_tokens}); pick a step <= "
            f"{stats.passes}"
        )
    draft, run_accepted = stats.steps[-1]
    # Re-run the step's context to get the target's logits for every node (the loop keeps only the accepted ones).
    context = torch.cat([ids.cpu(), torch.tensor(emitted, dtype=torch.long)])
    assert int(draft.tokens[0]) == int(context[-1]), "the step's root must be the last context token"
    device = next(target.parameters()).device
    cache = new_cache(target)
    prefill(target, cache, context[:-1].to(device))
    logits = verify_tree(target, cache, draft).logits[0]
    sampling = config.sampling
    data = step_data(
        draft, logits, tokenizer, context.numel() - 1, sampling.temperature, sampling.top_k, sampling.top_p
    )
    search = {"budget": config.budget, "depth": config.depth, "top_k_draft": config.top_k_draft}
    if config.copy.enabled is not None:
        search["copy"] = config.copy.enabled
    data.update(
        step=step,
        tree=config.tree.value,
        search=search,
        seed=sampling.seed,
        run_accepted=list(run_accepted),
        target=Path(getattr(target.config, "_name_or_path", "")).name or target.config.model_type,
        context_tail=tokenizer.decode(context[-65:-1].tolist())[-600:],
    )
    return data


def render_html(data: dict) -> str:
    """One self-contained page (inline CSS, JS and SVG; no network) for `viz_step`'s data."""
    # Inside <script>, "</script>" or "<!--" in a token text would end the block: escape <, > and & in the JSON.
    blob = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    title = f"eagletree viz: step {data.get('step', '?')}, {data.get('tree', '')} tree of {len(data['tokens'])} nodes"
    return PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", blob)


PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:14px 16px;color:#1d2330;background:#fafbfc}
h1{font-size:18px;margin:0 0 4px}h2{font-size:14px;margin:0 0 6px;color:#4a5568}
.meta{color:#4a5568;font-size:13px}
#ctx{font:12px/1.35 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;background:#eef1f5;border-radius:6px;
 padding:6px 8px;margin:8px 0;max-height:5.6em;overflow:auto;color:#4a5568}
#ctx b{color:#1d2330;background:#cfe0ff;border-radius:3px;padding:0 2px}
.bar{display:flex;gap:10px;align-items:center;flex-wrap:wrap;margin:8px 0}
.chip{background:#1f4fa8;color:#fff;border-radius:14px;padding:3px 11px;font-weight:600}
.chip.alt{background:#e8edf6;color:#1d2330;font-weight:500}
button,select{font:inherit;padding:4px 10px;border-radius:6px;border:1px solid #9aa7bd;background:#fff;cursor:pointer}
button#run{background:#0f7b4f;color:#fff;border-color:#0f7b4f;font-weight:600}button:disabled{opacity:.5}
#counter{font-variant-numeric:tabular-nums}
#result{min-height:26px;font:13px ui-monospace,Menlo,Consolas,monospace}
#result span{display:inline-block;border-radius:4px;padding:1px 5px;margin:1px}
#result .acc{background:#c9f0d8}#result .bonus{background:#ffe1b3;border:1px dashed #d97a00}
#info{min-height:20px;font-size:13px;color:#33415c}#info code{background:#eef1f5;border-radius:3px;padding:0 3px}
main{display:flex;gap:20px;align-items:flex-start;flex-wrap:wrap}
section{background:#fff;border:1px solid #e2e6ee;border-radius:8px;padding:10px}
svg text{font:12px ui-monospace,Menlo,Consolas,monospace;dominant-baseline:middle;pointer-events:none}
.node rect{stroke:#7d8aa3;stroke-width:1}svg text.q{fill:#5b6577;font-size:10px}.node{cursor:default}
.node.onpath rect{stroke:#d97a00;stroke-width:2.5}
.edge{fill:none;stroke:#b3bccb;stroke-width:1.2}.edge.onpath{stroke:#d97a00;stroke-width:2.5}
.node.accepted rect{fill:#9be3b8!important;stroke:#0f7b4f;stroke-width:2}.edge.accepted{stroke:#0f7b4f;stroke-width:2.5}
.node.out{opacity:.22}.edge.out{opacity:.15}.node.rejected rect{stroke:#c53030;stroke-width:2}
.extra rect{fill:#ffe1b3;stroke:#d97a00;stroke-dasharray:4 3;stroke-width:1.5}
.node.copied rect{stroke:#7b3fb8;stroke-width:2;stroke-dasharray:6 2}
.extra path{fill:none;stroke:#d97a00;stroke-dasharray:4 3;stroke-width:1.5}
.cell{fill:#f1f3f7}.cell.on{fill:#56607a}.cell.ctx.on{fill:#8fa0bf}.rowbg{fill:transparent}
.row.hl .rowbg{fill:#ffe9c7}.row.hl .cell.on{fill:#d97a00}.row.hl text{font-weight:700}.row text{font-size:var(--cell)}
.col text{font-size:9px;fill:#6b7486}
</style></head><body>
<h1>eagletree &middot; one drafting step</h1>
<div class="meta" id="meta"></div>
<div id="ctx"></div>
<div class="bar">
 <span class="chip" id="chip"></span><span class="chip alt" id="chip2"></span>
 <select id="mode"><option value="greedy">greedy (argmax)</option><option value="sample">sample</option></select>
 <button id="run">Run verification</button><button id="reset">Reset</button>
 <span id="counter" data-runs="0">no runs yet</span>
</div>
<div id="result"></div>
<div id="info">Hover a node (or a mask row): its root path and its row of the attention mask light up.</div>
<main>
 <section><h2>Draft tree (depth &rarr;, token and the drafter's q)</h2><svg id="tree"></svg></section>
 <section><h2>Tree-attention mask (row: query node; columns: context, then nodes)</h2><svg id="mask"></svg></section>
</main>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const N = D.tokens.length, NS = "http://www.w3.org/2000/svg";
const $ = id => document.getElementById(id);
const childrenOf = parents => {
  const k = parents.map(() => []);
  parents.forEach((p, v) => { if (p >= 0) k[p].push(v); });
  return k;
};
const kids = childrenOf(D.parents);
const txt = id => id < 0 ? "\u2026other" : (D.text[id] ?? "#" + id);
const short = (s, n) => s.length > n ? s.slice(0, n - 1) + "\u2026" : s;
const fmt = x => x >= 0.995 ? x.toFixed(2) : x < 0.005 ? "<.01" : x.toFixed(2).replace(/^0/, "");
function el(tag, attrs, parent, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}

// The acceptance walk of eagletree/verify/accept.py for top-k drafted trees, on data d:
// greedy: follow the child whose token is the target's argmax; sampling: try children in draft order,
// accept child x with the current p(x), else zero p(x) and renormalize; a leaf or all children
// rejected ends the walk with a token drawn from p (the bonus or the correction).
function normalized(p, fallback) {
  let total = 0; for (const x of p.values()) total += x;
  if (!(total > 0)) return fallback;
  const out = new Map(); for (const [t, x] of p) out.set(t, x / total); return out;
}
function draw(p, rand) {
  let total = 0; for (const x of p.values()) total += x;
  let r = rand() * total, last = -1;
  for (const [t, x] of p) { if (x > 0) { last = t; if ((r -= x) < 0) return t; } }
  return last;
}
function walk(d, mode, rand) {
  const k = childrenOf(d.parents), path = [0], levels = [];
  let u = 0;
  for (;;) {
    let p = null;
    if (mode === "sample") { p = new Map(d.dist[u]); p.set(-1, d.other[u]); }
    const level = {node: u, rejected: [], accepted: -1};
    for (const c of k[u]) {
      const x = d.tokens[c];
      if (mode === "greedy" ? x === d.argmax[u] : rand() < (p.get(x) || 0)) { level.accepted = c; break; }
      level.rejected.push(c);
      if (mode === "sample") { const rest = new Map(p); rest.set(x, 0); p = normalized(rest, p); }
    }
    levels.push(level);
    if (level.accepted < 0)
      return {path, levels, next: mode === "greedy" ? d.argmax[u] : draw(p, rand),
              kind: k[u].length ? "correction" : "bonus"};
    path.push(level.accepted);
    u = level.accepted;
  }
}
function mulberry32(a) {
  return () => { a = a + 0x6D2B79F5 | 0; let t = Math.imul(a ^ a >>> 15, 1 | a);
    t = t + Math.imul(t ^ t >>> 7, 61 | t) ^ t; return ((t ^ t >>> 14) >>> 0) / 4294967296; };
}

// ---- header ----
const search = D.search || {};
$("meta").textContent = [D.target, D.step ? "step " + D.step : "", D.tree ? D.tree + " tree" : "",
  Object.entries(search).map(([k, v]) => k.replace(/_/g, "-") + " " + v).join(", "), N + " nodes",
  "context " + D.context_len + " tokens + root",
  "generated " + (D.temperature ? "at temperature " + D.temperature : "greedily")]
  .filter(Boolean).join(" \u00b7 ");
$("ctx").textContent = "\u2026" + (D.context_tail || "");
const rootTag = document.createElement("b"); rootTag.textContent = txt(D.tokens[0]); $("ctx").appendChild(rootTag);
$("ctx").scrollTop = $("ctx").scrollHeight;  // the context's end is what the tree continues
$("chip").textContent = D.expected == null ? "no draft probabilities" : "E[tokens/pass] = " + D.expected.toFixed(3);
$("chip").title = "1 + the sum over nodes of the product of the drafter's q along the root path";
$("chip2").textContent = "under the target: " + D.target_expected.toFixed(3);
$("chip2").title = "the expected tokens/pass of the sampling walk with the target's real distributions";
$("mode").options[1].textContent = "sample (T=" + D.sample_temperature + (D.top_k ? ", top-k " + D.top_k : "") +
  (D.top_p ? ", top-p " + D.top_p : "") + ")";
$("mode").value = D.temperature > 0 ? "sample" : "greedy";

// ---- tree: x by depth, y by leaf order (a parent centred on its children) ----
const ROW = 25, COL = 100, BW = 86, BH = 20, PAD = 8;
const ys = new Array(N); let rows = 0;
(function place(v) {
  if (!kids[v].length) { ys[v] = rows++; return; }
  kids[v].forEach(place);
  ys[v] = (ys[kids[v][0]] + ys[kids[v][kids[v].length - 1]]) / 2;
})(0);
const maxDepth = Math.max(...D.depths);
const X = v => PAD + D.depths[v] * COL, Y = v => PAD + ys[v] * ROW;
const tree = $("tree");
tree.setAttribute("width", 2 * PAD + (maxDepth + 1) * COL + BW + 48);
tree.setAttribute("height", 2 * PAD + rows * ROW + ROW + 8);
const edgeLayer = el("g", {}, tree), nodeLayer = el("g", {}, tree), extraLayer = el("g", {}, tree);
const edges = [], nodes = [];
for (let v = 1; v < N; v++) {
  const u = D.parents[v], x1 = X(u) + BW, y1 = Y(u) + BH / 2, x2 = X(v), y2 = Y(v) + BH / 2, xm = (x1 + x2) / 2;
  const d = `M${x1},${y1} C${xm},${y1} ${xm},${y2} ${x2},${y2}`;
  edges[v] = el("path", {class: "edge", "data-i": v, d}, edgeLayer);
}
for (let v = 0; v < N; v++) {
  const g = el("g", {class: D.copied[v] ? "node copied" : "node", "data-i": v, transform: `translate(${X(v)},${Y(v)})`},
               nodeLayer);
  const value = D.path ? D.path[v] : 0;
  el("rect", {width: BW, height: BH, rx: 4, fill: `hsl(215,75%,${97 - 40 * Math.sqrt(value)}%)`}, g);
  el("text", {x: 5, y: BH / 2 + 1}, g, short(txt(D.tokens[v]), v ? 8 : 12));
  if (v) el("text", {x: BW - 4, y: BH / 2 + 1, "text-anchor": "end", class: "q"}, g, D.q ? fmt(D.q[v]) : "");
  const about = (!v ? " (root)" : D.q ? ` q=${D.q[v].toPrecision(3)} path=${D.path[v].toPrecision(3)}` : "")
    + (D.copied[v] ? " (copied from earlier text)" : "");
  el("title", {}, g, `node ${v}: ${txt(D.tokens[v])}` + about);
  g.addEventListener("mouseenter", () => highlight(v));
  g.addEventListener("mouseleave", () => highlight(-1));
  nodes[v] = g;
}

// ---- mask: one block for the whole context, then one column per node ----
const CELL = Math.max(6, Math.min(13, Math.floor(560 / (N + 4)))), LABEL = 96, CTX = 3 * CELL, TOP = 30;
const mask = $("mask"), maskRows = [];
mask.style.setProperty("--cell", Math.min(10, CELL) + "px");
mask.setAttribute("width", LABEL + CTX + 4 + N * CELL + PAD);
mask.setAttribute("height", TOP + N * CELL + PAD);
const col = el("g", {class: "col"}, mask);
el("text", {x: LABEL + CTX / 2, y: TOP - 8, "text-anchor": "middle"}, col, "ctx");
el("text", {x: LABEL + CTX / 2, y: TOP - 20, "text-anchor": "middle"}, col, "\u00d7" + D.context_len);
const cx = u => LABEL + CTX + 4 + u * CELL;  // x of node u's column
for (let u = 0; u < N; u += 5) el("text", {x: cx(u) + CELL / 2, y: TOP - 8, "text-anchor": "middle"}, col, u);
for (let v = 0; v < N; v++) {
  const g = el("g", {class: "row", "data-i": v, transform: `translate(0,${TOP + v * CELL})`}, mask);
  el("rect", {class: "rowbg", x: 0, y: 0, width: cx(N), height: CELL}, g);
  el("text", {x: LABEL - 4, y: CELL / 2 + 1, "text-anchor": "end"}, g, v + " " + short(txt(D.tokens[v]), 10));
  el("rect", {class: "cell ctx on", x: LABEL, y: 0.5, width: CTX, height: CELL - 1}, g);
  const on = new Set(D.mask[v]);
  for (let u = 0; u < N; u++)
    el("rect", {class: on.has(u) ? "cell on" : "cell", "data-u": u, x: cx(u) + 0.5, y: 0.5,
                width: CELL - 1, height: CELL - 1}, g);
  g.addEventListener("mouseenter", () => highlight(v));
  g.addEventListener("mouseleave", () => highlight(-1));
  maskRows[v] = g;
}

// ---- hover: the node's root path (its mask row: the context, its ancestors, itself) ----
function highlight(v) {
  document.querySelectorAll(".onpath").forEach(e => e.classList.remove("onpath"));
  document.querySelectorAll(".row.hl").forEach(e => e.classList.remove("hl"));
  if (v < 0) return;
  maskRows[v].classList.add("hl");
  for (const u of D.mask[v]) { nodes[u].classList.add("onpath"); if (u) edges[u].classList.add("onpath"); }
  const info = $("info"); info.textContent = "";
  const top = D.dist[v].slice(0, 5).map(([t, p]) => `${txt(t)} ${fmt(p)}`).join("  ");
  const parts = [`node ${v}`, `depth ${D.depths[v]}`, `token ${txt(D.tokens[v])}`];
  if (D.q && v) parts.push(`${D.copied[v] ? "copied, calibrated acceptance" : "q"} ${D.q[v].toPrecision(3)}`,
                          `path product ${D.path[v].toPrecision(3)}`);
  parts.push(`sees ${D.context_len} context tokens + ${D.mask[v].length} tree nodes`);
  info.append(parts.join(" \u00b7 ") + " \u00b7 target's next token: ");
  const c = document.createElement("code"); c.textContent = top; info.appendChild(c);
}

// ---- verification replay ----
let rand = mulberry32(D.seed ?? 0), runs = 0, total = 0, busy = false;
const DELAY = 180;
function clearWalk() {
  document.querySelectorAll(".accepted,.rejected,.out").forEach(e => e.classList.remove("accepted", "rejected", "out"));
  extraLayer.textContent = "";
  $("result").textContent = "";
}
function greySubtree(c) {
  nodes[c].classList.add("out"); edges[c].classList.add("out");
  kids[c].forEach(greySubtree);
}
function showLevel(level) {
  nodes[level.node].classList.add("accepted");
  for (const c of kids[level.node]) {
    if (c === level.accepted) { edges[c].classList.add("accepted"); continue; }
    greySubtree(c);
    if (level.rejected.includes(c)) nodes[c].classList.add("rejected");
  }
}
function finish(r) {
  const last = r.path[r.path.length - 1];
  // A leaf's bonus token goes right of it (nothing else is on a leaf's row further right); a correction,
  // whose column holds the rejected children, goes to the spare row under the tree.
  const gx = X(last) + COL, gy = r.kind === "bonus" ? Y(last) : PAD + rows * ROW;
  const g = el("g", {class: "extra"}, extraLayer);
  const x1 = X(last) + BW, y1 = Y(last) + BH / 2, y2 = gy + BH / 2, xm = (x1 + gx) / 2;
  el("path", {d: `M${x1},${y1} C${xm},${y1} ${xm},${y2} ${gx},${y2}`}, g);
  g.appendChild(el("g", {transform: `translate(${gx},${gy})`})).append(el("rect", {width: BW + 44, height: BH, rx: 4}),
    el("text", {x: 5, y: BH / 2 + 1}, null, short(txt(r.next), 8)),
    el("text", {x: BW + 40, y: BH / 2 + 1, "text-anchor": "end", class: "q"}, null, r.kind));
  const res = $("result");
  res.dataset.path = r.path.join(","); res.dataset.next = r.next; res.dataset.kind = r.kind;
  res.append(`pass ${runs + 1}: accepted `);
  const chip = (cls, text) => {
    const s = document.createElement("span"); s.className = cls; s.textContent = text; return s;
  };
  for (const v of r.path.slice(1)) res.appendChild(chip("acc", txt(D.tokens[v])));
  if (r.path.length === 1) res.append("nothing ");
  res.append(` + ${r.kind} `);
  res.appendChild(chip("bonus", txt(r.next)));
  res.append(` = ${r.path.length} token${r.path.length > 1 ? "s" : ""}`);
  runs += 1; total += r.path.length;
  const counter = $("counter");
  counter.dataset.runs = runs; counter.dataset.mean = (total / runs).toFixed(4);
  counter.textContent = `${runs} run${runs > 1 ? "s" : ""}: mean ${(total / runs).toFixed(3)} tokens/pass` +
    (D.expected == null ? "" : ` (predicted E ${D.expected.toFixed(3)})`);
}
function run() {
  if (busy) return;
  busy = true; $("run").disabled = true; clearWalk();
  const r = walk(D, $("mode").value, rand);
  let i = 0;
  (function next() {
    if (i < r.levels.length) { showLevel(r.levels[i++]); setTimeout(next, DELAY); return; }
    finish(r); busy = false; $("run").disabled = false;
  })();
}
function reset() {
  if (busy) return;
  clearWalk(); runs = 0; total = 0; rand = mulberry32(D.seed ?? 0);
  const counter = $("counter");
  counter.dataset.runs = 0; delete counter.dataset.mean; counter.textContent = "no runs yet";
}
$("run").addEventListener("click", run);
$("reset").addEventListener("click", reset);
$("mode").addEventListener("change", reset);
window.viz = {data: D, walk, mulberry32};
</script></body></html>
"""

"""Bench reports: the machine, results.md (a table per temperature), the PNG plots and results.json."""

from __future__ import annotations

import os
import platform
from importlib.metadata import version
from pathlib import Path

import torch

from ..files import write_json_atomic, write_text_atomic
from ..packing import cpu_features, cpu_model
from .inputs import BASELINE_LABELS, METHODS, TREE_METHODS


def machine_info(model) -> dict:
    """Where the numbers come from."""
    device = next(model.parameters()).device
    info = {
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "device": device.type,
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _x(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown_table(report: dict, temperature: float) -> str:
    """The results table of one temperature."""
    rows = [r for r in report["results"] if r["temperature"] == temperature]
    lines = [
        (
            "| method | budget | tokens/pass | predicted | tokens/s (median) | speedup vs plain, same kernels "
            "(median, range) | speedup vs plain HF generate, stock kernels (median, range) "
            "| first pass s (median) | identical to plain |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def spread(s):
        return "-" if not s or s["median"] is None else f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"

    for r in rows:
        same = "n/a" if r["identical"] is None else "yes" if r["identical"] else f"NO ({len(r['mismatches'])})"
        lines.append(
            f"| {r['method']} | {_x(r['budget'], '{}')} | {r['tokens_per_pass']:.2f} | "
            f"{_x(r['predicted_tokens_per_pass'])} | {_x(r['tokens_per_s'], '{:.1f}')} | "
            f"{'-' if r['method'] in ('plain', 'packed') else spread(r.get('speedup_same_kernels'))} | "
            f"{spread(r['speedup'])} | {_x(r['first_pass_s'])} | {same} |"
        )
    return "\n".join(lines)


def vocab_words(size) -> str:
    """A head's drafting vocabulary in a report: "full" or its number of tokens."""
    return "the full vocabulary" if size == "full" else f"its {size:,}-token draft vocabulary"


def markdown_report(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    machine = (
        f"{m['cpu']}"
        + (f" ({m['cpu_features']})" if m.get("cpu_features") else "")
        + f", {m['cores']} cores, {m.get('torch_threads', '?')} torch threads"
        + (f", {m['gpu']}" if "gpu" in m else "")
    )
    out = [
        f"# eagletree bench\n\n`{report['command']}`\n",
        f"Machine: {machine}; Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}; "
        f"{m['device']}, target {m['dtype']}, head {s.get('head_dtype')}"
        + (f", drafting over {vocab_words(s['draft_vocab'])}" if s.get("draft_vocab") else "")
        + "; "
        + (
            "target Linears packed for oneDNN in every row but plain (PyTorch's stock kernels)"
            + (f" where measured faster here ({s['kernels_measured']})" if s.get("kernels_measured") else "")
            + "; 'packed' is plain HF generate with the same kernels as the trees, so each row's speedup over it "
            "is drafting's alone and 'packed' over 'plain' is the kernels' own gain.\n"
            if s.get("packed")
            else "PyTorch's stock kernels in every row (the same kernels as plain)"
            + (f"; packing was measured slower here ({s['kernels_measured']})" if s.get("kernels_measured") else "")
            + ".\n"
        ),
        (
            f"Target {s['target']}, head {s['head']}; {report['prompts']} prompts ({s['prompts']}), "
            f"{report['max_new_tokens']} new tokens each; depth {s['depth']}, top-k {s['top_k_draft']}; "
            f"prompt lookup {report['lookup_tokens']} tokens; Sequoia acceptance by rank "
            f"{report['accept_by_rank_source']}; {report['seconds']:.0f} s in all.\n"
        ),
    ]
    for t in report["temperatures"]:
        plain = next(r for r in report["results"] if r["temperature"] == t and r["method"] == "plain")
        out.append(
            f"## Temperature {t:g}{' (greedy)' if not t else ''}\n\nplain decoding: "
            f"{_x(plain['tokens_per_s'], '{:.1f}')} tokens/s (median over prompts)\n\n"
            f"{markdown_table(report, t)}\n"
        )
    batch = report.get("batch_size", 1)
    out.append(
        f"Batches of {batch} prompts: every row decodes the prompts {batch} at a time (plain and packed: HF "
        "`generate` on left-padded batches; tree methods: eagletree's batched decoding, one node budget per "
        "sequence shared by the batch), each batch right after plain's. tokens/s and speedups are each batch's "
        "throughput (all its tokens over its seconds, prefill included); the speedup's range is over batches, "
        "tokens/pass counts every sequence's passes, and 'first pass s' is the batch's prefill.\n"
        if batch > 1
        else "tokens/s and speedups are decoding rates after each run's first target pass (the prompt's prefill), "
        "per prompt; the speedup's range is over prompts. Sampled outputs differ in length, so end-to-end "
        "rates would mix in the prefill's varying share (they are in results.json).\n"
    )
    out.append("Plots: " + ", ".join(f"[{p}]({p})" for p in report.get("plots", [])) + "\n")
    return "\n".join(out)


def where(report) -> str:
    """The target and machine a figure's numbers come from."""
    m = report["machine"]
    device = m.get("gpu") or f"{m['cpu']}, {m.get('torch_threads', '?')} threads"
    return f"{report['settings']['target']}, {m['dtype']}, {device}"


def like_for_like(r) -> dict:
    """A row's speedup over plain decoding with the same kernels (vs the packed row on a packed target)."""
    return r.get("speedup_same_kernels") or r["speedup"]


def _families(report, temperature):
    """Tree and lookup results of one temperature, grouped by method name in run order."""
    fam = {}
    for r in report["results"]:
        if r["temperature"] == temperature and r["method"] != "plain":
            fam.setdefault(r["method"], []).append(r)
    return fam


MARKER = dict(zip(TREE_METHODS, "s^oDv<>PX"))
COLOR = {name: f"C{i}" for i, name in enumerate(METHODS)}  # one color per method in every plot


def write_plots(report: dict, out: Path) -> list[str]:
    """tokens/pass and speedup vs budget, accepted-length histogram, calibration; returns the file names."""
    import matplotlib  # only here: the plots are the one use, and it is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    if any(r["budget"] for r in report["results"]):  # (--methods lookup or packed alone: no budget axis)
        names.append(
            _by_budget(
                plt,
                report,
                out,
                "tokens_per_pass.png",
                "tokens per target pass",
                lambda r: r["tokens_per_pass"],
                baseline=1.0,
            )
        )
        names.append(
            _by_budget(
                plt,
                report,
                out,
                "speedup.png",
                "speedup over plain decoding",
                lambda r: like_for_like(r)["median"],
                spread=lambda r: (like_for_like(r)["min"], like_for_like(r)["max"]),
                baseline=1.0,
                title="speedup over plain decoding, same kernels (median, range over prompts)",
            )
        )
    for plot in (_accepted_lengths, _calibration):
        name = plot(plt, report, out)
        if name is not None:
            names.append(name)
    return names


def _by_budget(
    plt, report: dict, out: Path, fname: str, ylabel: str, value, spread=None, baseline=None, title=None
) -> str:
    """`value` of every tree method against the budget, a panel per temperature (`spread`: (low, high) error bars;
    the lookup and packed baselines as lines); returns the file name."""
    temps = report["temperatures"]
    budgets = sorted({r["budget"] for r in report["results"] if r["budget"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(max(5.5 * len(temps), 7.5), 4.2), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], temps):
        families = _families(report, t)
        for j, (name, rs) in enumerate(families.items()):
            rs = [r for r in rs if value(r) is not None]
            if not rs:
                continue
            if name in BASELINE_LABELS:
                ax.axhline(
                    value(rs[0]), color="gray" if name == "lookup" else "C9", ls="--", label=BASELINE_LABELS[name]
                )
                continue
            # Methods side by side at each budget (a small shift on the log axis), so points never hide.
            shift = 2 ** (0.05 * (j - (len(families) - 1) / 2))
            xs, ys = [r["budget"] * shift for r in rs], [value(r) for r in rs]
            style = {"marker": MARKER[name], "color": COLOR[name], "label": name}
            if spread:
                lo, hi = zip(*(spread(r) for r in rs))
                ax.errorbar(
                    xs, ys, yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]], capsize=3, **style
                )
            else:
                ax.plot(xs, ys, **style)
        if baseline is not None:
            ax.axhline(baseline, color="black", lw=0.8, label="plain decoding")
        ax.set_xscale("log", base=2)
        ax.set_xlim(budgets[0] / 1.25, budgets[-1] * 1.25)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("budget (tree nodes per pass)")
        ax.set_title(f"temperature {t:g}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"{title or ylabel}\n{where(report)}", fontsize=10)
    return _save(plt, fig, out, fname)


def _accepted_lengths(plt, report: dict, out: Path) -> str | None:
    """Accepted lengths: each tree method at its largest budget, greedy (or the first temperature); None when no
    method has a histogram."""
    temps = report["temperatures"]
    shown_t = 0.0 if 0.0 in temps else temps[0]
    fam = {k: v for k, v in _families(report, shown_t).items() if k not in BASELINE_LABELS}
    shown = [rs[-1] for rs in fam.values() if rs[-1]["accepted_histogram"]]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lengths = sorted({int(k) for r in shown for k in r["accepted_histogram"]})
    width = 0.8 / len(shown)
    for j, r in enumerate(shown):
        hist = {int(k): v for k, v in r["accepted_histogram"].items()}
        total = sum(hist.values())
        ax.bar(
            [n + (j - (len(shown) - 1) / 2) * width for n in lengths],
            [hist.get(n, 0) / total for n in lengths],
            width,
            color=COLOR[r["method"]],
            label=f"{r['label']} (mean {r['tokens_per_pass']:.2f})",
        )
    ax.set_xticks(lengths)
    ax.set_xlabel("tokens emitted per target pass")
    ax.set_ylabel("share of passes")
    ax.set_title(f"accepted lengths, temperature {shown_t:g}\n{where(report)}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, out, "accepted_lengths.png")


def _calibration(plt, report: dict, out: Path) -> str | None:
    """Predicted against measured acceptance per node and tokens/pass per method (greedy); None when there is
    neither."""
    cal = report["calibration"]
    greedy = [r for r in report["results"] if not r["temperature"] and r["predicted_tokens_per_pass"] is not None]
    if not (cal["bins"] or greedy):
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    _node_calibration(a1, cal)
    _method_calibration(a2, greedy)
    fig.suptitle(where(report), fontsize=10)
    return _save(plt, fig, out, "calibration.png")


def _node_calibration(ax, cal: dict) -> None:
    """Measured acceptance of drafted nodes per bin of predicted acceptance (raw and calibrated)."""
    for key, label in (("bins", "draft probability"), ("calibrated_bins", f"calibrated ({cal.get('calibrator')})")):
        bins = cal.get(key) or []
        if bins:
            ax.scatter(
                [b["predicted"] for b in bins],
                [b["measured"] for b in bins],
                s=[20 + 200 * b["nodes"] / cal["nodes"] for b in bins],
                label=label,
                alpha=0.8,
            )
    ax.plot([0, 1], [0, 1], color="black", lw=0.8)
    ax.set(
        xlim=(0, 1),
        ylim=(0, 1),
        xlabel="predicted acceptance of a node",
        ylabel="measured acceptance",
        title=f"per node, greedy ({cal['nodes']} tried nodes; size = share)",
    )
    if cal["bins"] or cal.get("calibrated_bins"):
        ax.legend(fontsize=8)
    else:  # (an empty legend is a matplotlib warning, and an empty panel says nothing)
        ax.text(0.5, 0.5, "no drafted node was tried", ha="center", va="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)


def _method_calibration(ax, greedy: list[dict]) -> None:
    """Measured against predicted tokens/pass of each greedy result, labelled with its budget."""
    labelled = set()
    for r in greedy:
        name, xy = r["method"], (r["predicted_tokens_per_pass"], r["tokens_per_pass"])
        hollow = name == "optimal"  # often on top of eagle2
        ax.scatter(
            *xy,
            label=None if name in labelled else name,
            marker=MARKER[name],
            s=80 if hollow else 36,
            facecolors="none" if hollow else COLOR[name],
            edgecolors=COLOR[name],
        )
        ax.annotate(
            str(r["budget"]), xy, xytext=(-14, 4) if hollow else (5, -3), textcoords="offset points", fontsize=7
        )
        labelled.add(name)
    top = max([1.5] + [max(r["predicted_tokens_per_pass"], r["tokens_per_pass"]) * 1.1 for r in greedy])
    ax.plot([1, top], [1, top], color="black", lw=0.8)
    ax.set(
        xlim=(1, top),
        ylim=(1, top),
        xlabel="predicted tokens/pass",
        ylabel="measured tokens/pass",
        title="per method and budget, greedy",
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)


def _save(plt, fig, out: Path, fname: str) -> str:
    """Lay out, write and close a figure; returns its file name."""
    fig.tight_layout()
    fig.savefig(out / fname, dpi=110)
    plt.close(fig)
    return fname


def write_outputs(report: dict, out) -> Path:
    """results.json, the PNG plots and results.md (the tables) in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report["plots"] = []
    write_json_atomic(out / "results.json", report)  # first: the measurements are kept whatever the plots do
    write_text_atomic(out / "results.md", markdown_report(report))
    report["plots"] = write_plots(report, out)
    write_json_atomic(out / "results.json", report)
    write_text_atomic(out / "results.md", markdown_report(report))  # now with the plots it links
    return out

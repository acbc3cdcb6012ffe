"""`eagletree bench`: the command (arguments from the CLI's parser)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ..decode.config import MIN_TEMPERATURE
from ..decode.resources import resolve_store
from ..errors import InvalidValue
from ..files import check_output_folder
from ..loading import head_to_load, load_models
from ..packing import is_packed, kernels_used
from ..search.store import DATASTORE
from .inputs import DEFAULT_METHODS, FULL, HEADLESS, QUICK, TREE_METHODS, Method, load_prompts, method_grid, parse_list
from .report import machine_info, write_outputs
from .runners import BenchSettings, run_bench


def typed_command(name: str) -> str:
    """The command line as typed, for the report (`eagletree NAME` when run from Python)."""
    return "eagletree " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == [name] else f"eagletree {name}"


def _temperatures(text: str) -> list[float]:
    """--temperatures as a list; ValueError for a value decoding refuses or one listed twice."""
    temperatures = parse_list(text, float, "temperatures")
    if any(not t >= 0 or t == float("inf") or 0 < t < MIN_TEMPERATURE for t in temperatures):  # (NaN fails all)
        raise InvalidValue(f"--temperatures must be finite numbers, 0 or >= {MIN_TEMPERATURE:g}, got {temperatures}")
    if len(set(temperatures)) < len(temperatures):
        raise InvalidValue(f"--temperatures lists a temperature twice: {temperatures}")
    return temperatures


def _methods(args, budgets: list[int]) -> list[Method]:
    """The method grid --methods (default: every method, HF prompt lookup only at --batch-size 1) asks for."""
    names = args.methods
    if names is None:  # HF prompt lookup decodes one sequence at a time: not in a batched run's default
        names = DEFAULT_METHODS if args.batch_size == 1 else DEFAULT_METHODS.removesuffix(",lookup")
    methods = method_grid(parse_list(names, str, "methods"), budgets, args.depth, args.top_k_draft)
    if args.batch_size > 1 and any(m.name == "lookup" for m in methods):
        raise InvalidValue(
            "--methods lookup: HF prompt lookup decodes one sequence at a time; drop it for --batch-size > 1"
        )
    return methods


def main(args) -> int:
    """`eagletree bench` (arguments from the CLI parser)."""
    command = typed_command("bench")
    check_output_folder(args.out, "-o/--out")  # before minutes of measuring
    preset = QUICK if args.quick else FULL
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else preset[name]  # noqa: E731
    budgets = parse_list(pick("budgets"), int, "budgets")
    temperatures = _temperatures(pick("temperatures"))
    methods = _methods(args, budgets)
    max_new_tokens = pick("max_new_tokens")
    prompts = load_prompts(pick("prompts"))
    batch_sizes = _batch_sizes(args)
    head_dir = head_to_load(args.target, args.head or None, required=False)
    if head_dir is None and any(m.name in TREE_METHODS and m.name not in HEADLESS for m in methods):
        raise InvalidValue("tree methods need a draft head; pass --head DIR or --methods lookup,copy")  # before loading
    model, tok, head, packed = load_models(
        args.target,
        head_dir,
        device=args.device,
        dtype=args.dtype,
        pack=args.pack,
        head_dtype=args.draft_dtype,
        draft_vocab=args.draft_vocab,
    )
    if args.batch_sizes is not None:
        return _throughput(args, model, tok, head, prompts, max_new_tokens, batch_sizes, command)
    methods = _with_packed_row(methods, packed or is_packed(model))
    used = _datastore(args, methods, model, tok, head)
    settings = BenchSettings(
        tuple(temperatures), max_new_tokens, args.seed, args.lookup_tokens, store=used, batch_size=args.batch_size
    )
    report = run_bench(model, tok, head, prompts, methods, settings)
    report.update(
        command=command,
        machine=machine_info(model),
        settings=_settings(args, model, head, head_dir, used, budgets, methods, pick("prompts")),
    )
    out = write_outputs(report, args.out)
    print("\n" + (out / "results.md").read_text())
    print(f"wrote {out}/results.json, results.md, {', '.join(report['plots'])}", file=sys.stderr)
    return 0


def _batch_sizes(args) -> list[int] | None:
    """--batch-sizes as a list (None: not asked for); ValueError for a size < 1, one listed twice, or --repeats
    without it."""
    batch_sizes = None if args.batch_sizes is None else parse_list(args.batch_sizes, int, "batch-sizes")
    if batch_sizes is not None and (min(batch_sizes) < 1 or len(set(batch_sizes)) < len(batch_sizes)):
        raise InvalidValue(f"--batch-sizes must be distinct integers >= 1, got {batch_sizes}")
    if getattr(args, "repeats", 1) != 1 and batch_sizes is None:
        raise InvalidValue(f"--repeats {args.repeats} repeats the throughput sweep: pass --batch-sizes too")
    return batch_sizes


def _with_packed_row(methods: list[Method], packed: bool) -> list[Method]:
    """On a packed target, the 'packed' row first (added when not listed); ValueError for it on any other."""
    if packed:
        # first, so that every tree row's same-kernels speedup is against it (a row before it was compared with
        # stock plain decoding, the kernels' own gain included), and added when not listed
        return [Method("packed")] + [m for m in methods if m.name != "packed"]
    if any(m.name == "packed" for m in methods):
        raise InvalidValue(
            "method 'packed' (plain decoding with packed kernels) needs a packed target; "
            "drop it or pass --pack on/auto on a CPU"
        )
    return methods


def _datastore(args, methods: list[Method], model, tok, head):
    """The datastore the +copy rows copy from, read once (None: none, or no row copies). A head's store that does
    not suit the target is refused with a warning, and is not named in the report."""
    store = None if args.datastore == "none" else "auto"
    copying = any(m.copy for m in methods)
    if store is None or head is None or not copying:
        return None
    return resolve_store(store, head, tok, True, model.get_input_embeddings().num_embeddings)


def _throughput(args, model, tok, head, prompts, max_new_tokens, batch_sizes, command) -> int:
    """`bench --batch-sizes`: the batched throughput table and plot in --out."""
    from ..decode.config import DecodeConfig
    from ..files import write_json_atomic, write_text_atomic
    from .throughput import plot_throughput, throughput, throughput_table

    if head is None:
        raise InvalidValue("--batch-sizes compares decoding with the head's trees: pass --head DIR")
    result = throughput(
        model, tok, head, prompts, batch_sizes, DecodeConfig(max_new_tokens=max_new_tokens), repeats=args.repeats
    )
    result.update(command=command, machine=machine_info(model), max_new_tokens=max_new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = throughput_table(result)
    write_json_atomic(out / "throughput.json", result)
    write_text_atomic(out / "throughput.md", f"`{command}`\n\n{table}\n\n![throughput](throughput.png)\n")
    plot_throughput(result, out / "throughput.png")
    print(table)
    print(f"wrote {out}/throughput.json, throughput.md, throughput.png", file=sys.stderr)
    return 0


def _settings(args, model, head, head_dir, used, budgets, methods, prompts) -> dict:
    """The report's settings: what ran, and how."""
    return {
        "target": args.target,
        "head": str(args.head if head_dir is None else head_dir),
        "prompts": prompts,
        "packed": is_packed(model),
        "kernels": kernels_used(model),
        "kernels_measured": None if getattr(model, "kernel_choice", None) is None else model.kernel_choice.summary(),
        "draft_kernels": None if head is None else kernels_used(head),
        "datastore": None if used is None else str(head.companion_file(DATASTORE)),
        "head_dtype": None if head is None else str(next(head.parameters()).dtype)[6:],
        "draft_vocab": None if head is None else head.config.draft_vocab_size or "full",
        "budgets": budgets,
        "depth": args.depth,
        "top_k_draft": args.top_k_draft,
        "methods": [m.label for m in methods],
        "batch_size": args.batch_size,
        "quick": args.quick,
    }

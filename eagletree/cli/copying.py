"""`eagletree calibrate-copy` (how often copied spans are accepted, a table next to the head) and `eagletree
datastore` (a corpus of answers indexed for retrieved spans, next to the head): what copying reads."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidValue
from .common import add_model_args, at_least, refuse_head_none


def add_copying_parsers(sub) -> None:
    """The subparsers of calibrate-copy and datastore."""
    p = sub.add_parser("calibrate-copy", help="measure how often copied spans are accepted; saved next to the head")
    add_model_args(p, needs_head=True)
    p.add_argument(
        "--prompts",
        default="heldout:30",
        help="heldout:N, mtbench[:N], humaneval[:N], humaneval:A-B or a .jsonl file "
        "(default heldout:30: held-out ShareGPT, not MT-bench)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=60)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument(
        "--out",
        default=None,
        help="default: HEAD/copy_calibration.json, or HEAD/copy_calibration.full-vocab"
        ".json when the head drafts over the full vocabulary (--draft-vocab)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a table that is already there")
    p.set_defaults(func=cmd_calibrate_copy)

    p = sub.add_parser("datastore", help="index a corpus of answers for retrieved spans; saved next to the head")
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        nargs="+",
        metavar="JSONL",
        help="chat JSONL files whose assistant turns are indexed, e.g. `eagletree distill`'s answers to "
        "training prompts (never the prompts you evaluate on); a record id seen again replaces the "
        "earlier answer",
    )
    p.add_argument("--target", default="smollm2-135m", help="alias, HF model folder or .gguf file (its tokenizer)")
    p.add_argument(
        "--head", default=None, help="the head folder to save it in (default: the head shipped for the target)"
    )
    p.add_argument("--out", default=None, help="default: HEAD/datastore.npz")
    p.add_argument(
        "--min-match",
        type=at_least(1),
        default=5,
        help="the fewest context tokens a retrieved span's match needs (shorter matches draft poorly)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a datastore that is already there")
    p.set_defaults(func=cmd_datastore)


def _check_calibrate_flags(args) -> None:
    """calibrate-copy's refusals before anything is read: counts, --head none, an --out that cannot be written."""
    from ..decode.config import check_options
    from ..files import check_output_file

    check_options(cli=True, max_new_tokens=args.max_new_tokens, budget=args.budget, depth=args.depth)
    refuse_head_none(args, "calibrate-copy", "measures the copied spans next to a head's candidates")
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 2), ("--budget", args.budget, 2)):
        if value < least:  # fewer would try no copied span, and the table would be replaced by an uninformed one
            raise InvalidValue(
                f"{flag} must be >= {least} for calibrate-copy (a copied span needs room to be tried), got {value}"
            )
    if args.out:
        check_output_file(args.out)


def cmd_calibrate_copy(args) -> int:
    """Measure how often copied spans are accepted and save it next to the head (copy_calibration.json)."""
    from ..bench import load_prompts
    from ..search.copy import bin_labels, copy_calibration_names
    from ..train.evaluate import measure_copy_calibration
    from .models import load_from_args

    _check_calibrate_flags(args)
    prompts = load_prompts(args.prompts)
    if args.out and Path(args.out).exists() and not args.overwrite:
        raise InvalidValue(f"--out {args.out!r} exists; pass --overwrite to replace it")
    model, tok, head = load_from_args(args)
    out = Path(args.out) if args.out else head.folder / copy_calibration_names(head.is_widened())[0]
    if out.exists() and not args.overwrite:  # (a head's table may have taken an hour of prompts to measure)
        raise InvalidValue(
            f"{out} holds a copy table already; pass --overwrite to replace it with this run's, or --out "
            "to write it elsewhere"
        )
    calibration, result = measure_copy_calibration(
        head, model, tok, prompts, args.max_new_tokens, budget=args.budget, depth=args.depth, top_k_draft=10
    )
    if not calibration.tried.sum():
        raise InvalidValue(
            f"no copied span was tried on these {len(prompts)} prompts (their answers repeated nothing "
            f"of their context), so there is nothing to measure; {out} was left as it was. Use more or "
            "longer prompts (--prompts heldout:64, --max-new-tokens 128)"
        )
    calibration.save(out)
    first = calibration.rate()[:, 0].tolist()
    print(
        f"wrote {out}: {int(calibration.tried.sum())} copied tokens tried, {int(calibration.accepted.sum())} "
        f"accepted on {len(prompts)} prompts ({result['tokens_per_pass']:.3f} tokens/pass, drafting over "
        f"{head.drafted_vocab_size()} tokens); first-token acceptance "
        f"by match length {'/'.join(bin_labels())}: " + " ".join(f"{r:.2f}" for r in first)
    )
    return 0


def _datastore_sources(paths: list[str]) -> list[Path]:
    """--from's files, each once; ValueError naming one that is not a file."""
    sources = []
    for source in map(Path, paths):
        if not source.is_file():
            raise InvalidValue(f"--from {str(source)!r}: no such file")
        if source.resolve() not in [s.resolve() for s in sources]:  # a file named twice is read once
            sources.append(source)
    return sources


def _datastore_out(args) -> Path:
    """Where the datastore goes: --out, else the head folder's datastore.npz (a saved head's folder)."""
    from ..files import check_output_file
    from ..loading import head_to_load
    from ..search.store import DATASTORE

    if args.out:
        check_output_file(args.out)
        return Path(args.out)
    folder = head_to_load(args.target, args.head)
    if folder is None:
        raise InvalidValue("--head none: a datastore is saved next to a head; pass a head folder, or --out FILE")
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise InvalidValue(
            f"--head {str(folder)!r} is not a saved head (no config.json); pass --out to write the datastore elsewhere"
        )
    return folder / DATASTORE


def cmd_datastore(args) -> int:
    """Index the assistant turns of a chat JSONL file for retrieved spans, saved next to the head (datastore.npz)."""
    from .. import target
    from ..draft import HeadError
    from ..loading import load_head
    from ..search.store import index_answers

    sources = _datastore_sources(args.source)
    out = _datastore_out(args)
    if out.exists() and not args.overwrite:
        raise InvalidValue(f"{out} exists; pass --overwrite to replace it, or --out to write elsewhere")
    model, tok = target.load_target(args.target, device="cpu")
    if not args.out:  # saved next to a head: it must draft for this target (the store holds this tokenizer's ids)
        try:
            load_head(out.parent, target_config=model.config)
        except HeadError as e:
            raise InvalidValue(f"--head {str(out.parent)!r}: {e}") from None
    header = index_answers(sources, tok, out, args.min_match, replace=args.overwrite)
    print(
        f"wrote {out}: {header['tokens']:,} tokens of {header['texts']:,} answers from "
        f"{', '.join(map(str, sources))}, matches of {args.min_match}+ tokens"
    )
    return 0

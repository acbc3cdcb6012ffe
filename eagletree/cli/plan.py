"""`eagletree plan`: the best static tree for a head on a device, written as a serving engine's settings (the
engines come from `eagletree.serve`'s registry; the planning is `eagletree.plan`'s)."""

from __future__ import annotations

import sys
from pathlib import Path

from .. import serve
from ..errors import InvalidValue
from .common import add_model_args, at_least, refuse_head_none

EXPORT_PLACEHOLDER = "EXPORT_DIR"  # plan's --export default: the engine's settings name no folder yet


def add_plan_parser(sub) -> None:
    """The subparser of plan."""
    p = sub.add_parser("plan", help="the best static tree for a head on a device, as vLLM/SGLang/EAGLE settings")
    add_model_args(p, needs_head=True)
    p.add_argument("--engine", required=True, choices=serve.engine_names())
    p.add_argument(
        "--profile",
        default=None,
        help="latency profile JSON (eagletree profile's "
        "profile.json, or a cached LatencyProfile); default: measure "
        "on --device. --engine llamacpp: llama.cpp's measured costs, as scripts/profile_llamacpp.py writes them",
    )
    p.add_argument(
        "--project-weights-gb",
        type=float,
        default=None,
        help="--engine llamacpp: also project the choice for a GGUF target of this many GB of weights",
    )
    p.add_argument(
        "--export",
        default=EXPORT_PLACEHOLDER,
        help="the folder the head was exported to (named in the engine's settings)",
    )
    p.add_argument("--max-nodes", type=at_least(2), default=64, help="the most tree nodes per pass, root included")
    p.add_argument("--max-depth", type=at_least(1), default=8)
    p.add_argument("--top-k-draft", type=at_least(1), default=10, help="ranks measured per depth")
    p.add_argument(
        "--prompts",
        default="mtbench:32",
        help="heldout:N, mtbench[:N] or a .jsonl file, like the prompts served; the first half measures the "
        "acceptance (at least 1,000 answer positions advised: fewer are warned about), the second checks the tree",
    )
    p.add_argument("--max-new-tokens", type=at_least(1), default=96)
    p.add_argument(
        "--acceptance",
        default=None,
        help="reuse the acceptance of an earlier plan's JSON, measured "
        "over the same draft vocabulary (the first half of the prompts "
        "is then not decoded)",
    )
    p.add_argument("-o", "--out", default="plan.json", help="the plan as JSON")
    p.set_defaults(func=cmd_plan)


def _check_export(export: str) -> None:
    """ValueError unless --export is the placeholder or a folder `eagletree export` wrote."""
    if export != EXPORT_PLACEHOLDER and not (Path(export) / "config.json").is_file():
        what = "has no config.json" if Path(export).is_dir() else "no such folder"
        raise InvalidValue(
            f"--export {export!r}: {what}; expected the folder `eagletree export` wrote (the plan names it in "
            f"the engine's settings), or leave --export out for the placeholder {EXPORT_PLACEHOLDER}"
        )


def _engine_vocab(args, head) -> None:
    """plan --draft-vocab auto: draft over the vocabulary the --engine drafts the export over, so that plan measures
    the ranks the engine will see: vLLM and EAGLE score an EAGLE-1/2 export's tokens over the full vocabulary (no
    token map), SGLang over the head's token map; a head with its own lm_head keeps its vocabulary everywhere."""
    if args.draft_vocab == "auto" and serve.engine(args.engine).full_vocab and head.can_widen_vocab():
        head.widen_vocab()
        print(
            f"plan: drafting over the full vocabulary, as {args.engine} drafts this head's export "
            "(--draft-vocab head to keep the head's own)",
            file=sys.stderr,
        )


def cmd_plan(args) -> int:
    """The best static tree for a head and a device, written as vLLM's, SGLang's or EAGLE's settings."""
    from .. import plan

    if serve.engine(args.engine).measured_costs:
        return _plan_from_engine_costs(args)
    from ..bench import load_prompts
    from ..files import check_output_file, write_json_atomic
    from .models import load_from_args

    data, acceptance = plan.read_acceptance(args.acceptance) if args.acceptance else (None, None)
    check_output_file(args.out, "-o/--out")
    _check_export(args.export)
    refuse_head_none(args, "plan", "chooses a tree for a draft head")
    profile = plan.load_profile(args.profile) if args.profile else None
    measure, check = plan.split_prompts(load_prompts(args.prompts))
    model, tok, head = load_from_args(args)
    if head is None:
        raise InvalidValue("plan needs a draft head (--head DIR)")
    _engine_vocab(args, head)
    if data is not None:
        plan.check_reused_acceptance(data, head, args.acceptance, args.engine)
    if profile is None:
        profile = plan.measure_profile(model, head)  # the verify pass, measured on --device once and cached
    options = plan.PlanOptions(
        args.engine,
        args.export,
        max_nodes=args.max_nodes,
        max_depth=args.max_depth,
        top_k=args.top_k_draft,
        max_new_tokens=args.max_new_tokens,
    )
    result = plan.make_plan(model, tok, head, profile, measure, check, options, acceptance=acceptance)
    result["prompts"] = args.prompts
    write_json_atomic(args.out, result)
    print(plan.summary(result))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if result["check"]["within_tolerance"] else 1


def _plan_from_engine_costs(args) -> int:
    """plan --engine llamacpp: the head's own greedy chains on the first half of the prompts, llama.cpp's measured
    costs from --profile; the second half is left for scripts/check_llamacpp.py --plan to check in llama.cpp."""
    from .. import plan, plan_llamacpp
    from ..bench import load_prompts
    from ..files import check_output_file, write_json_atomic
    from .models import load_from_args

    if args.profile is None:
        raise InvalidValue(
            f"plan --engine {args.engine} needs the engine's measured costs: run scripts/profile_llamacpp.py "
            "--head DIR --out COSTS.json and pass --profile COSTS.json"
        )
    if args.project_weights_gb is not None and not args.project_weights_gb > 0:
        raise InvalidValue(f"--project-weights-gb must be > 0, got {args.project_weights_gb}")
    check_output_file(args.out, "-o/--out")
    refuse_head_none(args, "plan", "chooses a tree for a draft head")
    profile = plan_llamacpp.read_costs(args.profile)
    measure, _check = plan.split_prompts(load_prompts(args.prompts))
    model, tok, head = load_from_args(args)
    if head is None:
        raise InvalidValue("plan needs a draft head (--head DIR)")
    if head.head_type != profile["head_type"]:
        raise InvalidValue(
            f"--profile {args.profile!r} measured a {profile['head_type']!r} head in llama.cpp; --head is "
            f"{head.head_type!r}"
        )
    depth = min(args.max_depth, head.drafting.max_depth or args.max_depth)
    chains = plan_llamacpp.own_chains(model, tok, head, measure, args.max_new_tokens, depth)
    export = "EXPORT_DIR" if args.export == EXPORT_PLACEHOLDER else args.export
    per_draft = head.drafting.level_calls > 0  # EAGLE-3 drafts a token a call; a block head its block in one
    result = plan_llamacpp.plan_llamacpp(
        chains, profile, export, per_draft, args.max_new_tokens, args.project_weights_gb
    )
    result |= {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens}
    write_json_atomic(args.out, result)
    print(plan_llamacpp.summary(result))
    print(
        f"wrote {args.out}; check it in llama.cpp: python scripts/check_llamacpp.py --plan {args.out}", file=sys.stderr
    )
    return 0

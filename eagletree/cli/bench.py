"""`eagletree bench` (speculative vs plain and prompt-lookup decoding on the same prompts, with plots) and
`eagletree profile` (a device's acceptance-independent costs on random weights): the measuring is
`eagletree.bench`'s."""

from __future__ import annotations

from .common import DEFAULTS, add_model_args, at_least


def add_bench_parsers(sub) -> None:
    """The subparsers of bench and profile."""
    add_bench_parser(sub)
    add_profile_parser(sub)


def add_bench_parser(sub) -> None:
    """The subparser of bench."""
    p = sub.add_parser("bench", help="speculative vs plain and prompt-lookup decoding on the same prompts; plots")
    add_model_args(p)
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on CUDA"
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="mtbench[:N] (MT-bench first turns), humaneval[:N], humaneval:A-B (problems A to B), heldout:N "
        "(held-out ShareGPT first user turns; default heldout:8, --quick heldout:2) or a .jsonl file "
        "of prompts/messages",
    )
    p.add_argument("--max-new-tokens", type=at_least(1), default=None, help="default 64 (--quick 24)")
    p.add_argument(
        "--methods",
        default=None,
        help="default chain,sequoia,eagle2,eagle2+copy,optimal,auto,auto+copy,copy,lookup (without lookup at "
        "--batch-size > 1); plain decoding (stock kernels) always runs, and with a packed target also 'packed' (plain "
        "decoding with the packed kernels); NAME+copy = the head's tree with copied spans of earlier "
        "text (and retrieved spans from the head's datastore.npz, see --datastore); copy = copied "
        "spans alone in eagletree's tree (no head); lookup = HF prompt-lookup decoding",
    )
    p.add_argument(
        "--batch-size",
        type=at_least(1),
        default=1,
        help="prompts decoded together by every method (default 1: one at a time, as tokens/pass is measured); "
        "more: plain and packed run HF generate on left-padded batches, the tree methods eagletree's batched "
        "decoding, and tokens/s and speedups are each batch's throughput",
    )
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="instead of the method grid, the batched throughput table and plot (throughput.md, .json, .png): "
        "tokens/s of HF batched generate, eagletree plain and eagletree with trees (the default tree) at each "
        "of these batch sizes, e.g. 1,2,4,8,16",
    )
    p.add_argument(
        "--repeats",
        type=at_least(1),
        default=1,
        help="with --batch-sizes: rounds per batch size, the methods alternating; the table shows median rates "
        "and each round's trees / plain range",
    )
    p.add_argument(
        "--datastore",
        default="auto",
        choices=["auto", "none"],
        help="NAME+copy rows copy from the head folder's datastore.npz too (auto, when it has one) or not",
    )
    p.add_argument(
        "--budgets", default=None, help="tree nodes per pass, root included (default 8,16,32,60; --quick 8,32)"
    )
    p.add_argument("--temperatures", default=None, help="default 0,1")
    p.add_argument("--depth", type=at_least(1), default=6)
    p.add_argument("--top-k-draft", type=at_least(1), default=10)
    p.add_argument("--lookup-tokens", type=at_least(1), default=10, help="prompt_lookup_num_tokens of HF prompt lookup")
    p.add_argument(
        "--seed", type=at_least(0), default=0, help="prompt i samples with seed + i (plain and every method)"
    )
    p.add_argument("--quick", action="store_true", help="2 prompts x 24 tokens, budgets 8 and 32")
    p.add_argument("-o", "--out", default="out/bench", help="folder for results.json, results.md and the plots")
    p.set_defaults(func=cmd_bench)


def add_profile_parser(sub) -> None:
    """The subparser of profile."""
    p = sub.add_parser(
        "profile",
        help="a device's acceptance-independent costs on random weights: verify latency per "
        "tree size, drafting, engine overhead, and the speedups they allow",
    )
    p.add_argument("--config", required=True, help="llama-3.1-8b or a path to an HF config.json (random weights)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--head",
        default=None,
        help="a head folder: the random head is of its kind and, with --draft-vocab head, drafts over as many tokens",
    )
    p.add_argument(
        "--draft-vocab",
        default="auto",
        choices=["auto", "head", "full"],
        help="the tokens the random head drafts over: as many as --head's (head) or the whole vocabulary "
        "(full); auto = full on a GPU, else --head's when given",
    )
    p.add_argument("--depth", type=at_least(1), default=DEFAULTS.depth)
    p.add_argument("--top-k-draft", type=at_least(1), default=DEFAULTS.top_k_draft)
    p.add_argument("--sizes", default="1,2,4,8,16,32,60,64,128,256", help="tree sizes N")
    p.add_argument("--reps", type=at_least(1), default=10, help="round-robin repetitions")
    p.add_argument("--prefix", type=at_least(1), default=256, help="committed tokens before the tree")
    p.add_argument(
        "--tokens-per-pass",
        type=float,
        default=None,
        help="project the speedup with this tokens/pass (default: from OUT/results.json, a bench run's)",
    )
    p.add_argument("--results", default=None, help="a bench results.json to take tokens/pass from")
    p.add_argument("-o", "--out", default="out/bench", help="folder for profile.json and profile.md")
    p.set_defaults(func=cmd_profile)


def cmd_bench(args) -> int:
    """Benchmark every method against plain and prompt-lookup decoding."""
    from ..bench import main as bench_main

    return bench_main(args)


def cmd_profile(args) -> int:
    """Measure a device's acceptance-independent costs on random weights (verify latency, drafting, overhead)."""
    from ..bench.command import typed_command
    from ..bench.profile import main_profile

    return main_profile(args, typed_command("profile"))

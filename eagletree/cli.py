"""`eagletree` command line: data, generate, chat, viz, features, distill, export, import, plan, calibrate-copy,
datastore, bench, profile.

This module only parses: each subcommand's work is `commands.cmd_<name>`, imported once the arguments parse, so
`eagletree --help` and a mistyped flag answer at once, without loading torch (or transformers, or matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import warnings

from .decoding.config import CPU_BUDGET, GPU_BUDGET, TREE_KINDS, DecodeConfig, TreeKind
from .errors import EagletreeError
from .export import format_names
from .serve import engine_names
from .train.data import HELDOUT_FRACTION, TURNS

__all__ = ["build_parser", "main"]
DEFAULTS = DecodeConfig()  # the library's decoding defaults are the command line's


def at_least(low: int):
    """An argparse type for an integer >= `low`, so a bad value is refused before anything loads, naming the flag
    ("argument --max-nodes: must be an integer >= 2, got 1")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _add_model_args(p, needs_head: bool = False) -> None:
    """--target, --head, --device, --draft-dtype: what `_load` reads (`needs_head`: the command refuses --head none)."""
    p.add_argument("--target", default="smollm2-135m", help="alias, HF model folder or .gguf file")
    p.add_argument(
        "--head",
        default=None,
        help="draft head folder; default: the head shipped for the target"
        + ("" if needs_head else "; 'none' = plain decoding"),
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--draft-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the head's precision; auto = the faster of float32 and bfloat16 drafting, measured once on a CPU "
        "with native bf16 for an fp32 target (cached), else the target's (outputs do not depend on it)",
    )
    p.add_argument(
        "--draft-vocab",
        default="auto",
        choices=["auto", "head", "full"],
        help="the tokens the head drafts: its own draft vocabulary (head) or the target's whole "
        "vocabulary (full: more tokens draftable, a larger lm_head per drafting level); auto = "
        "full on a GPU, head on a CPU; plan: the vocabulary its --engine drafts over",
    )
    p.add_argument(
        "--pack",
        default="auto",
        choices=["auto", "on", "off"],
        help="pre-pack the target's Linear weights for oneDNN (CPU; one more copy of the weights in "
        "memory); auto = measure stock vs packed here once per CPU model, threads, dtype and torch "
        "version (cached) and keep packing only at the tree sizes where it is faster; on = packed at "
        "every size",
    )


def _add_decoding_args(p, tree: str = DEFAULTS.tree.value, needs_head: bool = False) -> None:
    """Decoding flags, with DecodeConfig's defaults (`tree`: another default tree kind); `DecodeConfig.from_args`
    reads them."""
    _add_model_args(p, needs_head)
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the target's precision (default: float32 on CPU, bfloat16 on CUDA); bfloat16's output "
        "equals plain bf16 decoding's up to rounding; whether it is faster depends on the CPU "
        "(docs/results.md)",
    )
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    p.add_argument("--temperature", type=float, default=DEFAULTS.sampling.temperature)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument(
        "--tree",
        default=tree,
        choices=TREE_KINDS,
        help=f"default {tree}"
        + (
            ": the cost-aware tree, which drafts only while trees beat a one-token pass on this machine"
            if tree == TreeKind.AUTO
            else ""
        ),
    )
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help=f"tree nodes per target pass, root included (default: {GPU_BUDGET} on CUDA, {CPU_BUDGET} on CPU)",
    )
    p.add_argument("--depth", type=int, default=DEFAULTS.depth)
    p.add_argument("--top-k-draft", type=int, default=DEFAULTS.top_k_draft)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--copy",
        default="auto",
        choices=["auto", "on", "off"],
        help="copied spans of the prompt and the answer so far as extra tree candidates (auto: on for "
        "eagle2, optimal and auto trees, off for the fixed chain and sequoia shapes)",
    )
    p.add_argument(
        "--datastore",
        default="auto",
        help="with copying, a corpus copied from too (the target's earlier answers: retrieved spans): auto "
        "= the head folder's datastore.npz when it has one, none, or a file `eagletree datastore` made",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `eagletree` parser: a subparser per command, whose `func` names the `commands.cmd_<name>` that runs it."""
    parser = argparse.ArgumentParser(prog="eagletree", description="Lossless speculative decoding with draft trees.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_data_commands(sub)
    _add_decoding_commands(sub)
    _add_training_commands(sub)
    _add_distill_commands(sub)
    _add_head_commands(sub)
    _add_copy_commands(sub)
    _add_measuring_commands(sub)
    return parser


def _add_data_commands(sub) -> None:
    """The subparsers of the `data` command."""
    p = sub.add_parser(
        "data", help="read training data as training would (ShareGPT or your own JSON/JSONL) and count it"
    )
    p.add_argument(
        "--dataset",
        default="sharegpt",
        help="'sharegpt' (shipped), a .json/.jsonl path, or several joined by commas (an id a later one has "
        "again is taken from it)",
    )
    p.add_argument("--stats", action="store_true", help="print one JSON object of counts")
    p.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION)
    p.set_defaults(func="cmd_data")


def _add_decoding_commands(sub) -> None:
    """The subparsers of generate, chat, viz."""
    p = sub.add_parser("generate", help="answer a chat prompt (or a file of them) with speculative decoding")
    _add_decoding_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="one prompt, answered as the user's turn")
    prompt.add_argument(
        "--prompts",
        metavar="FILE",
        help="many prompts: a text file of one prompt per line, or a .json list / .jsonl lines of prompts (a "
        'string, {"prompt": str} or {"messages": [...]}), decoded --batch-size at a time',
    )
    p.add_argument(
        "--batch-size",
        type=at_least(1),
        default=None,
        help="with --prompts: sequences decoded together in each target pass (default 8; continuous batching)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE.jsonl",
        help="with --prompts: append one JSON line per finished prompt (index, prompt, text, new_tokens, "
        "tokens_per_pass); a rerun skips the indices already there",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object instead of streaming (with --prompts and no --out: each prompt's JSON line)",
    )
    p.add_argument("--compare-plain", action="store_true", help="also time plain decoding of the same prompt")
    p.set_defaults(func="cmd_generate")

    p = sub.add_parser("chat", help="interactive chat with speculative decoding")
    _add_decoding_args(p)
    p.set_defaults(func="cmd_chat")

    p = sub.add_parser("viz", help="one drafting step as an HTML page: tree, attention mask, verification replay")
    _add_decoding_args(p, tree="eagle2", needs_head=True)  # a picture of a tree: auto may verify the root alone
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--step", type=at_least(1), default=1, help="show the K-th target pass of the generation (1 = the first)"
    )
    p.add_argument("-o", "--output", default="tree.html", help="the HTML file to write")
    p.set_defaults(func="cmd_viz")


def _add_training_commands(sub) -> None:
    """The subparsers of features."""
    p = sub.add_parser("features", help="cache target features for offline training (resumable)")
    p.add_argument("--config", required=True, help="the training config (its features_dir receives the cache)")
    p.add_argument("--shard-size", type=at_least(1), default=64, help="conversations per shard")
    p.add_argument("--device", default=None, help="default: the config's device key, else cuda when available")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    p.set_defaults(func="cmd_features")


def _add_distill_commands(sub) -> None:
    """The subparsers of distill."""
    p = sub.add_parser(
        "distill", help="the target's own answers to the training prompts (self-distillation data; resumable JSONL)"
    )
    p.add_argument("--target", default="smollm2-135m", help="alias, HF model folder or .gguf file")
    p.add_argument(
        "--dataset",
        default="sharegpt",
        help="'sharegpt' (shipped), a .json/.jsonl path or several "
        "joined by commas; only the training split is read. Or "
        "humaneval:A-B: HumanEval problems A to B, all answered "
        "(evaluate on other problems)",
    )
    p.add_argument(
        "--heldout-fraction",
        type=float,
        default=HELDOUT_FRACTION,
        help="the training config's heldout_fraction (held-out prompts are never answered)",
    )
    p.add_argument("--out", required=True, help="JSONL file; appended to, so a rerun continues where it stopped")
    p.add_argument(
        "--limit",
        type=at_least(0),
        default=0,
        help="answer the first N prompts --turns picks (0 = "
        "all; with first turns, the first N conversations'; those --skip-answered leaves out count "
        "toward N)",
    )
    p.add_argument("--max-new-tokens", type=at_least(1), default=320)
    p.add_argument(
        "--skip-answered",
        action="append",
        default=[],
        metavar="JSONL",
        help="leave out prompts this other distill file answers (e.g. one made with another "
        "--max-new-tokens); repeatable",
    )
    p.add_argument("--max-prompt-tokens", type=at_least(1), default=256, help="longer prompts are skipped (counted)")
    p.add_argument(
        "--min-prompt-tokens",
        type=at_least(0),
        default=0,
        help="shorter prompts are skipped (counted), e.g. to answer only the long prompts an earlier "
        "file with a lower --max-prompt-tokens left out",
    )
    p.add_argument(
        "--match",
        default=None,
        metavar="REGEX",
        help="answer only the prompts whose user turn this regular expression finds something in "
        "(counted; --limit then takes the first N of them), e.g. '(?i)python|```' for a datastore of "
        "code answers",
    )
    p.add_argument(
        "--turns",
        default="first",
        choices=list(TURNS),
        help="which user turns to answer: the first, the later ones (after the conversation so far, "
        "earlier answers as the dataset has them; record ids end in @turn<k>), or all",
    )
    _add_distill_decoding_args(p)
    p.set_defaults(func="cmd_distill")


def _add_distill_decoding_args(p) -> None:
    """distill's flags of how the answers are decoded: batching, the engine, sampling, device and precision."""
    p.add_argument(
        "--batch-size",
        type=at_least(1),
        default=None,
        help="prompts answered together (hf: a left-padded batch; eagletree: sequences per target pass; vllm: "
        "prompts per LLM.generate call, their records appended together); default: 16, with --engine vllm 64",
    )
    p.add_argument(
        "--engine",
        "--decoder",
        dest="decoder",
        default=None,
        choices=["hf", "eagletree", "vllm"],
        help="hf: HF generate on batches of similar length; eagletree: eagletree's own batched speculative "
        "decoding with --head (greedy only; the same answers and records, written as each finishes); vllm: vLLM's "
        "offline LLM (pip install 'eagletree[vllm]'; the same prompts, stop tokens and greedy answers); default: "
        "eagletree for greedy answers, hf with --temperature > 0. --decoder is its older name",
    )
    p.add_argument(
        "--head",
        default=None,
        help="with --decoder eagletree: the draft head folder (default: the head shipped for the target, if any; "
        "'none' = plain batched decoding)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy answers (what T=0 decoding meets)")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--device", default=None)
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the target's precision (default: float32 on CPU, bfloat16 on CUDA); bfloat16 on a CPU with "
        "native bf16 may be faster or not (docs/results.md), and its answers are the same text in all "
        "but a few tokens",
    )
    p.add_argument("--pack", default="auto", choices=["auto", "on", "off"], help="packed CPU kernels (as in generate)")


def _add_head_commands(sub) -> None:
    """The subparsers of export, import and plan (a head for the engines)."""
    p = sub.add_parser("export", help="export a head for EAGLE, vLLM or SGLang")
    p.add_argument("--head", required=True)
    p.add_argument(
        "--format",
        required=True,
        choices=format_names(),
        help="EAGLE-1/2 heads: eagle, vllm or sglang; EAGLE-3 heads: eagle3 (SGLang, EAGLE), vllm "
        '(speculative_config method "eagle3") or speculators (vLLM starts it alone, LLM(model=OUT); its config '
        "names the --target folder as the verifier vLLM loads)",
    )
    p.add_argument("--out", required=True, help="a new or empty folder (never the head's own)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out: replace config.json and "
        "model.safetensors (and token_map.pt) there, keep the rest "
        "of its files",
    )
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--target", default="smollm2-135m", help="eagle3: the target whose embedding the export carries")
    p.set_defaults(func="cmd_export")

    p = sub.add_parser("import", help="import an EAGLE-1/2 head trained elsewhere")
    p.add_argument("--eagle", required=True, help="folder with config.json and model.safetensors/pytorch_model.bin")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--out", required=True, help="a new or empty folder (never the --eagle folder)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out: replace config.json and model.safetensors there and delete the "
        "calibration.json and copy_calibration*.json measured for the head replaced; keep its other files",
    )
    p.set_defaults(func="cmd_import")

    p = sub.add_parser("plan", help="the best static tree for a head on a device, as vLLM/SGLang/EAGLE settings")
    _add_model_args(p, needs_head=True)
    p.add_argument("--engine", required=True, choices=engine_names())
    p.add_argument(
        "--profile",
        default=None,
        help="latency profile JSON (eagletree profile's "
        "profile.json, or a cached LatencyProfile); default: measure "
        "on --device",
    )
    p.add_argument(
        "--export", default="EXPORT_DIR", help="the folder the head was exported to (named in the engine's settings)"
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
    p.set_defaults(func="cmd_plan")


def _add_copy_commands(sub) -> None:
    """The subparsers of calibrate-copy and datastore."""
    p = sub.add_parser("calibrate-copy", help="measure how often copied spans are accepted; saved next to the head")
    _add_model_args(p, needs_head=True)
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
    p.set_defaults(func="cmd_calibrate_copy")

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
    p.set_defaults(func="cmd_datastore")


def _add_measuring_commands(sub) -> None:
    """The subparsers of bench, profile."""
    _add_bench_command(sub)
    _add_profile_command(sub)


def _add_bench_command(sub) -> None:
    """The subparser of bench."""
    p = sub.add_parser("bench", help="speculative vs plain and prompt-lookup decoding on the same prompts; plots")
    _add_model_args(p)
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
    p.set_defaults(func="cmd_bench")


def _add_profile_command(sub) -> None:
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
    p.set_defaults(func="cmd_profile")


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings as the command line shows them: 'DataWarning: ...', without the source line that raised them."""
    return f"{category.__name__}: {message}\n"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    shown = warnings.formatwarning  # restored after the command: main may run inside another program (or tests)
    warnings.formatwarning = _one_line_warning
    try:
        from . import commands  # (loads torch and transformers: seconds, so inside the Ctrl-C handling)

        return getattr(commands, args.func)(args)
    except (EagletreeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what the command was writing is cleaned up on the way (files.writing)
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = shown


def run() -> None:
    """The `eagletree` command: `main` in a process whose memory may come in huge pages (`hugepages`: the command
    starts itself again with glibc's tunable set, before anything is loaded)."""
    from .hugepages import relaunch_with_huge_pages

    relaunch_with_huge_pages()
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())

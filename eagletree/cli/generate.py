"""`eagletree generate` (one prompt, or with --prompts a file of them decoded together: `prompt_batch`) and
`eagletree chat` (a conversation): answers streamed with speculative decoding, and their statistics."""

from __future__ import annotations

import json
import sys

from ..errors import InvalidValue
from .common import add_decoding_args, at_least


def add_generate_parsers(sub) -> None:
    """The subparsers of generate and chat."""
    p = sub.add_parser("generate", help="answer a chat prompt (or a file of them) with speculative decoding")
    add_decoding_args(p)
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
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with speculative decoding")
    add_decoding_args(p)
    p.set_defaults(func=cmd_chat)


def _answer(decoder, messages, stream_to=None) -> dict:
    """One answer, streamed to `stream_to` as it is decoded, with its statistics."""
    from ..bench.runners import Run
    from ..decode import GenerationStats, decode_text, stream_text

    stats = GenerationStats()
    steps = decoder.steps(messages, stats)
    ids, first = [], []  # first: the seconds until the first pass had emitted its tokens

    def collect():
        for step in steps:
            ids.extend(step.tokens)
            if not first:
                first.append(stats.seconds)
            yield step.tokens

    tok = decoder.tokenizer
    for piece in stream_text(tok, collect()):
        if stream_to is not None:
            stream_to.write(piece)
            stream_to.flush()
    if stream_to is not None:
        stream_to.write("\n")
    d = stats.as_dict()
    run = Run(ids, stats.seconds, first[0] if first else stats.seconds, list(stats.accepted_lengths))
    return {
        "text": decode_text(tok, ids),
        "token_ids": ids,
        "new_tokens": d["new_tokens"],
        "decode_rate": run.decode_rate,  # as bench reads a run: the rate after the first pass
        "passes": d["passes"],
        "tokens_per_pass": round(d["tokens_per_pass"], 3),
        "predicted_tokens_per_pass": round(d["predicted_tokens_per_pass"], 3),
        "tokens_per_s": round(d["tokens_per_s"], 2),
        "seconds": round(d["seconds"], 3),
        "times": d["times"],
        "copied_tokens": d["copied_tokens"],
    }


def cmd_generate(args) -> int:
    """Answer one chat prompt with speculative decoding (and, if asked, plain decoding next to it), or with
    --prompts a file of them, decoded together."""
    if args.prompts is not None:
        return _generate_prompts(args)
    from ..bench.compare import compare_plain
    from ..decode import check_utf8
    from ..decode.config import DecodeConfig
    from ..packing import kernels_used
    from .models import load_from_args

    for flag, value in (("--batch-size", args.batch_size), ("--out", args.out)):
        if value is not None:
            raise InvalidValue(f"{flag} goes with --prompts FILE (many prompts); --prompt answers one")
    check_utf8(args.prompt, "--prompt")
    if not args.prompt.strip():
        raise InvalidValue("--prompt is empty; give the text to answer")
    config = DecodeConfig.from_args(args)
    model, tok, head, decoder = load_from_args(args, config)
    messages = [{"role": "user", "content": args.prompt}]
    result = _answer(decoder, messages, stream_to=None if args.json else sys.stdout)
    used = decoder.config
    result["method"] = (
        ("copy" if used.copies else "plain") if head is None else used.tree.value + ("+copy" if used.copies else "")
    )
    result["kernels"] = kernels_used(model)  # what ran, and --pack auto's measured choice with both timings
    if head is not None:  # the drafter's: the target's choice, or its own where it drafts in another precision
        result["draft_kernels"] = kernels_used(head)
    if args.compare_plain:
        # The first run in a process also sets up kernels for each new shape (a few tens of ms on a CPU), which
        # the plain runs after it no longer pay: like for like, the speculative run is timed again, warm.
        first = result
        result = dict(first, **{k: v for k, v in _answer(decoder, messages).items() if k != "text"})
        result["first_run_tokens_per_s"] = first["tokens_per_s"]
        compare_plain(result, model, tok, messages, config)
    if args.json:
        for key in ("times", "token_ids", "decode_rate"):
            result.pop(key)
        print(json.dumps(result))
    else:
        print(_result_line(result, args.compare_plain))
    return 0


def _result_line(result: dict, compared: bool) -> str:
    """generate's last line: the method, tokens, seconds, rates and, `compared` with plain decoding, the speedups."""
    line = (
        f"[{result['method']}: {result['new_tokens']} tokens in {result['seconds']:.2f}s = "
        f"{result['tokens_per_s']} tokens/s, {result['tokens_per_pass']} tokens/pass "
        f"(predicted {result['predicted_tokens_per_pass']})"
    )
    if compared:
        line += f" (timed again, warm; the process's first run: {result['first_run_tokens_per_s']} tokens/s)"
        if result["speedup_basis"] != "end to end":
            line += (
                f" | rates after the first pass from here on (sampled answers differ in length): "
                f"{result['decode_tokens_per_s']} tokens/s"
            )
        line += (
            f" | plain decoding, same kernels ({result['kernels']['kernels']}): {result['plain_tokens_per_s']} "
            f"tokens/s | speedup {result['speedup']}x | HF generate, stock kernels: {result['hf_tokens_per_s']} "
            f"tokens/s | speedup vs HF {result['speedup_vs_hf']}x"
        )
        if "identical_to_plain" in result:
            line += f" | identical to plain: {result['identical_to_plain']}"
    return line + "]"


def _generate_prompts(args) -> int:
    """`generate --prompts FILE`: every prompt of the file, --batch-size at a time, appended to --out as each
    finishes (resumable) or printed; then one summary line. Exit status 1 when an answer of this run ended with
    an error (written with it, and named in the summary), else 0."""
    from contextlib import nullcontext

    from ..bench.inputs import read_prompt_file
    from ..decode.config import DecodeConfig
    from ..records import check_record_path
    from .models import load_from_args
    from .prompt_batch import answer_settings, decode_prompts, open_answers, run_summary

    if args.compare_plain:
        raise InvalidValue("--compare-plain times one prompt against plain decoding; it does not go with --prompts")
    config = DecodeConfig.from_args(args)  # (bad flags are refused before anything is read or loaded)
    if args.out is not None:  # (before stdin is read: a wrong --out costs nothing)
        check_record_path(args.out, "--out", (("--prompts", args.prompts),))
    prompts = read_prompt_file(args.prompts, "--prompts")
    # A wrong --out file is refused before loading; the file stays locked until the run ends.
    store = None if args.out is None else open_answers(args.out, prompts, answer_settings(args, config), args.prompts)
    with store or nullcontext():
        if store is not None and len(store.keys) == len(prompts):
            totals = {"prompts": len(prompts), "already": len(prompts), "answered": 0, "new_tokens": 0, "seconds": 0.0}
            print(run_summary(totals))  # nothing left to decode: nothing is loaded
            return 0
        *_, decoder = load_from_args(args, config)
        totals = decode_prompts(decoder, prompts, args.batch_size or 8, store, args.json, args.prompts)
    print(run_summary(totals), file=sys.stderr if args.json and store is None else sys.stdout)
    return 1 if totals["errors"] else 0  # (1: every answer was written, but some ended early with an error)


def cmd_chat(args) -> int:
    """Interactive chat: streams each answer and shows tokens/pass; the conversation is kept."""
    from ..decode.config import DecodeConfig
    from .models import load_from_args

    *_, decoder = load_from_args(args, DecodeConfig.from_args(args))
    messages = []
    print("eagletree chat: type a message, an empty line or Ctrl-D to quit; Ctrl-C stops an answer.", file=sys.stderr)
    while (text := _read_message()) is not None:
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        sys.stdout.write("assistant> ")
        try:
            result = _answer(decoder, messages, stream_to=sys.stdout)
        except ValueError as e:  # e.g. the conversation no longer fits the context: this message is not sent
            messages.pop()
            print(
                f"\nerror: {e}\n(that message was not sent; the conversation so far is kept: type a shorter "
                "one, or an empty line to quit)",
                file=sys.stderr,
            )
            continue
        except KeyboardInterrupt:  # Ctrl-C during an answer stops it; the conversation goes on without that turn
            messages.pop()
            print(
                "\n(answer stopped; that message and its partial answer were dropped, the conversation so far is kept)",
                file=sys.stderr,
            )
            continue
        messages.append({"role": "assistant", "content": result["text"]})
        print(f"[{result['tokens_per_pass']} tokens/pass, {result['tokens_per_s']} tokens/s]", file=sys.stderr)
    return 0


def _read_message() -> str | None:
    """The user's next message; None to end the chat (an empty line, Ctrl-D or Ctrl-C), "" after a line that could
    not be read (named on stderr: a bad line is not the end of the conversation)."""
    from ..decode import check_utf8

    try:
        text = check_utf8(input("you> "), "that line")
    except (EOFError, KeyboardInterrupt):  # Ctrl-C at the prompt quits too
        print(file=sys.stderr)
        return None
    except (ValueError, UnicodeDecodeError) as e:
        print(
            f"error: {e}"
            if isinstance(e, ValueError)
            else f"error: that line is not valid UTF-8 text ({e.reason} at byte {e.start}); type it again",
            file=sys.stderr,
        )
        return ""
    return text if text.strip() else None

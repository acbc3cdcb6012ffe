"""The `eagletree` commands (`cmd_<name>`): what each subcommand does once `cli` has parsed its arguments.

`cli` imports this module only after parsing, so `eagletree --help` and a mistyped flag answer without loading
torch; transformers is imported only by the commands that load a model or its config (through the modules they
call, and in `cmd_import`); matplotlib only by the bench's plots.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

from . import serve, target
from .bench import Run, load_prompts, measure_drafting, run_hf
from .bench import main as bench_main
from .bench.command import typed_command
from .bench.inputs import humaneval_range, read_prompt_file
from .bench.profile import main_profile
from .decoding import Decoder, GenerationStats, check_utf8, decode_text, stream_text
from .decoding.config import DecodeConfig, check_options
from .decoding.resources import latency_profile
from .draft_heads import HeadError
from .export.convert import check_format, engine_notes, export_head, recognize_folder
from .files import check_output_dir, check_output_file, check_output_folder, write_json_atomic, write_text_atomic
from .loading import head_to_load, load_head, load_models
from .packing import is_packed, kernels_used, stock_kernels
from .plan import Acceptance, PlanOptions, check_reused_acceptance, load_profile, make_plan, split_prompts, summary
from .prompt_batch import answered, decode_prompts, run_summary
from .prompts import humaneval_prompts
from .train.data import Conversation, load_dataset, split, stats
from .train.distill import DistillOptions, check_match, distill, ids_in
from .train.evaluate import measure_copy_calibration
from .train.features import cache_features, check_features_dir
from .train.loop import TrainConfig, on_cpu, resolve_precision, training_conversations
from .tree_search.copy import bin_labels, copy_calibration_names
from .viz import render_html, viz_step


def cmd_data(args) -> int:
    """Read a dataset as training would (warnings name what was skipped or recovered): one line of counts, or with
    --stats all of them as JSON."""
    if not 0.0 < args.heldout_fraction < 1.0:
        raise ValueError(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
    data = load_dataset(args.dataset)
    counts = stats(data, args.heldout_fraction)
    if args.stats:
        print(json.dumps(counts, indent=2))
    else:
        print(
            f"{counts['source']}: {counts['conversations']:,} conversations ({counts['train']:,} for training, "
            f"{counts['heldout']:,} held out at {counts['heldout_fraction']}), {counts['turns']:,} turns"
            + (
                (
                    ", a file was cut off (recovered up to its last complete record; the warning names it)"
                    if "," in counts["source"]
                    else ", the file was cut off (recovered up to its last complete record)"
                )
                if counts["truncated"]
                else ""
            )
            + (f", {counts['replaced']:,} replaced by a later file's with the same id" if counts["replaced"] else "")
            + "; --stats for every count as JSON"
        )
    return 0


def _refuse_head_none(args, command: str, why: str) -> None:
    """ValueError before loading when a command that needs a draft head is given --head none."""
    if args.head == "none":
        raise ValueError(
            f"--head none: {command} {why}; pass a head folder, or leave --head out for the target's shipped head"
        )


def _load(args, config: DecodeConfig | None = None):
    """Target, tokenizer and head from --target/--head (the shipped head by default); with the decoding `config`
    the flags ask for (built before loading, so a bad flag is refused at once), also a Decoder for them."""
    head_path = head_to_load(args.target, args.head)
    t0 = time.perf_counter()
    model, tok, head, packed = load_models(
        args.target,
        head_path,
        device=args.device,
        dtype=getattr(args, "dtype", None),  # generate, chat, viz: --dtype
        pack=args.pack,
        head_dtype=args.draft_dtype,
        draft_vocab=_draft_vocab(args),
    )
    print(
        f"loaded {args.target} ({type(model).__name__}, {model.dtype}, {model.device}"
        f"{f', {packed} Linears packed' if packed else ''}{_kernels_note(model)})"
        f"{'' if head is None else f' and head {head_path}'} in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    if config is None:
        return model, tok, head
    return model, tok, head, Decoder(model, tok, head, config)


def _draft_vocab(args) -> str:
    """--draft-vocab as `load_models` takes it; plan's auto is settled once the head is loaded (`_engine_vocab`)."""
    return "head" if args.draft_vocab == "auto" and getattr(args, "engine", None) else args.draft_vocab


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


def _kernels_note(model) -> str:
    """Where --pack auto measured the kernels: each tree size's choice with both timings."""
    choice = getattr(model, "kernel_choice", None)
    return "" if choice is None else f"; kernels measured here: {choice.summary()}"


def _plain(model, tok, messages, args, stock: bool = False) -> dict:
    """Plain HF decoding of the same prompt with the same sampling settings and stop tokens, timed: with the
    kernels the speculative run used, or (`stock`) PyTorch's stock kernels, i.e. HF `generate` as users run it."""
    with stock_kernels(model) if stock else nullcontext():
        run = run_hf(
            model, tok, messages, args.max_new_tokens, args.temperature, args.seed, top_k=args.top_k, top_p=args.top_p
        )
    return {
        "new_tokens": len(run.token_ids),
        "seconds": run.seconds,
        "tokens_per_s": len(run.token_ids) / run.seconds,
        "token_ids": run.token_ids,
        "decode_rate": run.decode_rate,
    }


SPEEDUP_BASES = {"end to end": "tokens_per_s", "after the first pass": "decode_rate"}


def compare_plain(result: dict, model, tok, messages, args) -> dict:
    """Like-for-like speedups: vs plain decoding with the same kernels (`speedup`) and vs stock HF `generate`
    (`speedup_vs_hf`; the same run when the target runs stock kernels), and the kernels' own gain.

    Greedy, the runs emit the same tokens and are compared end to end (the prompt's prefill included). Sampled,
    each draws its own answer, whose length sets the prefill's share of its time: the rates after each run's first
    pass are compared instead (as `bench` does), when every run has tokens after it. `speedup_basis` says which.
    """
    plain = _plain(model, tok, messages, args)
    hf = _plain(model, tok, messages, args, stock=True) if is_packed(model) else plain
    basis = "end to end"
    if args.temperature and all(r["decode_rate"] == r["decode_rate"] for r in (result, plain, hf)):  # (NaN: none)
        basis = "after the first pass"
    rate = SPEEDUP_BASES[basis]
    result.update(
        kernels=kernels_used(model),
        plain_tokens_per_s=round(plain[rate], 2),
        speedup=round(result[rate] / plain[rate], 3),
        hf_tokens_per_s=round(hf[rate], 2),
        speedup_vs_hf=round(result[rate] / hf[rate], 3),
        kernels_gain=round(plain[rate] / hf[rate], 3),
        speedup_basis=basis,
    )
    if basis != "end to end":
        result["decode_tokens_per_s"] = round(result[rate], 2)
    if not args.temperature:
        result["identical_to_plain"] = plain["token_ids"] == result["token_ids"] == hf["token_ids"]
    return result


def _answer(decoder: Decoder, messages, stream_to=None) -> dict:
    """One answer, streamed to `stream_to` as it is decoded, with its statistics."""
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
    for flag, value in (("--batch-size", args.batch_size), ("--out", args.out)):
        if value is not None:
            raise ValueError(f"{flag} goes with --prompts FILE (many prompts); --prompt answers one")
    check_utf8(args.prompt, "--prompt")
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give the text to answer")
    model, tok, head, decoder = _load(args, DecodeConfig.from_args(args))
    messages = [{"role": "user", "content": args.prompt}]
    result = _answer(decoder, messages, stream_to=None if args.json else sys.stdout)
    config = decoder.config
    result["method"] = (
        ("copy" if config.copies else "plain")
        if head is None
        else config.tree.value + ("+copy" if config.copies else "")
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
        compare_plain(result, model, tok, messages, args)
    if args.json:
        for key in ("times", "token_ids", "decode_rate"):
            result.pop(key)
        print(json.dumps(result))
        return 0
    line = (
        f"[{result['method']}: {result['new_tokens']} tokens in {result['seconds']:.2f}s = "
        f"{result['tokens_per_s']} tokens/s, {result['tokens_per_pass']} tokens/pass "
        f"(predicted {result['predicted_tokens_per_pass']})"
    )
    if args.compare_plain:
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
    print(line + "]")
    return 0


def _generate_prompts(args) -> int:
    """`generate --prompts FILE`: every prompt of the file, --batch-size at a time, appended to --out as each
    finishes (resumable) or printed; then one summary line. Exit status 1 when an answer of this run ended with
    an error (written with it, and named in the summary), else 0."""
    if args.compare_plain:
        raise ValueError("--compare-plain times one prompt against plain decoding; it does not go with --prompts")
    prompts = read_prompt_file(args.prompts, "--prompts")
    out = None if args.out is None else Path(args.out)
    config, done = DecodeConfig.from_args(args), None  # (bad flags are refused before anything is read or loaded)
    if out is not None:
        check_output_file(out, "--out")
        done = answered(out, prompts)  # a wrong --out file is refused before loading (and a cut-off line removed)
    if done is not None and len(done) == len(prompts):
        totals = {"prompts": len(prompts), "already": len(done), "answered": 0, "new_tokens": 0, "seconds": 0.0}
        print(run_summary(totals))  # nothing left to decode: nothing is loaded
        return 0
    *_, decoder = _load(args, config)
    totals = decode_prompts(decoder, prompts, args.batch_size or 8, out, args.json, args.prompts, done)
    print(run_summary(totals), file=sys.stderr if args.json and out is None else sys.stdout)
    return 1 if totals["errors"] else 0  # (1: every answer was written, but some ended early with an error)


def cmd_chat(args) -> int:
    """Interactive chat: streams each answer and shows tokens/pass; the conversation is kept."""
    *_, decoder = _load(args, DecodeConfig.from_args(args))
    messages = []
    print("eagletree chat: type a message, an empty line or Ctrl-D to quit; Ctrl-C stops an answer.", file=sys.stderr)
    while True:
        try:
            text = check_utf8(input("you> "), "that line")
        except (EOFError, KeyboardInterrupt):  # Ctrl-C at the prompt quits too
            print(file=sys.stderr)
            break
        except (ValueError, UnicodeDecodeError) as e:  # a bad line is not the end of the conversation
            print(
                f"error: {e}"
                if isinstance(e, ValueError)
                else f"error: that line is not valid UTF-8 text ({e.reason} at byte {e.start}); type it again",
                file=sys.stderr,
            )
            continue
        if not text.strip():
            break
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


def cmd_viz(args) -> int:
    """Write one real drafting step (tree, mask, acceptance replay) as a self-contained HTML page."""
    check_utf8(args.prompt, "--prompt")
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give the text to answer")
    check_output_file(args.output, "-o/--output")  # before the work
    _refuse_head_none(args, "viz", "shows the tree a draft head drafts")
    config = DecodeConfig.from_args(args)
    model, tok, head = _load(args)
    data = viz_step(
        model,
        tok,
        head,
        [{"role": "user", "content": args.prompt}],
        step=args.step,
        config=config.for_device(model.device),
    )
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, render_html(data))
    greedy = len(data["greedy"]["accepted"])
    print(
        f"wrote {out}: step {args.step}, {args.tree} tree of {len(data['tokens'])} nodes, "
        f"E[tokens/pass] {data['expected']:.3f} (under the target {data['target_expected']:.3f}), "
        f"greedy verification emits {greedy} token{'s' if greedy > 1 else ''}"
    )
    return 0


def cmd_export(args) -> int:
    """Write a head in the layout EAGLE, vLLM (also as a speculators checkpoint) or SGLang loads."""
    check_output_dir(Path(args.out), args.overwrite, sources=[args.head])  # before the head is read
    head = load_head(args.head)
    layout = check_format(head, args.format)  # before the target loads
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = None
    if layout.needs_target:  # e.g. the target's embedding ("eagle3"), the verifier's folder ("speculators")
        model, _ = target.load_target(args.target, device="cpu")
    out = export_head(head, args.out, args.format, dtype, overwrite=args.overwrite, target=model)
    print(f"exported {args.head} as {args.format} ({args.dtype}) to {out}")
    for note in engine_notes(head, args.format, None if model is None else model.config):
        print(f"note: {note}")
    return 0


def cmd_import(args) -> int:
    """Read a head in any export format (`eagletree.export`'s registry recognizes it) and save it as an eagletree
    head."""
    check_output_dir(Path(args.out), args.overwrite, sources=[args.eagle])
    layout = recognize_folder(args.eagle)
    if layout.imports_with_model:
        model, _ = target.load_target(args.target, device="cpu")
        head = layout.load(Path(args.eagle), model)
    else:
        from transformers import AutoConfig  # lazy: see the module's docstring

        head = layout.load(Path(args.eagle), AutoConfig.from_pretrained(target.resolve_target(args.target)))
    head.save_pretrained(args.out, keep_others=True, replace=args.overwrite)
    for name in ("calibration.json", *copy_calibration_names(False)):  # measured for the head replaced there
        (Path(args.out) / name).unlink(missing_ok=True)
    print(f"imported {args.eagle} for {args.target} into {args.out}")
    return 0


EXPORT_PLACEHOLDER = "EXPORT_DIR"  # plan's --export default: the engine's settings name no folder yet


def cmd_plan(args) -> int:
    """The best static tree for a head and a device, written as vLLM's, SGLang's or EAGLE's settings."""
    acceptance = data = None
    if args.acceptance:
        try:
            data = json.loads(Path(args.acceptance).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read --acceptance {args.acceptance!r}: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(
                f"--acceptance {args.acceptance!r}: expected a plan's JSON object, got {type(data).__name__}"
            )
        try:
            acceptance = Acceptance.from_dict(data.get("acceptance", data))
        except ValueError as e:
            raise ValueError(
                f"--acceptance {args.acceptance!r}: {e} (expected a plan's JSON, as plan -o writes it)"
            ) from None
    check_output_file(args.out, "-o/--out")
    if args.export != EXPORT_PLACEHOLDER and not (Path(args.export) / "config.json").is_file():
        what = "has no config.json" if Path(args.export).is_dir() else "no such folder"
        raise ValueError(
            f"--export {args.export!r}: {what}; expected the folder `eagletree export` wrote (the plan names it in "
            f"the engine's settings), or leave --export out for the placeholder {EXPORT_PLACEHOLDER}"
        )
    _refuse_head_none(args, "plan", "chooses a tree for a draft head")
    profile = load_profile(args.profile) if args.profile else None
    prompts = load_prompts(args.prompts)
    measure, check = split_prompts(prompts)
    model, tok, head = _load(args)
    if head is None:
        raise ValueError("plan needs a draft head (--head DIR)")
    _engine_vocab(args, head)
    if data is not None:
        check_reused_acceptance(data, head, args.acceptance, args.engine)
    if profile is None:
        profile = latency_profile(model)  # the verify pass, measured on --device once and cached
        profile.draft_s_per_level = measure_drafting(model, head, [16], prefix=128, reps=3)[16]["level"]
    options = PlanOptions(
        args.engine,
        args.export,
        max_nodes=args.max_nodes,
        max_depth=args.max_depth,
        top_k=args.top_k_draft,
        max_new_tokens=args.max_new_tokens,
    )
    result = make_plan(model, tok, head, profile, measure, check, options, acceptance=acceptance)
    result["prompts"] = args.prompts
    write_json_atomic(args.out, result)
    print(summary(result))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if result["check"]["within_tolerance"] else 1


def cmd_calibrate_copy(args) -> int:
    """Measure how often copied spans are accepted and save it next to the head (copy_calibration.json)."""
    check_options(cli=True, max_new_tokens=args.max_new_tokens, budget=args.budget, depth=args.depth)
    _refuse_head_none(args, "calibrate-copy", "measures the copied spans next to a head's candidates")
    for flag, value, least in (("--max-new-tokens", args.max_new_tokens, 2), ("--budget", args.budget, 2)):
        if value < least:  # fewer would try no copied span, and the table would be replaced by an uninformed one
            raise ValueError(
                f"{flag} must be >= {least} for calibrate-copy (a copied span needs room to be tried), got {value}"
            )
    if args.out:
        check_output_file(args.out)
    prompts = load_prompts(args.prompts)
    if args.out and Path(args.out).exists() and not args.overwrite:
        raise ValueError(f"--out {args.out!r} exists; pass --overwrite to replace it")
    model, tok, head = _load(args)
    out = Path(args.out) if args.out else head.folder / copy_calibration_names(head.is_widened())[0]
    if out.exists() and not args.overwrite:  # (a head's table may have taken an hour of prompts to measure)
        raise ValueError(
            f"{out} holds a copy table already; pass --overwrite to replace it with this run's, or --out "
            "to write it elsewhere"
        )
    calibration, result = measure_copy_calibration(
        head, model, tok, prompts, args.max_new_tokens, budget=args.budget, depth=args.depth, top_k_draft=10
    )
    if not calibration.tried.sum():
        raise ValueError(
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


def cmd_datastore(args) -> int:
    """Index the assistant turns of a chat JSONL file for retrieved spans, saved next to the head (datastore.npz)."""
    from .tree_search.store import DATASTORE, TokenStore, vocab_fingerprint

    sources = []
    for source in map(Path, args.source):
        if not source.is_file():
            raise ValueError(f"--from {str(source)!r}: no such file")
        if source.resolve() not in [s.resolve() for s in sources]:  # a file named twice is read once
            sources.append(source)
    if args.out:
        check_output_file(args.out)
        out = Path(args.out)
    else:
        folder = head_to_load(args.target, args.head)
        if folder is None:
            raise ValueError("--head none: a datastore is saved next to a head; pass a head folder, or --out FILE")
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"--head {str(folder)!r} is not a saved head (no config.json); pass --out to write "
                "the datastore elsewhere"
            )
        out = folder / DATASTORE
    if out.exists() and not args.overwrite:
        raise ValueError(f"{out} exists; pass --overwrite to replace it, or --out to write elsewhere")
    model, tok = target.load_target(args.target, device="cpu")
    if not args.out:  # saved next to a head: it must draft for this target (the store holds this tokenizer's ids)
        try:
            load_head(out.parent, target_config=model.config)
        except HeadError as e:
            raise ValueError(f"--head {str(out.parent)!r}: {e}") from None
    store = TokenStore.from_chat_file(
        sources, tok, min_match=args.min_match, max_ngram=max(8, args.min_match), max_match=max(16, args.min_match)
    )
    names = [f.name for f in sources]
    source = names[0] if len(names) == 1 else names
    header = store.save(out, vocab_fingerprint(tok), replace=args.overwrite, source=source)
    print(
        f"wrote {out}: {header['tokens']:,} tokens of {header['texts']:,} answers from "
        f"{', '.join(map(str, sources))}, matches of {args.min_match}+ tokens"
    )
    return 0


def cmd_bench(args) -> int:
    """Benchmark every method against plain and prompt-lookup decoding."""
    return bench_main(args)


def cmd_profile(args) -> int:
    """Measure a device's acceptance-independent costs on random weights (verify latency, drafting, overhead)."""
    return main_profile(args, typed_command("profile"))


def cmd_features(args) -> int:
    """Cache the target's features for a training config (resumable)."""
    cfg = TrainConfig.from_sources(args.config, args.overrides)
    if not cfg.features_dir:
        raise ValueError("the config has no features_dir; pass features_dir=PATH")
    check_output_folder(cfg.features_dir, "features_dir")
    check_features_dir(cfg.features_dir)  # before loading the target
    device = args.device or cfg.device or None  # the flag, else the config's device key (as training reads it)
    dtype = torch.bfloat16 if resolve_precision(cfg.precision, on_cpu(device)) == "bf16" else torch.float32
    model, tok = target.load_target(cfg.target, dtype=dtype, device=device)
    manifest = cache_features(cfg, model, tok, training_conversations(cfg), shard_size=args.shard_size)
    print(
        json.dumps(
            {
                "features_dir": cfg.features_dir,
                "shards": len(manifest["shards"]),
                "complete": manifest["complete"],
                "tokens": sum(s["tokens"] for s in manifest["shards"]),
            }
        )
    )
    return 0


def distill_prompts(dataset: str, heldout_fraction: float) -> list[Conversation]:
    """The conversations `distill` answers: a dataset's training split, or the HumanEval problems `humaneval:A-B`
    names, all of them (problem ids `HumanEval/<A-1>` ..), for a head that sees the evaluation's wording of code
    questions; the evaluation must then use other problems (the README's code rows use problems 1-80)."""
    if dataset == "humaneval" or dataset.startswith("humaneval:"):
        count, offset = humaneval_range(dataset, flag="--dataset")  # ValueError naming the spec
        return [
            Conversation(f"HumanEval/{offset + i}", messages)
            for i, messages in enumerate(humaneval_prompts(count, offset))
        ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_convs, _ = split(load_dataset(dataset), heldout_fraction)  # a bad fraction: ValueError
    return train_convs


def cmd_distill(args) -> int:
    """The target's own answers to the training prompts, as JSONL for `dataset=PATH` (resumable)."""
    check_output_file(args.out)
    for other in args.skip_answered:
        ids_in(other)  # a wrong path or file fails here, before the target is loaded
    if args.match is not None:
        check_match(args.match)  # so does a bad --match
    head_path = engine = None
    if args.decoder is None:  # greedy answers come faster from the head's batched decoding; sampled ones from HF
        args.decoder = "hf" if args.temperature else "eagletree"
    if args.batch_size is None:  # vLLM batches each call's prompts itself: larger calls keep it busy
        args.batch_size = 64 if args.decoder == "vllm" else 16
    if args.decoder == "vllm":
        from .train.vllm_engine import VllmEngine, check_vllm_flags, import_vllm, vllm_target

        check_vllm_flags(args.head, args.device, args.pack)
        import_vllm()  # a missing vLLM fails here, before anything is loaded
    elif args.decoder == "eagletree":
        if args.temperature:
            raise ValueError(
                f"--engine eagletree answers greedily; --temperature {args.temperature:g} samples: use --engine hf"
            )
        head_path = head_to_load(args.target, args.head, required=False)
        if head_path is None:
            print("distill: --engine eagletree without a head: plain batched decoding", file=sys.stderr)
    elif args.head is not None:
        raise ValueError("--head goes with --engine eagletree (HF generate decodes without a head)")
    train_convs = distill_prompts(args.dataset, args.heldout_fraction)
    if args.decoder == "vllm":  # vLLM loads the weights; distill reads the config, generation_config and tokenizer
        model, tok, folder = vllm_target(args.target, args.dtype)
        head, engine = None, VllmEngine(folder, model)
    else:
        model, tok, head, _ = load_models(
            args.target, head_path, device=args.device, dtype=args.dtype, pack=args.pack, draft_vocab="auto"
        )
    options = DistillOptions(
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        limit=args.limit,
        seed=args.seed,
        skip_answered=tuple(args.skip_answered),
        turns=args.turns,
        min_prompt_tokens=args.min_prompt_tokens,
        match=args.match,
        decoder=args.decoder,
    )
    counts = distill(model, tok, train_convs, args.out, options, head=head, engine=engine)
    print(json.dumps(counts))
    return 0

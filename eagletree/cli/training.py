"""The training side's commands: `eagletree data` (read a dataset as training would, and count it), `eagletree
features` (cache the target's features for offline training) and `eagletree distill` (the target's own answers to
the training prompts); the work is `eagletree.train`'s."""

from __future__ import annotations

import json
import sys

from ..errors import InvalidValue
from ..train.data import HELDOUT_FRACTION, TURNS
from .common import at_least


def add_data_parser(sub) -> None:
    """The subparser of data."""
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
    p.set_defaults(func=cmd_data)


def add_features_parser(sub) -> None:
    """The subparser of features."""
    p = sub.add_parser("features", help="cache target features for offline training (resumable)")
    p.add_argument("--config", required=True, help="the training config (its features_dir receives the cache)")
    p.add_argument("--shard-size", type=at_least(1), default=64, help="conversations per shard")
    p.add_argument("--device", default=None, help="default: the config's device key, else cuda when available")
    p.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="what runs the target: transformers (hf), or vLLM's offline LLM and its hidden-state extraction "
        "(vllm: run from the environment that has vLLM, e.g. pip install 'eagletree[vllm]')",
    )
    p.add_argument(
        "--tensor-parallel",
        type=at_least(1),
        default=1,
        help="--engine vllm: GPUs the target is split over (vLLM's tensor_parallel_size)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    p.set_defaults(func=cmd_features)


def add_distill_parser(sub) -> None:
    """The subparser of distill."""
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
    add_distill_decoding_args(p)
    p.set_defaults(func=cmd_distill)


def add_distill_decoding_args(p) -> None:
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


def cmd_data(args) -> int:
    """Read a dataset as training would (warnings name what was skipped or recovered): one line of counts, or with
    --stats all of them as JSON."""
    from ..train.data import load_dataset, stats

    if not 0.0 < args.heldout_fraction < 1.0:
        raise InvalidValue(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
    counts = stats(load_dataset(args.dataset), args.heldout_fraction)
    print(json.dumps(counts, indent=2) if args.stats else _counts_line(counts))
    return 0


def _counts_line(counts: dict) -> str:
    """data's line: conversations, the split, turns, and what was recovered or replaced."""
    cut = ""
    if counts["truncated"]:
        cut = (
            ", a file was cut off (recovered up to its last complete record; the warning names it)"
            if "," in counts["source"]
            else ", the file was cut off (recovered up to its last complete record)"
        )
    replaced = f", {counts['replaced']:,} replaced by a later file's with the same id" if counts["replaced"] else ""
    return (
        f"{counts['source']}: {counts['conversations']:,} conversations ({counts['train']:,} for training, "
        f"{counts['heldout']:,} held out at {counts['heldout_fraction']}), {counts['turns']:,} turns"
        + cut
        + replaced
        + "; --stats for every count as JSON"
    )


def cmd_features(args) -> int:
    """Cache the target's features for a training config (resumable)."""
    from .. import target
    from ..files import check_output_folder
    from ..train.config import TrainConfig
    from ..train.features import cache_features, check_features_dir, features_dtype
    from ..train.inputs import training_conversations

    cfg = TrainConfig.from_sources(args.config, args.overrides)
    if not cfg.features_dir:
        raise InvalidValue("the config has no features_dir; pass features_dir=PATH")
    check_output_folder(cfg.features_dir, "features_dir")
    check_features_dir(cfg.features_dir)  # before loading the target
    device = args.device or cfg.device or None  # the flag, else the config's device key (as training reads it)
    conversations = training_conversations(cfg)  # (a bad dataset fails before the target is loaded)
    if args.engine == "vllm":
        manifest = _vllm_features(cfg, device, conversations, args.shard_size, args.tensor_parallel)
    else:
        model, tok = target.load_target(cfg.target, dtype=features_dtype(cfg, device), device=device)
        manifest = cache_features(cfg, model, tok, conversations, shard_size=args.shard_size)
    print(
        json.dumps(
            {
                "features_dir": cfg.features_dir,
                "shards": len(manifest["shards"]),
                "complete": manifest["complete"],
                "tokens": sum(s["tokens"] for s in manifest["shards"]),
                "engine": args.engine,
                "this_run": manifest["last_run"],  # tokens and seconds of the features this run computed
            }
        )
    )
    return 0


def _vllm_features(cfg, device, conversations, shard_size: int, tensor_parallel: int = 1) -> dict:
    """The features cache written from vLLM's hidden states (train/vllm_features.py): only the target's shell
    (config, embedding, final norm, lm_head) is loaded here; vLLM loads its weights."""
    from ..target import resolve_target
    from ..target.shell import load_target_shell
    from ..train.features import cache_features, feature_spec, features_dtype
    from ..train.vllm_features import VllmStates, layer_ids, vllm_training_features

    dtype = features_dtype(cfg, device)
    shell, tok = load_target_shell(cfg.target, dtype=dtype, device="cpu")
    spec = feature_spec(cfg, shell.config)
    engine = VllmStates(
        resolve_target(cfg.target), shell.config, dtype, layer_ids(spec, shell.config.num_hidden_layers)
    )
    try:
        features = ("vllm", vllm_training_features(spec, shell, engine), lambda n, seqs: engine.start(n + 1, seqs))
        return cache_features(cfg, shell, tok, conversations, shard_size=shard_size, engine=features)
    finally:
        engine.close()


def _check_engine(args):
    """distill's engine (--engine, else by --temperature) and batch size settled on `args`, and the flags checked
    against it before anything loads; the head folder --engine eagletree decodes with (None: plain)."""
    from ..loading import head_to_load
    from ..train.distill import default_batch_size, default_decoder

    if args.decoder is None:
        args.decoder = default_decoder(args.temperature)
    if args.batch_size is None:
        args.batch_size = default_batch_size(args.decoder)
    if args.decoder == "vllm":
        from ..train.vllm_engine import check_vllm_flags, import_vllm

        check_vllm_flags(args.head, args.device, args.pack)
        import_vllm()  # a missing vLLM fails here, before anything is loaded
    elif args.decoder == "eagletree":
        if args.temperature:
            raise InvalidValue(
                f"--engine eagletree answers greedily; --temperature {args.temperature:g} samples: use --engine hf"
            )
        head_path = head_to_load(args.target, args.head, required=False)
        if head_path is None:
            print("distill: --engine eagletree without a head: plain batched decoding", file=sys.stderr)
        return head_path
    elif args.head is not None:
        raise InvalidValue("--head goes with --engine eagletree (HF generate decodes without a head)")
    return None


def _load_for_engine(args, head_path):
    """(model, tokenizer, head, engine) for distill's engine: vLLM loads the weights itself (distill reads the
    config, generation_config and tokenizer); the others get the target, and the head --engine eagletree uses."""
    if args.decoder == "vllm":
        from ..train.vllm_engine import VllmEngine, vllm_target

        model, tok, folder = vllm_target(args.target, args.dtype)
        return model, tok, None, VllmEngine(folder, model)
    from ..loading import load_models

    model, tok, head, _ = load_models(
        args.target, head_path, device=args.device, dtype=args.dtype, pack=args.pack, draft_vocab="auto"
    )
    return model, tok, head, None


def cmd_distill(args) -> int:
    """The target's own answers to the training prompts, as JSONL for `dataset=PATH` (resumable)."""
    from ..records import check_record_file
    from ..train.distill import DistillOptions, check_match, distill, distill_prompts, ids_in
    from ..train.distill.records import distill_format

    datasets = tuple(("--dataset", part) for part in str(args.dataset).split(","))
    check_record_file(args.out, distill_format(None), "--out", datasets)  # (its settings: once the target is loaded)
    for other in args.skip_answered:
        ids_in(other)  # a wrong path or file fails here, before the target is loaded
    if args.match is not None:
        check_match(args.match)  # so does a bad --match
    head_path = _check_engine(args)
    train_convs = distill_prompts(args.dataset, args.heldout_fraction)
    model, tok, head, engine = _load_for_engine(args, head_path)
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

"""eagletree's side of scripts/check_vllm.py: the target, the export and the head imported back from it, the
prompts, and eagletree's plain and chain decoding (the chain on vLLM's schedule, so both engines draft at the same
positions of the same answers)."""

from __future__ import annotations

import time
from pathlib import Path

from .exports import export_head, import_export, read_export_config
from .metrics import acceptance, chain_counts
from .vllm_runs import export_kind, vllm_start


def prepare(args, work: Path) -> dict:
    """The target (fp32), its plain HF folder, the export (written here unless given), how vLLM starts with it, the
    head imported back from it over the vocabulary vLLM drafts over, the prompts' token ids and the stop tokens."""
    import torch

    from eagletree.decode import encode_prompt, stop_token_ids
    from eagletree.draft import load_head
    from eagletree.loading import SHIPPED_HEADS
    from eagletree.prompts import mtbench_subset
    from eagletree.target import load_target
    from eagletree.target.loading import resolve_target

    target, tokenizer = load_target(args.target, dtype=torch.float32, device="cpu")
    target_folder = str(resolve_target(args.target).resolve())
    export = args.export
    if export is None:
        head_dir = args.head or SHIPPED_HEADS.get(args.target)
        if head_dir is None:
            raise SystemExit(f"error: no head is shipped for {args.target!r}; pass --head or --export")
        fmt = args.format or "vllm"
        head = load_head(head_dir, target_config=target.config)
        export = export_head(head, work / "export", fmt, dtype=torch.float32, target=target, speculative_tokens=args.k)
        print(f"exported {head_dir} as {fmt} (fp32) to {export}")
    config = read_export_config(export)
    kind = export_kind(config)
    if args.format is not None and args.format != (kind if kind in ("speculators", "dflash") else "vllm"):
        raise ValueError(f"--export {str(export)!r} holds a {kind!r} export, not --format {args.format!r}")
    head = import_export(export, target).to(torch.float32).eval()
    # vLLM drafts heads that read the target's lm_head over the target's whole vocabulary, unless the export carries
    # the draft vocabulary's rows and ids (EAGLE-3 heads, and a speculators block export: lm_head.weight and d2t)
    carried = config.get("draft_vocab_size") not in (None, target.config.vocab_size)
    if head.can_widen_vocab() and not carried:
        head.widen_vocab()
    prompts = [encode_prompt(tokenizer, q.messages()).tolist() for q in mtbench_subset(args.prompts)]
    return {
        "target": target,
        "tokenizer": tokenizer,
        "head": head,
        "target_folder": target_folder,
        "export": str(export),
        "kind": kind,
        "start": vllm_start(kind, str(Path(export).resolve()), target_folder, args.k, config),
        "prompts": prompts,
        "stop": stop_token_ids(target, tokenizer),
    }


def _chain_config(args, max_new_tokens: int):
    """Greedy decoding through a static chain of k drafts (budget k + 1 nodes), no copied spans."""
    from eagletree.decode.config import CopyOptions, DecodeConfig

    return DecodeConfig(
        tree="chain",
        depth=args.k,
        budget=args.k + 1,
        max_new_tokens=max_new_tokens,
        copy=CopyOptions(enabled=False, datastore=None),
    )


def _timed(outputs: list[list[int]], seconds: float, new_tokens: int | None = None) -> dict:
    new = sum(map(len, outputs)) if new_tokens is None else new_tokens
    return {"outputs": outputs, "seconds": seconds, "new_tokens": new, "tokens_per_s": new / seconds}


def _one_at_a_time(decoder, prompts) -> dict:
    start = time.perf_counter()
    outputs = [decoder.generate(prompt).token_ids for prompt in prompts]
    return _timed(outputs, time.perf_counter() - start)


def _batched(decoder, prompts) -> dict:
    start = time.perf_counter()
    outputs = [r.token_ids for r in decoder.generate_batch(prompts, batch_size=len(prompts))]
    return _timed(outputs, time.perf_counter() - start)


def aligned_chain(decoder, prompts, firsts: list[int], m: int, stops) -> tuple[dict, list[tuple[int, int]]]:
    """Chain decoding on vLLM's schedule, one prompt at a time: vLLM's prefill emits the answer's first token
    undrafted (eagletree drafts in its first pass, from the prompt), so each prompt is continued from that token;
    `decoder` decodes m - 1 + k more, so that every pass starting before the answer's m-th token drafts all k, as
    vLLM's do (it drafts past the end of an answer). Returns the answers cut at m tokens, timed, and the (drafted,
    accepted) draft counts of the passes vLLM counts: those starting before the m-th token."""
    outputs, passes, new = [], [], 0
    start = time.perf_counter()
    for prompt, first in zip(prompts, firsts):
        tokens = []
        if m > 1 and first not in stops:
            for step in decoder.steps(list(prompt) + [first]):
                if len(tokens) < m - 1:
                    passes.append((len(step.draft) - 1, len(step.accepted) - 1))
                tokens += step.tokens
        new += len(tokens)
        outputs.append([first, *tokens[: m - 1]])
    return _timed(outputs, time.perf_counter() - start, new), passes


def run_eagletree(setup: dict, args, chain: bool, firsts: list[int] | None = None) -> dict:
    """eagletree's plain decoding (chain=False), or a static chain of k drafts (one at a time on vLLM's schedule,
    from the answers' first tokens `firsts`, see `aligned_chain`): one prompt at a time and all in one batch."""
    from eagletree.decode import Decoder

    target, tokenizer, prompts = setup["target"], setup["tokenizer"], setup["prompts"]
    head = setup["head"] if chain else None
    print(f"eagletree {'chain' if chain else 'plain'}: decoding {len(prompts)} prompts", flush=True)
    decoder = Decoder(target, tokenizer, head, _chain_config(args, args.max_new_tokens))
    decoder.generate(prompts[0])  # warm-up
    if not chain:
        return {"one_at_a_time": _one_at_a_time(decoder, prompts), "batched": _batched(decoder, prompts)}
    aligned = Decoder(target, tokenizer, head, _chain_config(args, args.max_new_tokens - 1 + args.k))
    one, passes = aligned_chain(aligned, prompts, firsts, args.max_new_tokens, set(setup["stop"]))
    return {
        "one_at_a_time": one,
        "batched": _batched(decoder, prompts),
        "acceptance": acceptance(chain_counts(passes, args.k)),
    }

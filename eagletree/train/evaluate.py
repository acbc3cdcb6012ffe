"""Evaluate a head on held-out conversations: top-1 agreement with the target and real tokens/pass."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from copy import deepcopy
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from .. import target as targets
from ..decode import Decoder, GenerationStats, decode_steps, encode_prompt, whole_answers
from ..decode.config import DecodeConfig
from ..draft import TreeDrafter, load_head
from ..errors import EagletreeError, InvalidValue
from ..files import check_output_folder, write_json_atomic
from ..packing import pack_target
from ..prompts import by_category, mtbench_subset
from ..search import Calibrator, acceptance_pairs, calibration_report
from ..search.copy import COPY_CALIBRATION, COPY_CALIBRATION_FULL_VOCAB, CopyCalibration
from .config import TrainConfig, TrainingError
from .data import DataError, load_training_data, split
from .distill.selection import first_turns
from .loop import has_assistant_text
from .render import RenderError, render


def _rendered(tokenizer, conversations, max_len: int):
    for conv in conversations:
        try:
            r = render(tokenizer, conv.messages, max_len)
        except RenderError:
            continue
        yield r.input_ids, r.loss_mask


@torch.inference_mode()
def agreement(
    head, target, tokenizer, conversations=(), steps: int = 5, max_len: int = 512, stride: int = 8, sequences=None
) -> dict:
    """Top-1 agreement of the head's draft with the target's greedy token.

    teacher_forced: every assistant position, the head reading the target's real features.
    free_running[k]: from assistant positions every `stride` tokens, the head drafts k steps ahead from
    its own predicted features (tokens: the conversation's); step k agrees when its argmax equals the
    target's greedy token there.
    `sequences`: (ids [T], mask [T] bool) pairs to measure instead of rendering `conversations`.
    """
    if not head.drafting.follows_drafts:
        return None  # (Medusa) no free-running chain to measure
    device = next(target.parameters()).device
    lm = target.get_output_embeddings()
    spec = head.feature_spec
    hits_tf = total_tf = 0
    hits = [0] * steps
    total = [0] * steps
    sequences = list(_rendered(tokenizer, conversations, max_len)) if sequences is None else sequences
    for ids, mask in tqdm(sequences, desc="agreement", leave=False):
        ids, mask = ids.to(device), mask.to(device)
        if spec.layers:
            states = target.get_decoder()(input_ids=ids[None], output_hidden_states=True).hidden_states
            final = states[-1][0]
            feats = spec.from_states(states)[0]  # the head's input: fused layers
        else:
            final = feats = target.get_decoder()(input_ids=ids[None]).last_hidden_state[0]  # [T, H]
        greedy = lm(final).argmax(-1)  # [T] the target's next token after each position
        drafter = TreeDrafter(head, target)
        d2t = drafter.token_map
        to_target = (lambda x: x) if d2t is None else (lambda x: d2t[x])  # noqa: E731, B023 (used in this iteration)
        # Teacher-forced: one causal pass over the whole conversation.
        head_in = head.fuse(feats[:-1])
        pred = head(
            head_in[None], ids[None, 1:], torch.arange(ids.numel() - 1, device=device), target.get_input_embeddings()
        )[0]
        tf = to_target(drafter.draft_probs(pred).argmax(-1))  # prediction of the token after position t+1
        m = mask[1:-1]
        hits_tf += int((tf[:-1] == greedy[1:-1])[m].sum())
        total_tf += int(m.sum())
        # Free-running chains.
        starts = [s for s in range(1, ids.numel() - steps) if mask[s + 1] and s % stride == 0]
        done = 0
        for s in starts:
            probs = drafter.extend(feats[done:s], ids[done + 1 : s + 1])
            done = s
            for k in range(steps):
                if k:
                    node = torch.tensor([k], device=device)
                    probs = drafter(node, ids[s + k : s + k + 1], node - 1, k + 1)[0]
                hits[k] += int(to_target(probs.argmax()) == greedy[s + k])
                total[k] += 1
    return {
        "teacher_forced": hits_tf / max(total_tf, 1),
        "free_running": [h / max(t, 1) for h, t in zip(hits, total)],
        "positions": total_tf,
        "chains": total[0],
    }


def tokens_per_pass(
    head, target, tokenizer, prompts, max_new_tokens=64, steps=None, answers=None, batch_size=1, **options
) -> dict:
    """Real tree decoding on chat prompts (by default EAGLE-2, 60 nodes): mean tokens per target pass, predicted vs
    measured.

    `steps`, a list, receives (tree, accepted nodes) of every pass (for calibration); `answers`, a list,
    receives (prompt ids, answer ids) per prompt: the target's own answer (decoding is lossless).
    `batch_size` > 1 decodes that many prompts together (`Decoder.results`: one budget for the batch's trees,
    so tokens/pass measures batched decoding); it records no `steps`.
    """
    options = {"tree": "eagle2", "budget": 60, **options}  # the yardstick: EAGLE-2's tree of 60 nodes
    if batch_size != 1:
        if steps is not None:
            raise InvalidValue("steps are recorded one prompt at a time: batch_size must be 1 to record them")
        results = decoded_batch(head, target, tokenizer, prompts, max_new_tokens, batch_size, **options)
        if answers is not None:
            answers += [
                (encode_prompt(tokenizer, p).flatten().cpu(), torch.tensor(r.token_ids, dtype=torch.long))
                for p, r in zip(prompts, results)
            ]
        stats = [r.stats for r in results]
        new, passes = sum(st.new_tokens for st in stats), sum(st.passes for st in stats)
        return _pass_counts(len(prompts), new, passes, [p for st in stats for p in st.predicted])
    new = passes = 0
    predicted = []
    for prompt in tqdm(prompts, desc="tokens/pass", leave=False):
        stats = GenerationStats(steps=[] if steps is not None else None)
        answer = []
        for tokens in decode_steps(
            target, tokenizer, head, prompt, max_new_tokens=max_new_tokens, stats=stats, **options
        ):
            answer += tokens
        if answers is not None:
            answers.append((encode_prompt(tokenizer, prompt).flatten().cpu(), torch.tensor(answer, dtype=torch.long)))
        new += stats.new_tokens
        passes += stats.passes
        predicted += stats.predicted
        if steps is not None:
            steps += stats.steps
    return _pass_counts(len(prompts), new, passes, predicted)


def _pass_counts(prompts: int, new: int, passes: int, predicted: list) -> dict:
    """`tokens_per_pass`'s result: the prompts' new tokens and passes, and every pass's predicted tokens/pass."""
    return {
        "tokens_per_pass": new / max(passes, 1),
        "predicted": sum(predicted) / max(len(predicted), 1),
        "prompts": prompts,
        "new_tokens": new,
        "passes": passes,
    }


def decoded_batch(head, target, tokenizer, prompts, max_new_tokens, batch_size, **options) -> list:
    """GenerationResults of `prompts` (in order), decoded `batch_size` at a time by one Decoder; `options` are
    `decode_steps`' (DecodeConfig's fields or flat names, and profile, calibrator, copy_calibration)."""
    made = {k: options.pop(k) for k in ("profile", "calibrator", "copy_calibration") if k in options}
    config = DecodeConfig.from_options(max_new_tokens=max_new_tokens, **options)
    decoder = Decoder(target, tokenizer, head, config, **made)
    results = [None] * len(prompts)
    for i, result in tqdm(decoder.results(prompts, batch_size), total=len(prompts), desc="tokens/pass", leave=False):
        results[i] = result
    return whole_answers(results)


def measure_copy_calibration(
    head, target, tokenizer, prompts, max_new_tokens=128, copy_len=16, table_len=16, **options
):
    """Acceptance of copied spans by match length and position, measured by decoding `prompts` with copying on.

    Spans run to `copy_len` tokens; the table has `table_len` positions, its last one counting every later
    position too (as decoding reads it). Decoding's spans run to 64, but measuring with 64-token spans gave a
    table no better than with 16 (docs/results.md), and the shipped table was measured with 16. Returns
    (CopyCalibration, tokens/pass result); save the calibration next to the head (`copy_calibration.json`) and
    decoding starts from it instead of an uninformed 0.5. The context's copies alone are measured (store=None, as
    the shipped table was): decoding values retrieved spans (a head's datastore.npz) with the same table.
    """
    calibration = CopyCalibration(max_len=table_len, draft_vocab_size=head.drafted_vocab_size())
    result = tokens_per_pass(
        head,
        target,
        tokenizer,
        prompts,
        max_new_tokens,
        copy=True,
        copy_len=copy_len,
        copy_calibration=calibration,
        **({"store": None} | options),
    )
    return calibration, result


def answer_sequences(answers) -> list:
    """(prompt ids, answer ids) pairs -> the (ids, mask over the answer) sequences `agreement` measures."""
    return [(torch.cat([p, a]), torch.arange(p.numel() + a.numel()) >= p.numel()) for p, a in answers]


def calibrate(steps, method: str = "isotonic") -> tuple:
    """Fit a calibrator on the first half of logged steps; report predicted vs measured on the second half."""
    half = len(steps) // 2
    if half == 0:
        raise InvalidValue("need at least two logged steps to calibrate")
    probs, hits = [], []
    for tree, accepted in steps[:half]:
        q, y = acceptance_pairs(tree, accepted)
        probs += q
        hits += y
    calibrator = Calibrator.fit(probs, hits, method)
    return calibrator, calibration_report(steps[half:], calibrator)


def heldout_prompts(conversations, n: int) -> list[list[dict]]:
    """First user turn (with the turns before it) of the first `n` held-out conversations that have one."""
    return [msgs for _, msgs in first_turns(conversations)][:n]


def evaluation_conversations(cfg) -> list:
    """Held-out conversations of `eval_dataset` (or `dataset`); a TrainingError when they are too few.

    `train.py --eval` calls this before training, so a wrong eval_dataset is found before the run, not after.
    """
    source = cfg.eval_dataset or cfg.dataset
    try:
        _, heldout = split(load_training_data(source), cfg.heldout_fraction)  # (ShareGPT's known cut: not warned)
    except DataError as e:
        raise TrainingError(f"eval_dataset: {e}") from e
    if len(heldout) <= cfg.eval_conversations:
        raise TrainingError(
            f"{source} has {len(heldout)} held-out conversations, too few for eval_conversations="
            f"{cfg.eval_conversations} plus prompts; set eval_dataset (e.g. sharegpt for a distilled "
            "dataset, whose conversations all come from the training split)"
        )
    if not has_assistant_text(heldout):
        raise TrainingError(
            f"{source}: none of its {len(heldout)} held-out conversations has an assistant turn with "
            "text; agreement is measured on assistant tokens"
        )
    return heldout


def mtbench_tokens_per_pass(
    head,
    target,
    tokenizer,
    questions: int,
    max_new_tokens: int = 128,
    depth: int = 6,
    copy_calibration: CopyCalibration | None = None,
    batch_size: int = 1,
) -> dict:
    """Tokens/pass on `questions` MT-bench first turns (spread over the 8 categories), per category and mean:
    EAGLE-2, 60 nodes, top-k 10, T = 0, the head alone, or with copied spans valued by `copy_calibration`
    (a copy of it starts every question, so each question's number does not depend on the ones before).
    `batch_size` > 1 decodes that many questions together (one budget for the batch's trees; with copies,
    the questions of the run share one copy of `copy_calibration`)."""
    chosen = mtbench_subset(questions)

    def copying():
        if copy_calibration is None:
            return dict(copy=False)
        return dict(copy=True, copy_calibration=deepcopy(copy_calibration))

    new, passes = [], []
    options = dict(tree="eagle2", budget=60, depth=depth, top_k_draft=10)
    if batch_size == 1:
        for q in tqdm(chosen, desc="MT-bench", leave=False):
            r = tokens_per_pass(head, target, tokenizer, [q.messages()], max_new_tokens, **options, **copying())
            new.append(r["new_tokens"])
            passes.append(r["passes"])
    else:
        prompts = [q.messages() for q in chosen]
        for r in decoded_batch(head, target, tokenizer, prompts, max_new_tokens, batch_size, **options, **copying()):
            new.append(r.stats.new_tokens)
            passes.append(r.stats.passes)
    return {
        "questions": len(chosen),
        "max_new_tokens": max_new_tokens,
        "depth": depth,
        **({"batch_size": batch_size} if batch_size != 1 else {}),
        "tokens_per_pass": by_category([q.category for q in chosen], new, passes),
    }


def evaluate_run(
    cfg,
    head,
    n_prompts: int = 10,
    max_new_tokens: int = 64,
    depth: int = 6,
    heldout=None,
    mtbench: int = 0,
    batch_size: int = 1,
) -> dict:
    """Agreement (on held-out ShareGPT answers and on the target's own answers to the held-out prompts) and
    tokens/pass on held-out ShareGPT prompts, and with `mtbench` > 0 on that many MT-bench first turns (128
    new tokens, per category, head alone and with copied spans); written to <out_dir>/metrics.json.

    `heldout`: what `evaluation_conversations(cfg)` returned, when the caller already has it. `batch_size` > 1
    decodes the copy and MT-bench runs that many prompts at a time (batched decoding's tokens/pass, labelled with
    it); the held-out run of the head alone stays at one prompt at a time: its passes' trees fit the calibration.
    """
    heldout = evaluation_conversations(cfg) if heldout is None else heldout
    head, target, tok = _evaluation_target(cfg, head)
    metrics = {"agreement": agreement(head, target, tok, heldout[: cfg.eval_conversations], max_len=cfg.max_len)}
    prompts = heldout_prompts(heldout[cfg.eval_conversations :], n_prompts)
    calibrator, copy_calibration = _heldout_tokens_per_pass(
        metrics, head, target, tok, prompts, max_new_tokens, depth, batch_size
    )
    if mtbench:
        # copies valued by the calibration just measured on the held-out prompts (what is saved with the head)
        metrics["mtbench"] = {
            "eagle2_60": mtbench_tokens_per_pass(head, target, tok, mtbench, depth=depth, batch_size=batch_size),
            "eagle2_60_copy": mtbench_tokens_per_pass(
                head, target, tok, mtbench, depth=depth, copy_calibration=copy_calibration, batch_size=batch_size
            ),
        }
    head_dir = Path(cfg.out_dir, "head")
    if head_dir.is_dir():
        write_json_atomic(head_dir / "calibration.json", asdict(calibrator))
        copy_calibration.save(head_dir / COPY_CALIBRATION)  # the saved head drafts over the vocabulary measured
    write_json_atomic(Path(cfg.out_dir, "metrics.json"), metrics)
    return metrics


def _evaluation_target(cfg, head) -> tuple:
    """(head, target, tokenizer) for evaluating `head`: the run's target on its device, the head there in eval mode.

    At generate's default precision there (fp32 on CPU, bf16 on CUDA), as users decode; loaded through the module,
    so a stand-in model can replace it."""
    target, tok = targets.load_target(cfg.target, device=cfg.device or None)
    pack_target(target, "auto")  # faster on CPU; tokens/pass does not depend on the kernels
    head.check_target(target.config)
    return head.to(next(target.parameters()).device).eval(), target, tok


def _heldout_tokens_per_pass(metrics, head, target, tok, prompts, max_new_tokens: int, depth: int, batch_size: int):
    """Tokens/pass on the held-out `prompts`, the head alone and with copied spans, and agreement on the target's
    own answers to them, into `metrics`; returns (the calibrator fitted on the head-alone run, the copy
    calibration)."""
    steps, answers = [], []
    metrics["eagle2_60"] = tokens_per_pass(
        head,
        target,
        tok,
        prompts,
        max_new_tokens,
        steps=steps,
        answers=answers,
        budget=60,
        depth=depth,
        top_k_draft=10,
        copy=False,
    )  # the head alone
    metrics["eagle2_60"]["depth"] = depth
    copy_calibration, metrics["eagle2_60_copy"] = measure_copy_calibration(
        head, target, tok, prompts, max_new_tokens, budget=60, depth=depth, top_k_draft=10, batch_size=batch_size
    )
    if batch_size != 1:
        metrics["eagle2_60_copy"]["batch_size"] = batch_size
    # The text T=0 decoding drafts is the target's own: agreement on those answers, not on ShareGPT's.
    metrics["agreement_own_answers"] = agreement(head, target, tok, sequences=answer_sequences(answers))
    calibrator, metrics["calibration"] = calibrate(steps)
    return calibrator, copy_calibration


def ship(run_dir, dest) -> Path:
    """Copy a run's head as bf16 safetensors (+ its calibration) to `dest`, e.g. eagletree/heads/NAME."""
    src = Path(run_dir) / "head"
    head = load_head(src)
    head.save_pretrained(dest, dtype=torch.bfloat16)
    for name in ("calibration.json", COPY_CALIBRATION, COPY_CALIBRATION_FULL_VOCAB):
        if (src / name).is_file():
            shutil.copy(src / name, Path(dest) / name)
    if (Path(run_dir) / "metrics.json").is_file():
        shutil.copy(Path(run_dir) / "metrics.json", Path(dest) / "metrics.json")
    return Path(dest)


def main(argv=None) -> int:
    """`python -m eagletree.train.evaluate --config CFG [--ship DIR]`: evaluate a finished run's head."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--prompts", type=int, default=10, help="held-out prompts for tokens/pass")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt for tokens/pass")
    ap.add_argument("--depth", type=int, default=6, help="the EAGLE-2 tree's depth (60 nodes, top-k 10)")
    ap.add_argument(
        "--mtbench",
        type=int,
        default=0,
        help="also tokens/pass on this many MT-bench first turns (per category, 128 new tokens)",
    )
    ap.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="prompts decoded together in the copy and MT-bench tokens/pass runs (default 1: one at a time; more "
        "measures batched decoding, one budget per batch); the head-alone run, which calibrates, stays at 1",
    )
    ap.add_argument("--ship", default=None, help="then copy the head (bf16) with its metrics to this folder")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        if args.mtbench < 0:
            raise TrainingError(f"--mtbench must be >= 0 (0 = no MT-bench), got {args.mtbench}")
        for flag, value, least in (
            ("--prompts", args.prompts, 1),
            ("--max-new-tokens", args.max_new_tokens, 2),
            ("--depth", args.depth, 1),
            ("--batch-size", args.batch_size, 1),
        ):
            if value < least:
                raise TrainingError(f"{flag} must be >= {least}, got {value}")
        if args.ship:
            check_output_folder(args.ship, "--ship")  # before the evaluation, not after it
        cfg = TrainConfig.from_sources(args.config, args.overrides)
        head = load_head(Path(cfg.out_dir) / "head")
        metrics = evaluate_run(
            cfg,
            head,
            n_prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            depth=args.depth,
            mtbench=args.mtbench,
            batch_size=args.batch_size,
        )
        print(json.dumps(metrics, indent=2))
        if args.ship:
            print(f"shipped to {ship(cfg.out_dir, args.ship)}")
    except (EagletreeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

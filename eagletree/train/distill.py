"""Self-distillation data: the target's own answers to the training prompts.

A head drafts for the target's text, not for the dataset's: ShareGPT's answers come from much
larger models, so a head trained on them learns contexts the target never writes. `eagletree
distill` answers the first user turn of each training conversation (or, with `--turns`, the later
ones, after the conversation so far) with the target (greedy by default) and appends one JSONL
record per answer; train on the file with `dataset=PATH`.

Only the training side of the held-out split is read, so evaluation prompts stay unseen. The file
is append-only and resumable: a rerun skips the ids already answered, and a line cut off by an
interruption is removed before anything is appended.

The answers come from HF `generate` on left-padded batches (decoder "hf"), or, greedy, from eagletree's own
batched speculative decoding with a head (decoder "eagletree"): lossless, so the same records either way. Decoder
"vllm" hands the same prompt token ids to vLLM's offline `LLM` (`vllm_engine.VllmEngine`, an optional dependency) in
chunks of `batch_size`, vLLM batching each chunk itself; its greedy fp32 answers are HF's too.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

from ..decoding import Decoder, encode_prompt, hf_generation_config, stop_token_ids
from ..decoding.config import DecodeConfig
from ..draft_heads import target_identity
from ..errors import EagletreeError
from ..files import appending, read_appended_jsonl
from ..target.ragged import sliding_window
from .data import TURNS


class DistillError(EagletreeError, ValueError):
    """Bad distillation settings or output file; the message names the value."""


def first_turns(conversations) -> list[tuple[str, list[dict]]]:
    """(id, messages through the first non-empty user turn) of each conversation that has one.

    The same prompts as evaluation takes from held-out conversations (`evaluate.heldout_prompts`).
    """
    return user_turns(conversations, "first")


def user_turns(conversations, turns: str = "first") -> list[tuple[str, list[dict]]]:
    """(id, messages through a user turn) for the conversations' first user turns, their later ones, or all.

    A later turn's prompt is the conversation up to it, earlier answers included as the dataset has
    them; its id is the conversation's with `@turn<k>` (k = 2, 3, ...), which the held-out split
    reads as the same conversation (`data.base_id`). Empty user turns are left out.
    """
    if turns not in TURNS:
        raise DistillError(f"turns must be one of {', '.join(TURNS)}, got {turns!r}")
    out = []
    for conv in conversations:
        msgs, k = [], 0
        for m in conv.messages:
            msgs.append(m)
            if m["role"] != "user":
                continue
            k += 1
            if m["content"].strip() and (turns == "all" or (k == 1) == (turns == "first")):
                out.append((conv.id if k == 1 else f"{conv.id}@turn{k}", list(msgs)))
            if turns == "first":
                break
    return out


def _record(line: str, where: str, settings: dict | None, fix: str) -> str:
    """The id of one output line; an error names the line (and `fix`) when it is not a record of these settings."""
    try:
        record = json.loads(line)
        conv_id, made_with = record["id"], record.get("settings")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise DistillError(f"{where} is not a distillation record ({e}); {fix}") from e
    if settings is not None and made_with != settings:
        raise DistillError(
            f"{where} was made with {made_with}, this run asks for {settings}; pass another --out "
            "(one file, one way of answering)"
        )
    return conv_id


def _scan(path: Path, settings: dict | None, fix: str) -> tuple[set[str], int, bool, int]:
    """(ids, end of the last whole line, whether the bytes after it are a complete record, their length).

    A complete record after the last newline counts (its id is in `ids`); anything else there is what a
    kill in the middle of a write leaves, possibly a cut UTF-8 character, and is not read.
    """
    lines, last, end, tail = read_appended_jsonl(
        path, lambda e: DistillError(f"{path} is not UTF-8 ({e}); expected a JSONL file written by distill")
    )
    ids = {_record(line, f"{path}: line {n}", settings, fix) for n, line in lines}
    if last is not None:  # a complete record that only lacks its newline (another run's settings are an error)
        ids.add(_record(last, f"{path}: last line", settings, fix))
    return ids, end, last is not None, len(tail)


def answered_ids(path: Path, settings: dict | None = None) -> set[str]:
    """Ids already in the output (every line must be a record made with `settings`, when given).

    A last line without its newline is kept (newline added) when it is a whole record, else cut off:
    that is what a kill in the middle of a write leaves.
    """
    if not path.exists():
        return set()
    done, end, whole, tail = _scan(path, settings, "pass another --out or remove the file")
    if whole:
        with open(path, "ab") as f:
            f.write(b"\n")
    elif tail:
        with open(path, "r+b") as f:  # an interrupted write: keep the complete lines only
            f.truncate(end)
        warnings.warn(f"{path}: removed a cut-off last line ({tail} bytes) left by an interruption", stacklevel=2)
    return done


def ids_in(path: str | os.PathLike) -> set[str]:
    """Ids of the records in another distillation file, read only (what `answered_ids` reads, without its repair).

    For `skip_answered`: prompts another file (e.g. one made with a different max_new_tokens) already answers.
    """
    path = Path(path)
    if not path.is_file():
        raise DistillError(f"skip_answered: {path} is not a file; expected a JSONL file written by distill")
    return _scan(path, None, "pass another --skip-answered file")[0]


def _batches(items, tok, batch_size: int, max_prompt_tokens: int, min_prompt_tokens: int = 0):
    """Prompts of similar length together (less padding), in a fixed order; prompts longer than
    max_prompt_tokens or shorter than min_prompt_tokens are skipped (counted: long, short).

    Built from all prompts, answered or not, so a resumed run makes the same batches as a straight one.
    """
    rendered, long, short = [], 0, 0
    for conv_id, msgs in items:
        ids = encode_prompt(tok, msgs).tolist()  # the prompt tokens decoding itself starts from
        if len(ids) > max_prompt_tokens or len(ids) < min_prompt_tokens:
            long += len(ids) > max_prompt_tokens
            short += len(ids) < min_prompt_tokens
            continue
        rendered.append((conv_id, msgs, ids))
    # Sorted within windows of 16 batches: similar lengths per batch, yet the file fills in dataset order.
    window = batch_size * 16
    batches = []
    for w in range(0, len(rendered), window):
        chunk = sorted(rendered[w : w + window], key=lambda r: len(r[2]))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches, long, short


@torch.inference_mode()
def _answer_batch(model, tok, batch, max_new_tokens: int, temperature: float, seed: int):
    """Left-padded greedy (or sampled) generation of one batch; (text, new token count, finish) per prompt.

    Greedy means the argmax of the model's own logits, as in speculative decoding: the model's
    generation_config (repetition penalty and the like) is not applied.
    """
    device = next(model.parameters()).device
    stops = _stops(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    width = max(len(r[2]) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (_, _, p) in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    # Every logits-shaping value set explicitly: generate() fills the unset ones from the model's generation_config.
    config = hf_generation_config(max_new_tokens, temperature, stops, pad_token_id=pad)
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), generation_config=config)
    return [_answer_of(tok, row, stops) for row in out[:, width:].cpu().tolist()]


def check_match(match: str) -> re.Pattern:
    """distill's `match`, compiled; a DistillError naming it when it is not a regular expression."""
    try:
        return re.compile(match)
    except (re.error, TypeError) as e:
        raise DistillError(f"match must be a regular expression, got {match!r} ({e})") from None


def distill(
    model,
    tok,
    conversations,
    out: str | os.PathLike,
    max_new_tokens: int = 320,
    max_prompt_tokens: int = 256,
    batch_size: int = 16,
    temperature: float = 0.0,
    limit: int = 0,
    seed: int = 0,
    skip_answered: tuple = (),
    progress: bool = True,
    turns: str = "first",
    min_prompt_tokens: int = 0,
    match: str | None = None,
    decoder: str = "hf",
    head=None,
    engine=None,
) -> dict:
    """Answer the user turns of `conversations` that `turns` picks ("first", "later" or "all": see
    `user_turns`) with the target; append JSONL records to `out`.

    Each record: {"id", "messages": prompt + [{"role": "assistant", "content": answer}], "finish": "eos" |
    "length", "new_tokens", "settings"}; a later turn's prompt holds the dataset's earlier answers with
    "weight": 0 (context: training learns the target's own answer only). A file holds answers made one way
    (target, precision, temperature, max_new_tokens, seed): resuming with other settings is an error. `limit`
    takes the first N prompts `turns` picks (0 = all; with "first", the first N conversations'); those answered
    in any file of `skip_answered` (paths) are left out and counted, so a limit of N answers at most N. Prompts
    outside min_prompt_tokens..max_prompt_tokens are skipped (counted). `match`, a regular expression: only the
    prompts whose user turn it finds something in (`re.search`; e.g. "(?i)python|```" for a datastore of code
    answers) are answered, the others counted; `limit` then takes the first N of those. `decoder`: "hf" (HF
    `generate` on left-padded batches of similar length) or "eagletree" (greedy only: eagletree's own lossless
    batched decoding with `head`, None for plain, `batch_size` sequences per target pass, each record written as
    its answer finishes; the same answers and records) or "vllm" (`engine`, a `vllm_engine.VllmEngine`, answers
    `batch_size` prompts per call, each call's records appended together; sampled answers draw with a seed of their
    own, so their records name the engine). Returns counts.
    """
    _check_settings(tok, max_new_tokens, max_prompt_tokens, batch_size, temperature, limit, min_prompt_tokens)
    _check_decoder(decoder, temperature, engine)
    settings = {
        "target": target_identity(model.config)["fingerprint"],
        "dtype": str(model.dtype).removeprefix("torch."),
        "temperature": float(temperature),
        "max_new_tokens": max_new_tokens,
        **({"seed": seed} if temperature > 0 else {}),
        **({"turns": turns} if turns != "first" else {}),
        **({"engine": "vllm"} if decoder == "vllm" and temperature > 0 else {}),  # other draws than HF's
    }
    path = Path(out)
    elsewhere = _answered_elsewhere(skip_answered, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = answered_ids(path, settings)
    items, no_match = _prompts_to_answer(conversations, turns, match, limit)
    # Batches from all prompts, skipped ones included: the grouping does not depend on the other files.
    batches, long, short = _batches(items, tok, batch_size, max_prompt_tokens, min_prompt_tokens)
    left_out = done | elsewhere
    todo = [b for b in batches if any(r[0] not in left_out for r in b)]
    counts = _new_counts(path, batches, done, elsewhere, (long, short, no_match))
    bar = tqdm(
        total=sum(r[0] not in left_out for b in todo for r in b), desc="distill", unit="answer", disable=not progress
    )
    if decoder == "eagletree":
        _decode_answers(model, tok, head, todo, left_out, path, settings, counts, bar, max_new_tokens, batch_size)
    elif decoder == "vllm":
        how = (max_new_tokens, batch_size, temperature, seed)
        _engine_answers(engine, model, tok, todo, left_out, path, settings, counts, bar, how)
    else:
        _answer_batches(model, tok, todo, left_out, path, settings, counts, bar, max_new_tokens, temperature, seed)
    return counts


def _new_counts(path: Path, batches, done: set[str], elsewhere: set[str], skipped: tuple) -> dict:
    """distill's counts before anything is answered: the prompts already in `path` or answered `elsewhere`, and
    `skipped` (long prompts, short ones, ones `match` left out)."""
    long, short, no_match = skipped
    return {
        "out": str(path),
        "already": sum(r[0] in done for b in batches for r in b),
        "answered": 0,
        "skipped_long_prompt": long,
        "skipped_short_prompt": short,
        "skipped_no_match": no_match,
        "skipped_answered_elsewhere": sum(r[0] in elsewhere and r[0] not in done for b in batches for r in b),
        "new_tokens": 0,
        "eos": 0,
        "length": 0,
        "skipped_error": 0,
    }


def _answered_elsewhere(skip_answered, path: Path) -> set[str]:
    """The ids the `skip_answered` files (a path, or several) answer; never the output file itself."""
    if isinstance(skip_answered, (str, os.PathLike)):
        skip_answered = (skip_answered,)
    for other in skip_answered:
        if Path(other).resolve() == path.resolve():
            raise DistillError(f"skip_answered: {other} is the output file itself; a rerun already continues it")
    return set().union(*(ids_in(p) for p in skip_answered))


def _prompts_to_answer(conversations, turns: str, match: str | None, limit: int) -> tuple[list, int]:
    """(id, messages) of the user turns `turns` picks whose text `match` finds something in, the first `limit`
    of them (0: all), and how many `match` left out."""
    pattern = None if match is None else check_match(match)
    items = user_turns(conversations, turns)
    no_match = 0
    if pattern is not None:
        kept = [item for item in items if pattern.search(item[1][-1]["content"])]
        no_match, items = len(items) - len(kept), kept
    return (items[:limit] if limit else items), no_match


def _check_settings(tok, max_new_tokens, max_prompt_tokens, batch_size, temperature, limit, min_prompt_tokens):
    """DistillError naming the first setting outside its range, or a tokenizer without a chat template."""
    for name, value, low in (
        ("max_new_tokens", max_new_tokens, 1),
        ("max_prompt_tokens", max_prompt_tokens, 1),
        ("batch_size", batch_size, 1),
        ("limit", limit, 0),
        ("min_prompt_tokens", min_prompt_tokens, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise DistillError(f"{name} must be an integer >= {low}, got {value!r}")
    if min_prompt_tokens > max_prompt_tokens:
        raise DistillError(
            f"min_prompt_tokens ({min_prompt_tokens}) must not exceed max_prompt_tokens "
            f"({max_prompt_tokens}): no prompt would be answered"
        )
    if not temperature >= 0:
        raise DistillError(f"temperature must be >= 0, got {temperature!r}")
    if getattr(tok, "chat_template", None) is None:
        raise DistillError(
            f"the tokenizer {getattr(tok, 'name_or_path', '')!r} has no chat template: there is no "
            "prompt format to answer in"
        )


def _answer_batches(model, tok, todo, left_out, path, settings, counts, bar, max_new_tokens, temperature, seed):
    """Answer the batches' prompts not in `left_out`, appending whole records to `path` batch by batch; counts
    what was written into `counts` (and the seconds it took)."""
    t0 = time.perf_counter()
    with appending(path) as f:
        for batch in todo:
            # Only the prompts still missing: a batch is written whole, so after an interruption between
            # batches the rest matches a straight run exactly; a batch cut short by a kill mid-write (or
            # batches regrouped by a newer version) answers its missing prompts in a smaller batch.
            pending = [r for r in batch if r[0] not in left_out]
            seed_b = seed * 1_000_003 + zlib.crc32(batch[0][0].encode("utf-8"))  # fixed per batch, resumed or not
            answers = _answer_batch(model, tok, pending, max_new_tokens, temperature, seed_b)
            lines = [
                _record_line(conv_id, msgs, answer, settings, counts)
                for (conv_id, msgs, _), answer in zip(pending, answers)
            ]
            _append(f, lines)  # whole records only; flushed per batch so an interruption loses one batch
            counts["answered"] += len(lines)
            bar.update(len(pending))
            bar.set_postfix(tok_s=f"{counts['new_tokens'] / max(time.perf_counter() - t0, 1e-9):.0f}")
    bar.close()
    counts["seconds"] = round(time.perf_counter() - t0, 1)


def _record_line(conv_id: str, msgs: list[dict], answer: tuple, settings: dict, counts: dict) -> str:
    """One record's JSONL line for the answer (text, new token count, finish) to `msgs`; counted in `counts`."""
    text, n, finish = answer
    context = [dict(m, weight=0) if m["role"] == "assistant" else m for m in msgs]  # the dataset's answers
    record = {
        "id": conv_id,
        "messages": context + [{"role": "assistant", "content": text}],
        "finish": finish,
        "new_tokens": n,
        "settings": settings,
    }
    counts["new_tokens"] += n
    counts[finish] += 1
    return json.dumps(record, ensure_ascii=False) + "\n"


DECODERS = ("hf", "eagletree", "vllm")


def _check_decoder(decoder: str, temperature: float, engine=None) -> None:
    """DistillError unless `decoder` is one of DECODERS, answering as asked (decoder "vllm" with its `engine`)."""
    if decoder not in DECODERS:
        raise DistillError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    if decoder == "eagletree" and temperature > 0:
        raise DistillError(
            f"decoder='eagletree' answers greedily (temperature 0), got temperature {temperature:g}: its sampled "
            "answers would be other draws than HF's for the same seed; use decoder='hf' to sample"
        )
    if decoder == "vllm" and engine is None:
        raise DistillError("decoder='vllm' needs engine=, a VllmEngine (eagletree.train.vllm_engine), got None")


def _append(f, lines: list[str]) -> None:
    """Write whole record lines, flushed and synced: an interruption afterwards loses none of them."""
    f.write("".join(lines))
    f.flush()
    os.fsync(f.fileno())


def _stops(model, tok) -> list[int]:
    """The answers' stop tokens; DistillError when there are none (answers would never end)."""
    stops = stop_token_ids(model, tok)
    if not stops:
        raise DistillError(
            f"{getattr(tok, 'name_or_path', 'the tokenizer')}: no EOS token and no eos_token_id in the "
            "model's generation_config: answers would never end"
        )
    return stops


def _answer_of(tok, token_ids: list[int], stops) -> tuple[str, int, str]:
    """(text, new token count, finish) of generated tokens: cut before the first stop token ("eos"), else "length"."""
    n = next((i for i, t in enumerate(token_ids) if t in stops), None)
    if n is None:
        return tok.decode(token_ids, skip_special_tokens=True), len(token_ids), "length"
    return tok.decode(token_ids[:n], skip_special_tokens=True), n, "eos"


def _check_prompts_fit(model, pending, max_new_tokens: int, sliding: bool = True) -> None:
    """DistillError naming the first prompt of `pending` (id, messages, ids) that eagletree's decoder (or vLLM)
    refuses: one whose tokens + max_new_tokens pass the target's context, or (`sliding`: eagletree's decoder) that
    is longer than its sliding window."""
    limit = getattr(model.config, "max_position_embeddings", None)
    window = sliding_window(model) if sliding else None
    for conv_id, _, ids in pending:
        if limit is not None and len(ids) + max_new_tokens > limit:
            raise DistillError(
                f"{conv_id}: its prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"target's context of {limit} tokens; lower max_prompt_tokens or max_new_tokens"
            )
        if window is not None and len(ids) > window:
            raise DistillError(
                f"{conv_id}: its prompt ({len(ids)} tokens) is longer than the target's sliding window of {window} "
                "tokens, past which --engine eagletree does not decode; lower max_prompt_tokens or use --engine hf"
            )


def _decode_answers(model, tok, head, todo, left_out, path, settings, counts, bar, max_new_tokens, batch_size):
    """decoder="eagletree": the batches' prompts not in `left_out`, in their order, answered greedily by eagletree's
    batched decoding (`Decoder.results`: `batch_size` sequences per target pass, a finished one's place taken by
    the next prompt); each record is appended, flushed and synced as its answer finishes. An answer that ended
    with an error (it reached a sliding-window target's window) is not written: warned about by its id and
    counted as skipped_error (a rerun decodes it again)."""
    pending = [r for batch in todo for r in batch if r[0] not in left_out]
    _check_prompts_fit(model, pending, max_new_tokens)
    stops = _stops(model, tok)
    decoding = Decoder(model, tok, head, DecodeConfig(max_new_tokens=max_new_tokens))
    t0 = time.perf_counter()
    with appending(path) as f:
        for i, result in decoding.results([ids for _, _, ids in pending], batch_size):
            conv_id, msgs, _ = pending[i]
            if result.error is not None:  # a cut answer is not the target's: not written (HF's decoder has it)
                warnings.warn(f"{conv_id}: not written: {result.error} (--engine hf answers it)", stacklevel=2)
                counts["skipped_error"] += 1
                bar.update(1)
                continue
            f.write(_record_line(conv_id, msgs, _answer_of(tok, result.token_ids, stops), settings, counts))
            f.flush()  # one whole record at a time: an interruption loses the answers still being decoded
            os.fsync(f.fileno())
            counts["answered"] += 1
            bar.update(1)
            bar.set_postfix(tok_s=f"{counts['new_tokens'] / max(time.perf_counter() - t0, 1e-9):.0f}")
    bar.close()
    counts["seconds"] = round(time.perf_counter() - t0, 1)


def _engine_answers(engine, model, tok, todo, left_out, path, settings, counts, bar, how):
    """decoder="vllm": the batches' prompts not in `left_out`, in their order, answered by `engine` in chunks of
    `batch_size` (`how`: max_new_tokens, batch_size, temperature, seed); each chunk's records are appended, flushed
    and synced together once the chunk is answered, so an interruption loses at most the chunk being answered and a
    rerun answers it again. A sampled prompt draws with a seed of its own, the same however the prompts are
    chunked, so a resumed run writes a straight run's answers. The engine starts only when there is something to
    answer; its start's seconds are counted apart (engine_start_seconds) from the answering's (seconds)."""
    max_new_tokens, chunk, temperature, seed = how
    pending = [r for batch in todo for r in batch if r[0] not in left_out]
    t0 = time.perf_counter()
    if pending:
        _check_prompts_fit(model, pending, max_new_tokens, sliding=False)
        stops = _stops(model, tok)
        engine.start(max_model_len=max(len(r[2]) for r in pending) + max_new_tokens, max_seqs=chunk)
        counts["engine_start_seconds"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        with appending(path) as f:
            for start in range(0, len(pending), chunk):
                part = pending[start : start + chunk]
                seeds = [seed * 1_000_003 + zlib.crc32(conv_id.encode("utf-8")) for conv_id, _, _ in part]
                answers = engine.generate([ids for _, _, ids in part], max_new_tokens, temperature, seeds, stops)
                lines = [
                    _record_line(conv_id, msgs, _engine_answer(tok, ids, finish, stops), settings, counts)
                    for (conv_id, msgs, _), (ids, finish) in zip(part, answers)
                ]
                _append(f, lines)
                counts["answered"] += len(lines)
                bar.update(len(part))
                bar.set_postfix(tok_s=f"{counts['new_tokens'] / max(time.perf_counter() - t0, 1e-9):.0f}")
    bar.close()
    counts["seconds"] = round(time.perf_counter() - t0, 1)


def _engine_answer(tok, token_ids: list[int], finish: str, stops) -> tuple[str, int, str]:
    """(text, new token count, finish) of an engine's answer: cut before its first stop token, as HF's are; an
    answer the engine ended at a stop token it left out of `token_ids` finished with "eos" too."""
    text, n, how = _answer_of(tok, token_ids, stops)
    return text, n, "eos" if finish == "stop" else how

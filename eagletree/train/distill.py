"""Self-distillation data: the target's own answers to the training prompts.

A head drafts for the target's text, not for the dataset's: ShareGPT's answers come from much
larger models, so a head trained on them learns contexts the target never writes. `eagletree
distill` answers the first user turn of each training conversation with the target (greedy by
default) and appends one JSONL record per answer; train on the file with `dataset=PATH`.

Only the training side of the held-out split is read, so evaluation prompts stay unseen. The file
is append-only and resumable: a rerun skips the ids already answered, and a line cut off by an
interruption is removed before anything is appended.
"""

from __future__ import annotations

import json
import os
import time
import warnings
import zlib
from pathlib import Path

import torch
from tqdm import tqdm


class DistillError(ValueError):
    """Bad distillation settings or output file; the message names the value."""


def first_turns(conversations) -> list[tuple[str, list[dict]]]:
    """(id, messages up to and including the first non-empty user turn, with a system turn before it)."""
    out = []
    for conv in conversations:
        msgs = []
        for m in conv.messages:
            if m["role"] == "assistant":
                break
            msgs.append(m)
            if m["role"] == "user":
                break
        if msgs and msgs[-1]["role"] == "user" and msgs[-1]["content"].strip():
            out.append((conv.id, msgs))
    return out


def answered_ids(path: Path) -> set[str]:
    """Ids already in the output; a last line cut off without its newline is cut from the file."""
    if not path.exists():
        return set()
    raw = path.read_bytes()
    end = raw.rfind(b"\n") + 1
    if end < len(raw):
        with open(path, "r+b") as f:  # an interrupted write: keep the complete lines only
            f.truncate(end)
        warnings.warn(f"{path}: removed a cut-off last line ({len(raw) - end} bytes) left by an interruption",
                      stacklevel=2)
    done = set()
    for n, line in enumerate(raw[:end].decode("utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DistillError(f"{path}: line {n} is not a distillation record ({e}); "
                               "pass another --out or remove the file") from e
    return done


def _batches(items, tok, batch_size: int, max_prompt_tokens: int):
    """Prompts of similar length together (less padding), in a fixed order; over-long prompts are skipped."""
    rendered = []
    skipped = 0
    for conv_id, msgs in items:
        ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        rendered.append((conv_id, msgs, list(ids)))
    # Sort within windows of 16 batches: similar lengths per batch, yet the file fills in dataset order.
    window = batch_size * 16
    batches = []
    for w in range(0, len(rendered), window):
        chunk = sorted(rendered[w : w + window], key=lambda r: len(r[2]))
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches, skipped


@torch.inference_mode()
def _answer_batch(model, tok, batch, max_new_tokens: int, temperature: float, generator_seed: int):
    """Left-padded greedy (or sampled) generation of one batch; (text, new token count, finish) per prompt."""
    device = next(model.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(r[2]) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (_, _, p) in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=tok.eos_token_id)
    if temperature > 0:
        torch.manual_seed(generator_seed)
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), **kwargs)[:, width:].cpu()
    results = []
    for row in out.tolist():
        n = len(row)
        finish = "length"
        if tok.eos_token_id in row:
            n, finish = row.index(tok.eos_token_id), "eos"
        results.append((tok.decode(row[:n], skip_special_tokens=True), n, finish))
    return results


def distill(model, tok, conversations, out: str | os.PathLike, max_new_tokens: int = 320, max_prompt_tokens: int = 256,
            batch_size: int = 16, temperature: float = 0.0, limit: int = 0, seed: int = 0, progress: bool = True) -> dict:
    """Answer the first user turn of `conversations` with the target; append JSONL records to `out`.

    Each record: {"id", "messages": prompt + [{"role": "assistant", "content": answer}], "finish": "eos" |
    "length", "new_tokens"}. Returns counts. `limit` caps the conversations answered in all (0 = all).
    """
    for name, value, low in (("max_new_tokens", max_new_tokens, 1), ("max_prompt_tokens", max_prompt_tokens, 1),
                             ("batch_size", batch_size, 1), ("limit", limit, 0)):
        if not isinstance(value, int) or value < low:
            raise DistillError(f"{name} must be an integer >= {low}, got {value!r}")
    if not temperature >= 0:
        raise DistillError(f"temperature must be >= 0, got {temperature!r}")
    if getattr(tok, "chat_template", None) is None:
        raise DistillError("the target's tokenizer has no chat template: there is no prompt format to answer in")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = answered_ids(path)
    items = first_turns(conversations)
    if limit:
        items = items[:limit]
    todo = [it for it in items if it[0] not in done]
    batches, skipped = _batches(todo, tok, batch_size, max_prompt_tokens)
    counts = {"out": str(path), "already": len(items) - len(todo), "answered": 0, "skipped_long_prompt": skipped,
              "new_tokens": 0, "eos": 0, "length": 0}
    bar = tqdm(total=sum(len(b) for b in batches), desc="distill", unit="answer", disable=not progress)
    t0 = time.perf_counter()
    with open(path, "a", encoding="utf-8") as f:
        for batch in batches:
            # Sampling seed from the batch's first id, not from how many batches ran before this one.
            batch_seed = seed * 1_000_003 + zlib.crc32(batch[0][0].encode("utf-8"))
            answers = _answer_batch(model, tok, batch, max_new_tokens, temperature, batch_seed)
            lines = []
            for (conv_id, msgs, _), (text, n, finish) in zip(batch, answers):
                record = {"id": conv_id, "messages": msgs + [{"role": "assistant", "content": text}],
                          "finish": finish, "new_tokens": n}
                lines.append(json.dumps(record, ensure_ascii=False) + "\n")
                counts["new_tokens"] += n
                counts[finish] += 1
            f.write("".join(lines))  # whole records only; flushed per batch so an interruption loses one batch
            f.flush()
            os.fsync(f.fileno())
            counts["answered"] += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{counts['new_tokens'] / max(time.perf_counter() - t0, 1e-9):.0f}")
    bar.close()
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    return counts

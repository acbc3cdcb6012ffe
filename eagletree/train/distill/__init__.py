"""Self-distillation data: the target's own answers to the training prompts.

A head drafts for the target's text, not for the dataset's: ShareGPT's answers come from much
larger models, so a head trained on them learns contexts the target never writes. `eagletree
distill` answers the first user turn of each training conversation (or, with `--turns`, the later
ones, after the conversation so far) with the target (greedy by default) and appends one JSONL
record per answer; train on the file with `dataset=PATH`.

Only the training side of the held-out split is read, so evaluation prompts stay unseen. Three parts:
- `selection`: which prompts are answered (`distill_prompts`: a dataset's training split, or HumanEval problems),
  in which batches;
- `records`: the append-only, resumable output file, a record file (`eagletree.records`: a header line with the
  settings, locked while written; a rerun skips the ids already answered, and a line cut off by an interruption
  is removed before anything is appended);
- one answerer per engine, each only turning prompts into answers: HF `generate` on left-padded batches
  (`answer_hf`, decoder "hf"); greedy, eagletree's own batched speculative decoding with a head
  (`answer_decoder`, decoder "eagletree"): lossless, so the same records either way; vLLM's offline `LLM`
  (`answer_vllm` over `vllm_engine.VllmEngine`, an optional dependency, decoder "vllm") in chunks of
  `batch_size`, vLLM batching each chunk itself: its greedy fp32 answers are HF's too.
"""

from .options import DECODERS, DistillError, DistillOptions, check_match, default_batch_size, default_decoder
from .records import answered_ids, ids_in
from .run import distill
from .selection import distill_prompts, first_turns, user_turns

__all__ = [
    "DECODERS",
    "DistillError",
    "DistillOptions",
    "answered_ids",
    "check_match",
    "default_batch_size",
    "default_decoder",
    "distill",
    "distill_prompts",
    "first_turns",
    "ids_in",
    "user_turns",
]

"""`distill`: select the prompts, open the record store, and let the decoder's answerer fill it."""

from __future__ import annotations

import os

from .answer_decoder import DecoderAnswerer
from .answer_hf import HfAnswerer
from .answer_vllm import VllmAnswerer
from .answers import Answerer
from .options import DistillError, DistillOptions
from .records import DistillStore, record_settings
from .selection import select


def distill(
    model,
    tok,
    conversations,
    out: str | os.PathLike,
    options: DistillOptions | None = None,
    *,
    head=None,
    engine=None,
    **settings,
) -> dict:
    """Answer the user turns of `conversations` that `options.turns` picks ("first", "later" or "all": see
    `user_turns`) with the target; append JSONL records to `out`. `options` (else built from `settings`, the
    `DistillOptions` fields as keywords) says which prompts and how.

    Each record: {"id", "messages": prompt + [{"role": "assistant", "content": answer}], "finish": "eos" |
    "length", "new_tokens", "settings"}; a later turn's prompt holds the dataset's earlier answers with
    "weight": 0 (context: training learns the target's own answer only). `out` is a record file (`eagletree.records`:
    a header line first, locked while written) of answers made one way (target, precision, temperature,
    max_new_tokens, seed): resuming with other settings is an error, a file not distill's is refused untouched. `limit`
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
    if options is None:
        options = DistillOptions(**settings)
    elif settings:
        raise DistillError(f"pass the settings in options or as keywords, not both; got options and {sorted(settings)}")
    _check_tokenizer(tok)
    answerer = make_answerer(model, tok, options, head, engine)
    with DistillStore(out, record_settings(model, options), options.skip_answered) as store:  # locked till the end
        selection = select(conversations, tok, options)  # every prompt picked, answered or not: a resumed run's batches
        todo = selection.todo(store.left_out)
        counts = store.new_counts(selection)
        prompts = [p for batch in todo for p in batch.prompts]
        counts.update(answerer.prepare(prompts))
        with store.writing(counts, len(prompts), options.progress) as writer:
            for answered in answerer.answer(todo):
                writer.write(answered)
    return counts


def make_answerer(model, tok, options: DistillOptions, head=None, engine=None) -> Answerer:
    """The answerer of `options.decoder`: HF generate, eagletree's decoder (with `head`), or vLLM (`engine`)."""
    if options.decoder == "vllm":
        if engine is None:
            raise DistillError("decoder='vllm' needs engine=, a VllmEngine (eagletree.train.vllm_engine), got None")
        return VllmAnswerer(model, tok, options, engine)
    if options.decoder == "eagletree":
        return DecoderAnswerer(model, tok, options, head)
    return HfAnswerer(model, tok, options)


def _check_tokenizer(tok) -> None:
    """DistillError for a tokenizer without a chat template: there is no prompt format to answer in."""
    if getattr(tok, "chat_template", None) is None:
        raise DistillError(
            f"the tokenizer {getattr(tok, 'name_or_path', '')!r} has no chat template: there is no "
            "prompt format to answer in"
        )

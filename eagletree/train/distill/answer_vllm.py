"""decoder="vllm": the prompts' token ids handed to a `vllm_engine.VllmEngine` in chunks, vLLM batching each."""

from __future__ import annotations

import time
import zlib

from .answers import answer_of, check_prompts_fit, stops_of
from .options import DistillOptions
from .records import Answer
from .selection import Batch, Prompt


class VllmAnswerer:
    """Answers `batch_size` prompts per engine call, each call's answers a group (an interruption loses at most the
    chunk being answered). A sampled prompt draws with a seed of its own, the same however the prompts are chunked,
    so a resumed run writes a straight run's answers."""

    def __init__(self, model, tok, options: DistillOptions, engine):
        self.model, self.tok, self.options, self.engine = model, tok, options, engine

    def prepare(self, prompts: list[Prompt]) -> dict:
        """Start the engine, only when there is something to answer; its start's seconds (engine_start_seconds)."""
        if not prompts:
            return {}
        t0 = time.perf_counter()
        max_new_tokens = self.options.max_new_tokens
        check_prompts_fit(self.model, prompts, max_new_tokens, sliding=False)
        self.stops = stops_of(self.model, self.tok)
        self.engine.start(
            max_model_len=max(len(p.ids) for p in prompts) + max_new_tokens, max_seqs=self.options.batch_size
        )
        return {"engine_start_seconds": round(time.perf_counter() - t0, 1)}

    def answer(self, todo: list[Batch]):
        """One group per engine call of `batch_size` prompts."""
        o = self.options
        prompts = [p for batch in todo for p in batch.prompts]
        for start in range(0, len(prompts), o.batch_size):
            part = prompts[start : start + o.batch_size]
            seeds = [o.seed * 1_000_003 + zlib.crc32(p.id.encode("utf-8")) for p in part]
            answers = self.engine.generate([p.ids for p in part], o.max_new_tokens, o.temperature, seeds, self.stops)
            yield [(p, _engine_answer(self.tok, ids, finish, self.stops)) for p, (ids, finish) in zip(part, answers)]


def _engine_answer(tok, token_ids: list[int], finish: str, stops) -> Answer:
    """An engine's answer, cut before its first stop token as HF's are; an answer the engine ended at a stop token
    it left out of `token_ids` finished with "eos" too."""
    answer = answer_of(tok, token_ids, stops)
    return answer._replace(finish="eos") if finish == "stop" else answer

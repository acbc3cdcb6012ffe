"""decoder="eagletree": greedy answers from eagletree's own lossless batched decoding, with a head or plain."""

from __future__ import annotations

import warnings

from ...decode import Decoder
from ...decode.config import DecodeConfig
from .answers import answer_of, check_prompts_fit, stops_of
from .options import DistillOptions
from .selection import Batch, Prompt


class DecoderAnswerer:
    """`Decoder.results` over the prompts in their order, `batch_size` sequences per target pass, a finished one's
    place taken by the next prompt; each answer is a group of its own, written as it finishes."""

    def __init__(self, model, tok, options: DistillOptions, head=None):
        self.model, self.tok, self.options, self.head = model, tok, options, head

    def prepare(self, prompts: list[Prompt]) -> dict:
        """Refuse a prompt the decoder cannot answer, before anything is written; build the decoder."""
        check_prompts_fit(self.model, prompts, self.options.max_new_tokens)
        self.stops = stops_of(self.model, self.tok)
        self.decoder = Decoder(
            self.model, self.tok, self.head, DecodeConfig(max_new_tokens=self.options.max_new_tokens)
        )
        return {}

    def answer(self, todo: list[Batch]):
        """One group per answer. An answer that ended with an error (it reached a sliding-window target's window)
        is None: not the target's answer, so not written, warned about by its id (a rerun decodes it again)."""
        prompts = [p for batch in todo for p in batch.prompts]
        for i, result in self.decoder.results([p.ids for p in prompts], self.options.batch_size):
            if result.error is not None:
                warnings.warn(f"{prompts[i].id}: not written: {result.error} (--engine hf answers it)", stacklevel=2)
                yield [(prompts[i], None)]
                continue
            yield [(prompts[i], answer_of(self.tok, result.token_ids, self.stops))]

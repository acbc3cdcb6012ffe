"""decoder="hf": HF `generate` on left-padded batches of similar length, greedy or sampled."""

from __future__ import annotations

import zlib

import torch

from ...decode import hf_generation_config
from .answers import answer_of, stops_of
from .options import DistillOptions
from .selection import Batch, Prompt


class HfAnswerer:
    """Answers batch by batch; a sampled batch draws with a seed of its own, fixed whether the run resumed or not."""

    def __init__(self, model, tok, options: DistillOptions):
        self.model, self.tok, self.options = model, tok, options

    def prepare(self, prompts: list[Prompt]) -> dict:
        """Nothing to start: the model is loaded."""
        return {}

    def answer(self, todo: list[Batch]):
        """One group per batch: a batch is written whole, so after an interruption between batches the rest
        matches a straight run exactly; a batch cut short by a kill mid-write (or batches regrouped by a newer
        version) answers its missing prompts in a smaller batch."""
        o = self.options
        for batch in todo:
            seed = o.seed * 1_000_003 + zlib.crc32(batch.key.encode("utf-8"))
            answers = _answer_batch(self.model, self.tok, batch.prompts, o.max_new_tokens, o.temperature, seed)
            yield list(zip(batch.prompts, answers))


@torch.inference_mode()
def _answer_batch(model, tok, batch: list[Prompt], max_new_tokens: int, temperature: float, seed: int):
    """Left-padded greedy (or sampled) generation of one batch; an `Answer` per prompt.

    Greedy means the argmax of the model's own logits, as in speculative decoding: the model's
    generation_config (repetition penalty and the like) is not applied.
    """
    device = next(model.parameters()).device
    stops = stops_of(model, tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else stops[0]
    width = max(len(p.ids) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p.ids) :] = torch.tensor(p.ids)
        attn[i, width - len(p.ids) :] = 1
    # Every logits-shaping value set explicitly: generate() fills the unset ones from the model's generation_config.
    config = hf_generation_config(max_new_tokens, temperature, stops, pad_token_id=pad)
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), generation_config=config)
    return [answer_of(tok, row, stops) for row in out[:, width:].cpu().tolist()]

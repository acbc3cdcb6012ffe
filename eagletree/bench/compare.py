"""`eagletree generate --compare-plain`: one speculative answer's like-for-like speedups against plain decoding
of the same prompt with the same settings."""

from __future__ import annotations

from contextlib import nullcontext

from ..packing import is_packed, kernels_used, stock_kernels
from .runners import run_hf

SPEEDUP_BASES = {"end to end": "tokens_per_s", "after the first pass": "decode_rate"}


def _plain(model, tok, messages, config, stock: bool = False) -> dict:
    """Plain HF decoding of the same prompt with the same sampling settings (`config`, a DecodeConfig) and stop
    tokens, timed: with the kernels the speculative run used, or (`stock`) PyTorch's stock kernels, i.e. HF
    `generate` as users run it."""
    sampling = config.sampling
    with stock_kernels(model) if stock else nullcontext():
        run = run_hf(
            model,
            tok,
            messages,
            config.max_new_tokens,
            sampling.temperature,
            sampling.seed,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
        )
    return {
        "new_tokens": len(run.token_ids),
        "seconds": run.seconds,
        "tokens_per_s": len(run.token_ids) / run.seconds,
        "token_ids": run.token_ids,
        "decode_rate": run.decode_rate,
    }


def compare_plain(result: dict, model, tok, messages, config) -> dict:
    """Like-for-like speedups of the speculative `result` (decoded with `config`, a DecodeConfig): vs plain decoding
    with the same kernels (`speedup`) and vs stock HF `generate` (`speedup_vs_hf`; the same run when the target runs
    stock kernels), and the kernels' own gain.

    Greedy, the runs emit the same tokens and are compared end to end (the prompt's prefill included). Sampled,
    each draws its own answer, whose length sets the prefill's share of its time: the rates after each run's first
    pass are compared instead (as `bench` does), when every run has tokens after it. `speedup_basis` says which.
    """
    plain = _plain(model, tok, messages, config)
    hf = _plain(model, tok, messages, config, stock=True) if is_packed(model) else plain
    temperature = config.sampling.temperature
    basis = "end to end"
    if temperature and all(r["decode_rate"] == r["decode_rate"] for r in (result, plain, hf)):  # (NaN: none)
        basis = "after the first pass"
    rate = SPEEDUP_BASES[basis]
    result.update(
        kernels=kernels_used(model),
        plain_tokens_per_s=round(plain[rate], 2),
        speedup=round(result[rate] / plain[rate], 3),
        hf_tokens_per_s=round(hf[rate], 2),
        speedup_vs_hf=round(result[rate] / hf[rate], 3),
        kernels_gain=round(plain[rate] / hf[rate], 3),
        speedup_basis=basis,
    )
    if basis != "end to end":
        result["decode_tokens_per_s"] = round(result[rate], 2)
    if not temperature:
        result["identical_to_plain"] = plain["token_ids"] == result["token_ids"] == hf["token_ids"]
    return result

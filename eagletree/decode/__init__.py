"""Speculative decoding: draft a tree with the head, verify it in one target pass, accept, commit.

The modules, in the order decoding meets them:
- config: `DecodeConfig` (tree, budget, depth, `Sampling`, `CopyOptions`), validated once;
- resources: what a Decoder resolves once (the device's latency profile, the head's companion files);
- prompts: prompts checked and encoded, fitted to the context and window, and the stop tokens;
- stats: what decoding reports (`Step`, `GenerationStats`, `GenerationResult`);
- sequence: one sequence's state (its row, the drafter's backlog, its copy index);
- rows: the batch's rows (the target's ragged KV cache and the batch drafter's);
- schedule: batch policy (which prompts join, which sequences the head drafts for);
- step: one decoding step for every live sequence, as named stages (budget, catch up, search, verify, book);
- decoder: the `Decoder`, its decoding loop over a batch of sequences (continuous batching);
- text: answers as text, whole or streamed;
- api: the one-call forms `generate` and `decode_steps`.

Names load on first use (from their modules below), so that importing `config` (the command line's parsing) does
not import torch.
"""

_HOMES = {
    "CPU_BUDGET": "config",
    "GPU_BUDGET": "config",
    "MIN_TEMPERATURE": "config",
    "TREE_KINDS": "config",
    "CopyOptions": "config",
    "DecodeConfig": "config",
    "OptionError": "config",
    "Sampling": "config",
    "TreeKind": "config",
    "check_options": "config",
    "hf_generation_config": "config",
    "head_calibrator": "resources",
    "head_copy_calibration": "resources",
    "latency_profile": "resources",
    "resolve_store": "resources",
    "check_messages": "prompts",
    "check_token_ids": "prompts",
    "check_utf8": "prompts",
    "encode_prompt": "prompts",
    "is_token_ids": "prompts",
    "prompt_list": "prompts",
    "stop_token_ids": "prompts",
    "GenerationResult": "stats",
    "GenerationStats": "stats",
    "Step": "stats",
    "whole_answers": "stats",
    "head_features": "sequence",
    "end_progress": "schedule",
    "late_sequences": "schedule",
    "Decoder": "decoder",
    "decode_text": "text",
    "stream_text": "text",
    "decode_steps": "api",
    "generate": "api",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'eagletree.decode' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{_HOMES[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))

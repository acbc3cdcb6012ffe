"""Verify engine: draft trees, tree-attention masks, one-pass verification, lossless acceptance."""

from .accept import accept_greedy, accept_sampling, accept_tree, target_probs, warp_logits
from .engine import StepResult, causal_mask, commit, emitted_tokens, prefill, verify_step, verify_tree
from .tree import DraftTree, TreeError

__all__ = [
    "DraftTree",
    "TreeError",
    "accept_tree",
    "accept_greedy",
    "accept_sampling",
    "target_probs",
    "warp_logits",
    "StepResult",
    "causal_mask",
    "commit",
    "emitted_tokens",
    "prefill",
    "verify_step",
    "verify_tree",
]

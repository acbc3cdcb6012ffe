"""A draft head's decoder layer as a handful of tensor operations: the drafter's fast path.

A drafting level runs the head's one decoder layer over a few dozen rows at most, so on a CPU the framework's
per-call work (module dispatch, mask and rotary construction, cache bookkeeping) costs more than the
arithmetic. `LeanLayer` (target/lean.py; the target's passes use it too) computes the same layer from the same
weights with the projections fused (q, k and v in one product; gate and up in another), rotary embeddings read
from a table, keys and values written by position into the drafter's `RaggedCache`, and attention in fp32 over
short query blocks (a bf16 product of a shape not seen before builds a oneDNN kernel first, and the context grows
every step): SDPA's fused kernel for one sequence's block, two batched products and a softmax for several.

It covers the LLaMA family's layer (attention with q/k/v/o projections, optional per-head q/k norms, a
gated MLP, a post-attention norm, residual adds). `lean_layer(head)` builds one and checks it against the
head's own forward on a probe; a layer it does not reproduce there (another architecture) keeps the
transformers path.
"""

from __future__ import annotations

import torch

from ..target.lean import SHORT_BLOCK, TOLERANCE, LeanLayer, LeanUnsupported
from ..target.ragged import Layout, RaggedCache, causal_block, plan, ragged_pass

__all__ = ["SHORT_BLOCK", "LeanLayer", "LeanUnsupported", "lean_forward", "lean_layer"]


def lean_forward(head, lean: LeanLayer, embed, cache: RaggedCache, layout: Layout, feats, tokens, positions):
    """The head's next features [R, H] for packed rows (feats [R, H] as `head.forward` reads them, tokens [R],
    positions [R]) through `lean`, writing the rows' keys and values into `cache` at the layout's positions."""
    attn_in, residual = head.layer_inputs(feats, tokens, embed)
    with ragged_pass(cache, layout):
        return lean(attn_in, residual, positions, cache, layout)


@torch.inference_mode()
def lean_layer(head, embed, choice=None) -> LeanLayer | None:
    """The lean form of `head`'s layer, or None when its architecture is not covered or the lean output differs
    from the head's own forward on a probe (5 positions with a cache, 3 more with a tree mask) by more than the
    precision's tolerance."""
    try:
        lean = LeanLayer(head.layer, head.rotary, choice)
    except LeanUnsupported:
        return None
    param = next(head.parameters())
    generator = torch.Generator().manual_seed(0)
    feats = torch.randn(8, head.config.hidden_size, generator=generator).to(param)
    tokens = torch.randint(0, embed.num_embeddings, (8,), generator=generator).to(param.device)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 0, its children 1 and 2
    allowed = torch.cat([torch.ones(3, 5, dtype=torch.bool), tree], dim=1).to(param.device)
    hf_cache = head.new_cache()
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6], device=param.device)
    expected = torch.cat(
        [
            head(feats[None, :5], tokens[None, :5], positions[:5], embed, cache=hf_cache)[0],
            head(feats[None, 5:], tokens[None, 5:], positions[5:], embed, allowed=allowed, cache=hf_cache)[0],
        ]
    )
    cache = RaggedCache(capacity=16)
    cache.add_row()
    got = []
    for part, block in ((slice(0, 5), causal_block(5)), (slice(5, 8), tree)):
        layout = plan(cache.lengths, [0], [block], param.device)
        got.append(lean_forward(head, lean, embed, cache, layout, feats[part], tokens[part], positions[part]))
    error = (torch.cat(got).float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-6)
    return lean if float(error) <= TOLERANCE.get(param.dtype, 3e-2) else None

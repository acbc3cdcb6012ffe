"""The block head's lean call (draft/lean_block.py): the same drafts as the head's own modules, packed or not."""

from __future__ import annotations

import pytest
import torch

from eagletree.draft.block_drafter import BlockDrafter
from eagletree.draft.lean_block import HeadBlock, LeanBlock, lean_block
from eagletree.packing import is_packed, pack_linears, packing_problem

from helpers import small_block_head, tiny_model


def drive(drafter: BlockDrafter, seed: int = 0) -> list[torch.Tensor]:
    """Three rows caught up on contexts of different lengths in one call, then two of them again: every row's
    drafted levels [k-1, V'] after each call."""
    g = torch.Generator().manual_seed(seed)
    width = drafter.head.feature_spec.width
    rows = [drafter.add_row() for _ in range(3)]
    out = []
    for call_rows, lengths in ((rows, [5, 11, 1]), (rows[::2], [2, 3])):
        feats = [torch.randn(m, width, generator=g) for m in lengths]
        drafter.extend(call_rows, feats, [torch.randint(97, (m,), generator=g) for m in lengths])
        out.extend(drafter.level_probs[r] for r in call_rows)
    return out


def test_the_lean_call_drafts_what_the_head_s_own_modules_draft():
    model = tiny_model("llama")
    head = small_block_head(model, block_size=4)
    lean, own = BlockDrafter(head, model), BlockDrafter(head, model, lean=False)
    assert isinstance(lean.block, LeanBlock) and isinstance(own.block, HeadBlock)
    for a, b in zip(drive(lean), drive(own)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_packed_target_makes_the_lean_call_packed_with_the_same_drafts():
    model = tiny_model("llama")
    head = small_block_head(model, block_size=4)
    want = drive(BlockDrafter(head, model, lean=False))
    pack_linears(model)
    drafter = BlockDrafter(head, model)
    assert is_packed(head) and drafter.lm_packed is not None
    assert isinstance(drafter.block, LeanBlock) and drafter.block.layers[0].qkv.packed is not None
    for a, b in zip(drive(drafter), want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(packing_problem(torch.nn.Linear(2, 2).bfloat16()) is not None, reason="no native bf16 here")
def test_in_bf16_the_lean_call_drafts_the_same_top_tokens():
    """bf16 drafts are not bit-exact either way (the lean call attends in fp32): the distributions stay close and
    the top token is the same wherever the head's own top two are not a near tie."""
    model = tiny_model("llama")
    head = small_block_head(model, torch.bfloat16, block_size=4)
    want = drive(BlockDrafter(head, model, lean=False))
    pack_linears(model)
    drafter = BlockDrafter(head, model)
    assert isinstance(drafter.block, LeanBlock)
    for a, b in zip(drive(drafter), want):
        assert (a - b).abs().max() < 0.05
        top2 = b.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 0.05
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_a_head_the_lean_call_does_not_reproduce_keeps_its_own_modules():
    model = tiny_model("llama")
    head = small_block_head(model, block_size=4)
    layer = head.layers[1]
    own_forward = layer.forward
    layer.forward = lambda x, *args: own_forward(x, *args) + 1.0  # a layer the lean call does not compute
    assert lean_block(head, model.get_input_embeddings(), pack=False) is None
    drafter = BlockDrafter(head, model)
    assert isinstance(drafter.block, HeadBlock)
    for a, b in zip(drive(drafter), drive(BlockDrafter(head, model, lean=False))):
        assert torch.equal(a, b)

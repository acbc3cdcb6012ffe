"""The drafter's lean layer (draft/lean.py): the head's decoder layer as fused tensor operations.

It must draft what the transformers layer drafts (same distributions within float rounding, in fp32 and with
packed kernels; the same top tokens in bf16), on every layout a batch makes (rows of different sizes, padding,
a prompt's long block), and step aside for a layer it does not reproduce.
"""

import pytest
import torch

from eagletree.draft import Eagle3Head, EagleHead
from eagletree.draft.batch_drafter import RaggedTreeDrafter
from eagletree.draft.lean import SHORT_BLOCK, LeanLayer, LeanUnsupported, lean_layer
from eagletree.packing import pack_linears, packing_problem

from helpers import tiny_config, tiny_model


def qwen3_model():
    """A tiny Qwen3: per-head q/k norms in its attention."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    common = tiny_config("llama").to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    config = Qwen3Config(**{k: common[k] for k in keep}, num_key_value_heads=2, head_dim=16, initializer_range=0.2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def model_for(arch: str):
    return qwen3_model() if arch == "qwen3" else tiny_model(arch)


def head_for(kind: str, model, dtype=torch.float32):
    """A random head with halved Linears (a random head at the target's init scale saturates its softmax)."""
    torch.manual_seed(0)
    head = Eagle3Head.for_target(model) if kind == "eagle3" else EagleHead.for_target(model.config)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data.mul_(0.5)
    return head.eval().to(dtype)


def drive(drafter: RaggedTreeDrafter, width: int, seed: int = 0) -> list[torch.Tensor]:
    """The same calls on any drafter: three rows caught up on prompts of different lengths (one longer than a
    short block), two draft levels with frontiers of different sizes (padding), a catch-up, a level. Returns
    every distribution it drafted."""
    g = torch.Generator().manual_seed(seed)
    dtype = drafter.dtype
    out = []
    for _ in range(3):
        drafter.add_row()

    def extend(rows, lengths):
        feats = [torch.randn(m, width, generator=g).to(dtype) for m in lengths]
        drafter.extend(rows, feats, [torch.randint(97, (m,), generator=g) for m in lengths])
        out.extend(drafter.rows[r].root_probs for r in rows)

    def level(requests):
        out.extend(drafter.expand(requests))

    extend([0, 1, 2], [5, SHORT_BLOCK + 9, 1])
    level([(r, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), 1) for r in range(3)])
    # level 2: row 0 expands two nodes, row 2 three, row 1 one (the block is padded to three)
    level(
        [
            (0, torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([0, 0]), 2),
            (1, torch.tensor([1]), torch.tensor([5]), torch.tensor([0]), 2),
            (2, torch.tensor([1, 2, 3]), torch.tensor([6, 7, 8]), torch.tensor([0, 0, 0]), 2),
        ]
    )
    level(
        [
            (0, torch.tensor([3, 4]), torch.tensor([9, 10]), torch.tensor([1, 2]), 3),
            (2, torch.tensor([4]), torch.tensor([11]), torch.tensor([3]), 3),
        ]
    )
    extend([0, 2], [2, 3])  # drops the trees, commits more
    level([(0, torch.tensor([1, 2]), torch.tensor([12, 13]), torch.tensor([0, 0]), 2)])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_lean_layer_drafts_what_the_transformers_layer_drafts(arch, kind):
    model = model_for(arch)
    head = head_for(kind, model)
    width = (3 if kind == "eagle3" else 1) * model.config.hidden_size
    lean, stock = RaggedTreeDrafter(head, model), RaggedTreeDrafter(head, model, lean=False)
    assert lean.lean is not None and stock.lean is None
    got, want = drive(lean, width), drive(stock, width)
    assert len(got) == len(want) == 14
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.skipif(packing_problem(torch.nn.Linear(2, 2)) is not None, reason="this PyTorch has no oneDNN")
def test_packed_lean_projections_give_the_same_drafts():
    model = tiny_model("llama")
    head = head_for("eagle", model)
    want = drive(RaggedTreeDrafter(head, model, lean=False), model.config.hidden_size)
    pack_linears(head)
    lean = lean_layer(head, model.get_input_embeddings())
    assert lean is not None and lean.qkv.packed is not None
    got = drive(RaggedTreeDrafter(head, model), model.config.hidden_size)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)


def test_in_bf16_the_lean_layer_drafts_the_same_top_tokens():
    """bf16 drafts are not bit-exact either way (the lean layer attends in fp32): the distributions stay close and
    the top token is the same wherever the transformers layer's top two are not a near tie."""
    model = tiny_model("llama")
    head = head_for("eagle", model, torch.bfloat16)
    lean, stock = RaggedTreeDrafter(head, model), RaggedTreeDrafter(head, model, lean=False)
    assert lean.lean is not None
    got, want = drive(lean, model.config.hidden_size), drive(stock, model.config.hidden_size)
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 0.05
        top2 = b.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 0.05
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_a_layer_the_lean_form_does_not_reproduce_keeps_the_transformers_path():
    model = tiny_model("llama")
    head = head_for("eagle", model)
    embed = model.get_input_embeddings()
    mlp = head.layer.mlp
    mlp.forward = lambda x: mlp.down_proj(mlp.act_fn(mlp.up_proj(x)) * mlp.gate_proj(x))  # gate and up swapped
    assert lean_layer(head, embed) is None
    drafter = RaggedTreeDrafter(head, model)
    assert drafter.lean is None
    want = drive(RaggedTreeDrafter(head, model, lean=False), model.config.hidden_size)
    for a, b in zip(drive(drafter, model.config.hidden_size), want):
        assert torch.equal(a, b)
    del mlp.forward
    del head.layer.mlp.gate_proj  # a layer without the projections it fuses
    with pytest.raises(LeanUnsupported, match="gate_proj"):
        LeanLayer(head.layer, head.rotary)
    assert lean_layer(head, embed) is None


def test_rotary_embeddings_that_rescale_with_the_context_are_left_to_transformers():
    model = tiny_model("llama")
    head = head_for("eagle", model)
    head.rotary.rope_type = "dynamic"
    with pytest.raises(LeanUnsupported, match="dynamic"):
        LeanLayer(head.layer, head.rotary)

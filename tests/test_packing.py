import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagletree.decode import generate
from eagletree.draft import EagleHead
from eagletree.packing import (
    PackedLinear,
    PackingError,
    is_packed,
    pack_linears,
    pack_target,
    packing_problem,
    stock_kernels,
    unpack_linears,
)

from helpers import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


def close(a, b, tol=1e-5):
    return float((a - b).abs().max() / b.abs().max()) <= tol


def test_packed_linear_matches_the_stock_kernel_and_keeps_the_parameters():
    torch.manual_seed(0)
    for bias in (True, False):
        lin = nn.Linear(48, 80, bias=bias)
        packed = PackedLinear(lin)
        assert packed.weight is lin.weight and packed.bias is lin.bias
        assert packed.state_dict().keys() == lin.state_dict().keys()
        with torch.no_grad():
            for shape in ((1, 48), (7, 48), (2, 9, 48), (1, 300, 48)):
                x = torch.randn(shape)
                assert close(packed(x), F.linear(x, lin.weight, lin.bias)), shape
                # Non-contiguous input (a transposed view) gives the same numbers.
                xt = torch.randn(48, shape[-2]).T
                assert close(packed(xt), F.linear(xt, lin.weight, lin.bias))


def test_stock_kernels_grads_and_in_place_updates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    assert pack_linears(model) == 2 and is_packed(model)
    x = torch.randn(5, 16)
    with torch.no_grad():
        fast = model(x)
        with stock_kernels(model):
            stock = model(x)
            assert torch.equal(
                stock, F.linear(F.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias)
            )
        assert all(m.enabled for m in model if isinstance(m, PackedLinear))
    assert close(fast, stock)
    with pytest.raises(RuntimeError), stock_kernels(model):
        assert not is_packed(model)  # e.g. a latency profile measured here is the stock kernels'
        raise RuntimeError("the kernels come back even after an error")
    assert all(m.enabled for m in model if isinstance(m, PackedLinear)) and is_packed(model)
    # Training through a packed model takes the stock kernel, so gradients flow.
    model(x).sum().backward()
    assert model[0].weight.grad is not None
    # A weight changed in place is repacked before its next use.
    with torch.no_grad():
        model[2].weight.mul_(2.0)
        assert close(model(x) - model[2].bias, 2 * (stock - model[2].bias))
        doubled = model(x)
        # Under autocast the stock kernel runs (autocast decides the dtype); other dtypes too.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x).dtype == torch.bfloat16
        model.double()
        assert model(x.double()).dtype == torch.float64 and close(model(x.double()).float(), doubled)
        model.float()  # new storage: repacked
        assert close(model(x), doubled)


def test_what_cannot_be_packed_is_named():
    half = nn.Linear(4, 4).half()
    assert "float16" in packing_problem(half)
    with pytest.raises(PackingError, match=r"cannot pack Linear: packing supports .* the model is torch.float16"):
        pack_linears(half)
    # The CLI's --pack: auto leaves what cannot be packed alone, on insists, anything else is refused.
    model = nn.Sequential(nn.Linear(4, 4).half())
    assert pack_target(model, "auto") == 0 and pack_target(model, "off") == 0
    with pytest.raises(PackingError, match="float16"):
        pack_target(model, "on")
    with pytest.raises(ValueError, match="pack must be 'auto', 'on' or 'off', got 'yes'"):
        pack_target(model, "yes")
    hooked = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    hooked[0].register_forward_hook(lambda *a: None)
    assert pack_target(hooked, "on") == 1 and type(hooked[0]) is nn.Linear  # a replacement would drop the hook


def test_packed_model_outputs_and_lossless_generation():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(97, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g) for _ in range(4)]
    with torch.no_grad():
        reference = [
            model.generate(
                p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long), max_new_tokens=40, do_sample=False
            )[0, p.numel() :].tolist()
            for p in prompts
        ]
        logits = model(prompts[0][None]).logits
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    n = pack_linears(model)
    assert n == sum(isinstance(m, PackedLinear) for m in model.modules()) and n > 0
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    with torch.no_grad():
        assert close(model(prompts[0][None]).logits, logits)
    for tree in ("eagle2", "sequoia"):
        for p, want in zip(prompts, reference):
            assert (
                generate(model, tok, head, p, max_new_tokens=40, tree=tree, budget=12, depth=4, top_k_draft=3).token_ids
                == want
            )
    assert is_packed(head)  # a packed target's drafter packs the head (and its lm_head slice) too
    # Inside inference mode (inference tensors have no version counter), with a draft-vocabulary head.
    small = EagleHead.for_target(model.config, torch.arange(50)).eval()
    with torch.inference_mode():
        assert (
            generate(
                model, tok, small, prompts[0], max_new_tokens=40, tree="eagle2", budget=12, depth=4, top_k_draft=3
            ).token_ids
            == reference[0]
        )
    weights = [p for p in model.parameters()]
    assert unpack_linears(model) == n and not is_packed(model)
    assert [p for p in model.parameters()] == weights and all(type(m) is not PackedLinear for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(prompts[0][None]).logits, logits)

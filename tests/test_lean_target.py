"""The target's lean passes (target/lean.py): a ragged pass through `LeanModel` instead of the transformers model.

A pass must give the logits, features and layer outputs the model's own ragged forward gives (float rounding
apart) on every layout decoding makes (prompts longer than a short block, trees of different sizes in one pass,
padding, one-token rows, after a commit that moved entries), with stock and packed kernels; decoding through it
stays identical to HF `generate`; and a model it does not reproduce keeps the transformers path.
"""

import pytest
import torch
from test_batch import Setup, config, flat_profile
from test_lean import qwen3_model

from eagletree import Decoder
from eagletree.packing import pack_linears, packing_problem, stock_kernels
from eagletree.target import lean as lean_module
from eagletree.target.attention import RAGGED
from eagletree.target.lean import SHORT_BLOCK, FusedPacked, LeanModel, LeanUnsupported, lean_model
from eagletree.target.ragged import RaggedCache, causal_block, ragged_forward, use_ragged

from helpers import tiny_model

TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


def model_for(arch: str):
    model = qwen3_model() if arch == "qwen3" else tiny_model(arch)
    use_ragged(model)
    return model


def passes(model, lean) -> list:
    """The same passes through `lean` (None: the transformers path): three prompts (one longer than a short
    block), a pass of a 4-node tree, a one-token row and a 2-token chain (padded), a commit of each row's accepted
    nodes, then one token per row. Returns every output tensor."""
    g = torch.Generator().manual_seed(1)
    vocab = model.get_output_embeddings().out_features
    layers = list(range(model.config.num_hidden_layers))
    cache = RaggedCache(capacity=8)  # (grown by the passes)
    for _ in range(3):
        cache.add_row()
    out = []

    def run(rows, sizes, blocks, starts):
        tokens = [torch.randint(vocab, (n,), generator=g) for n in sizes]
        depths = [b.sum(-1) - 1 for b in blocks]
        positions = [s + d for s, d in zip(starts, depths)]
        result = ragged_forward(model, cache, rows, tokens, blocks, positions, layers, lean=lean)
        out.extend([result.logits, result.hidden, *result.layer_hidden.values()])

    lengths = [5, SHORT_BLOCK + 9, 2]
    run([0, 1, 2], lengths, [causal_block(n) for n in lengths], [0, 0, 0])
    run([0, 1, 2], [4, 1, 2], [TREE, causal_block(1), causal_block(2)], lengths)
    cache.commit([0, 1, 2], lengths, [[0, 1, 3], [0], [0]])
    starts = list(cache.lengths)
    run([0, 1, 2], [1, 1, 1], [causal_block(1)] * 3, starts)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_a_lean_pass_gives_what_the_models_own_ragged_forward_gives(arch):
    """(Mistral's sliding window: a ragged pass refuses a context past it before either path runs.)"""
    model = model_for(arch)
    lean = lean_model(model)
    assert isinstance(lean, LeanModel)
    got, want = passes(model, lean), passes(model, None)
    assert len(got) == len(want) == 3 * (2 + model.config.num_hidden_layers)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


def test_a_model_not_yet_switched_to_ragged_attention_is_switched_and_checked():
    """(`plan` asks for the profile's name, which says whether passes go the lean way, before any pass.)"""
    model = tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"
    assert isinstance(lean_model(model), LeanModel)
    assert model.config._attn_implementation == RAGGED


PACKS = pytest.mark.skipif(packing_problem(torch.nn.Linear(2, 2)) is not None, reason="this PyTorch has no oneDNN")


@PACKS
def test_packing_after_the_lean_model_was_built_rebuilds_it_on_the_packed_kernels():
    model = model_for("llama")
    stock = lean_model(model)
    pack_linears(model)
    packed = lean_model(model)
    assert packed is not None and packed is not stock
    for a, b in zip(passes(model, packed), passes(model, None)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    with stock_kernels(model):  # the lean path calls the Linears' own forwards, so it follows them
        for a, b in zip(passes(model, packed), passes(model, None)):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@PACKS
def test_a_packed_target_runs_q_k_v_and_gate_up_as_one_packed_product_each(monkeypatch):
    """(Qwen2: q/k/v with biases, fused with them.) Inside `stock_kernels` the fused products give way to the
    Linears' own stock forwards, as the Linears do."""
    model = model_for("qwen2")
    pack_linears(model)
    lean = lean_model(model)
    for layer in lean.layers:
        assert isinstance(layer.qkv, FusedPacked) and len(layer.qkv.linears) == 3 and layer.qkv.bias is not None
        assert isinstance(layer.gate_up, FusedPacked) and len(layer.gate_up.linears) == 2
    used = []
    packed_linear = lean_module.packed_linear
    monkeypatch.setattr(lean_module, "packed_linear", lambda x, w, b: used.append(w) or packed_linear(x, w, b))
    for a, b in zip(passes(model, lean), passes(model, None)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    fused = {id(p.packed) for layer in lean.layers for p in (layer.qkv, layer.gate_up)}
    assert fused <= {id(w) for w in used}
    used.clear()
    with stock_kernels(model):
        for a, b in zip(passes(model, lean), passes(model, None)):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    assert not used


@PACKS
@pytest.mark.parametrize("change", ["in place", "replaced"])
def test_fused_products_are_packed_again_when_the_targets_weights_change(change):
    """Decoding, then the same new up/gate weights in the target and in HF's copy: the next answers are HF's with
    the new weights (the fused copies are packed again at the next prefill), not the old weights'."""
    lm = Setup()
    pack_linears(lm.model)
    decoder = Decoder(lm.model, lm.tok, lm.head, config("eagle2"), profile=flat_profile())
    before = [r.token_ids for r in decoder.generate_batch(lm.prompts, batch_size=4)]
    g = torch.Generator().manual_seed(5)
    new = [torch.randn(m.weight.shape, generator=g) for m in (lm.model.model.layers[0].mlp.up_proj,)]
    for model in (lm.model, lm.reference):
        up = model.model.layers[0].mlp.up_proj
        with torch.no_grad():
            if change == "in place":
                up.weight.copy_(new[0])
            else:
                up.weight = torch.nn.Parameter(new[0].clone())
    after = [r.token_ids for r in decoder.generate_batch(lm.prompts, batch_size=4)]
    assert after != before
    for prompt, result in zip(lm.prompts, after):
        assert result == lm.hf(prompt, 40, decoder.stops)


def test_a_model_the_lean_path_does_not_reproduce_keeps_the_transformers_path():
    model = model_for("llama")
    mlp = model.model.layers[1].mlp
    mlp.forward = lambda x: mlp.down_proj(mlp.act_fn(mlp.up_proj(x)) * mlp.gate_proj(x))  # gate and up swapped
    assert lean_model(model) is None
    bf16 = model_for("llama").to(torch.bfloat16)  # (bf16 targets: the transformers path, as measured so far)
    assert lean_model(bf16) is None
    del model.model.layers[0].mlp.gate_proj
    with pytest.raises(LeanUnsupported, match="gate_proj"):
        LeanModel(model)


def test_a_gemma_target_whose_embeddings_are_scaled_keeps_the_transformers_path():
    from transformers import AutoModelForCausalLM, GemmaConfig

    config = GemmaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    use_ragged(model)
    assert lean_model(model) is None


def test_norms_run_fused_only_where_that_is_the_modules_own_output_bit_for_bit():
    """lean_norm: a LLaMA RMSNorm becomes F.rms_norm (equal bit for bit on other inputs too); a norm computing
    something else (Gemma's 1 + weight) keeps its module's forward."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from eagletree.target.lean import lean_norm

    llama, gemma = LlamaRMSNorm(48, eps=1e-5), GemmaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        for norm in (llama, gemma):
            norm.weight.copy_(torch.randn(48))
    fused = lean_norm(llama)
    assert fused.__name__ == "fused"
    x = torch.randn(7, 48) * 5
    with torch.inference_mode():
        assert torch.equal(fused(x), llama(x))
    assert lean_norm(gemma) == gemma.forward


def test_rotary_embeddings_and_silu_are_transformers_own_bit_for_bit():
    """The lean layer's rope (x rolled by half, times a signed sin table) equals transformers' rotate_half form
    exactly, at positions past the table's first size too; lean_act takes F.silu only for a SiLU."""
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    layer = lean_module.LeanLayer(model.model.layers[0], model.model.rotary_emb)
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 255, 256, 700])
    heads = attn.q_proj.out_features // layer.dim
    q, k = torch.randn(2, 5, heads, layer.dim, generator=g)
    cos, sin = model.model.rotary_emb(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    with torch.inference_mode():
        rope = layer._rotary(positions)
        assert torch.equal(layer._rope(q, *rope), want_q[0].transpose(0, 1))
        assert torch.equal(layer._rope(k, *rope), want_k[0].transpose(0, 1))
    assert lean_module.lean_act(ACT2FN["silu"]) is torch.nn.functional.silu
    gelu = ACT2FN["gelu"]
    assert lean_module.lean_act(gelu) is gelu


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=PACKS)])
@pytest.mark.parametrize("tree", ["eagle2", "chain"])
def test_decoding_through_lean_passes_equals_hf_generate(tree, packed):
    lm = Setup()  # (HF's answers come from an untouched copy of the target)
    if packed:
        pack_linears(lm.model)  # (q/k/v and gate/up as fused packed products)
    decoder = Decoder(lm.model, lm.tok, lm.head, config(tree), profile=flat_profile())
    results = decoder.generate_batch(lm.prompts, batch_size=4)
    assert isinstance(lm.model.__dict__["_eagletree_lean"][1], LeanModel)  # the passes went the lean way
    assert sum(r.stats.passes for r in results) < sum(r.stats.new_tokens for r in results)  # trees were accepted
    for prompt, result in zip(lm.prompts, results):
        assert result.token_ids == lm.hf(prompt, 40, decoder.stops)

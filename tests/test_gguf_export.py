"""`export --format gguf`: block heads as llama.cpp's `dflash` GGUF file, its metadata, tensors and tokenizer, read
back by import; compared with llama.cpp's own converter under `pytest --llamacpp`."""

import gguf
import numpy as np
import pytest
import torch

from eagletree.draft import DFlashHead, HeadError
from eagletree.export.convert import export_head, import_folder, recognize_folder
from eagletree.export.gguf import gguf_key
from eagletree.export.gguf_file import FILE

from helpers import mark_gguf_source, tiny_config, tiny_tokenizer_gguf


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Llama target (4 layers) that reads as de-quantized from a GGUF file holding its tokenizer."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 4
    folder = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    mark_gguf_source(folder, tiny_tokenizer_gguf(folder.parent / "tokenizer.gguf", cfg.vocab_size))
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def block_head(model, draft_vocab=True) -> DFlashHead:
    torch.manual_seed(2)
    head = DFlashHead.for_target(model, torch.arange(5, 97, 2) if draft_vocab else None, block_size=4).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # (norm weights start at 1: make every tensor distinct)
    return head


def read(path):
    reader = gguf.GGUFReader(str(path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    return meta, {t.name: t for t in reader.tensors}


def test_the_gguf_file_is_llama_cpps_dflash_layout_with_the_targets_tokenizer(tmp_path, target):
    head = block_head(target)
    out = export_head(head, tmp_path / "gguf", "gguf", dtype=torch.float32, target=target)
    meta, tensors = read(out / FILE)
    assert meta["general.architecture"] == "dflash" and meta["dflash.block_size"] == 4
    assert meta["dflash.block_count"] == len(head.layers) and meta["dflash.embedding_length"] == 64
    assert meta["dflash.target_layers"] == [i + 1 for i in head.target_layers]  # inputs of decoder layers
    assert meta["tokenizer.ggml.mask_token_id"] == head.mask_token_id
    assert meta["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(97)] and meta["tokenizer.ggml.model"] == "gpt2"
    expected = {gguf_key(k) for k in head.state_dict() if k != "d2t"} | {"output.weight", "d2t"}
    assert set(tensors) == expected
    for key, value in head.state_dict().items():
        if key == "d2t":
            continue
        t = tensors[gguf_key(key)]
        assert list(reversed([int(n) for n in t.shape])) == list(value.shape), key  # GGUF lists dims fastest first
        assert np.array_equal(np.asarray(t.data).reshape(value.shape), value.numpy()), key
    lm = target.get_output_embeddings().weight.detach()
    assert np.array_equal(np.asarray(tensors["output.weight"].data).reshape(-1, 64), lm[head.d2t].numpy())
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert np.asarray(tensors["d2t"].data).tolist() == head.d2t.tolist()  # target ids, as llama.cpp reads them
    back = import_folder(out, target.config)
    assert recognize_folder(out).format == "gguf" and torch.equal(back.d2t, head.d2t)
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


@pytest.mark.parametrize(("dtype", "kind"), [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_matrices_take_the_export_dtype_and_norms_stay_f32(tmp_path, target, dtype, kind):
    head = block_head(target, draft_vocab=False)
    out = export_head(head, tmp_path / kind, "gguf", dtype=dtype, target=target)
    _, tensors = read(out / FILE)
    assert "d2t" not in tensors and "output.weight" not in tensors  # the target's own output, in llama.cpp
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == kind
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    back = import_folder(out, target.config)
    for key, value in head.state_dict().items():
        expected = value if value.dim() == 1 or not value.is_floating_point() else value.to(dtype).to(value.dtype)
        assert torch.equal(back.state_dict()[key].to(value.dtype), expected), key


def test_a_target_not_loaded_from_a_gguf_file_is_refused_in_one_line(tmp_path):
    model = _four_layers()  # made in memory: no GGUF file behind it
    with pytest.raises(HeadError) as refused:
        export_head(block_head(model), tmp_path / "out", "gguf", dtype=torch.float32, target=model)
    message = str(refused.value)
    assert "\n" not in message and "GGUF file" in message and "convert_hf_to_gguf.py" in message
    assert not (tmp_path / "out").exists()


def _four_layers():
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 4
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_an_eagle3_head_is_llama_cpps_eagle3_layout_with_q_and_k_permuted_for_its_rope(tmp_path, target):
    from eagletree.draft import Eagle3Head
    from eagletree.export.gguf import rope_permute

    torch.manual_seed(3)
    head = Eagle3Head.for_target(target, torch.arange(3, 97, 3)).eval()
    out = export_head(head, tmp_path / "e3", "gguf", dtype=torch.float32, target=target)
    meta, tensors = read(out / FILE)
    assert meta["general.architecture"] == "eagle3" and meta["eagle3.vocab_size"] == 97
    assert meta["eagle3.target_layers"] == [i + 1 for i in head.feature_spec.layers]
    assert meta["eagle3.norm_before_residual"] is False and meta["eagle3.target_hidden_size"] == 64
    q = head.state_dict()["layer.self_attn.q_proj.weight"]
    stored = torch.from_numpy(np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(q.shape).copy())
    assert torch.equal(stored, rope_permute(q, 4)) and not torch.equal(stored, q)
    assert torch.equal(rope_permute(rope_permute(q, 4), 4, inverse=True), q)
    assert np.asarray(tensors["d2t"].data).tolist() == head.d2t.tolist()
    back = import_folder(out, target)
    assert recognize_folder(out).heads == ("eagle3",)
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_an_overwrite_across_gguf_and_other_formats_keeps_nothing_of_the_earlier_export(tmp_path, target):
    """gguf over a speculators/dflash export (config.json, weights, token map) keeps only model.gguf of the two;
    a dflash export over the gguf one drops model.gguf; a file that is no export's stays throughout."""
    head = block_head(target)
    out = tmp_path / "both"
    export_head(head, out, "dflash", dtype=torch.float32, target=target)
    (out / "NOTES.md").write_text("mine")
    assert {"config.json", "model.safetensors", "token_map.pt"} <= {p.name for p in out.iterdir()}
    export_head(head, out, "gguf", dtype=torch.float32, target=target, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.md", FILE]
    assert recognize_folder(out).format == "gguf"
    export_head(head, out, "dflash", dtype=torch.float32, target=target, overwrite=True)
    assert FILE not in {p.name for p in out.iterdir()} and (out / "NOTES.md").read_text() == "mine"
    assert recognize_folder(out).format == "dflash"

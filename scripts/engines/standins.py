"""Stand-ins for the GPU, distributed and kernel layers an engine's draft model is built from: their parameters
as the engine registers them at tensor-parallel size 1, their weight loaders, no kernels."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn


class NoWeights(nn.Module):
    """A layer without parameters (attention kernel, activation, logits processor): built, never run."""

    def __init__(self, *args, **kwargs):
        super().__init__()


class StandInLinear(nn.Module):
    """A parallel linear layer as SGLang registers it at tensor-parallel size 1: weight [sum(outputs), input],
    optional bias; its weight_loader copies a checkpoint tensor into the rows of shard `loaded_shard_id` (q/k/v by
    name, merged parts by index) or, without a shard, into the whole parameter, and fails on a shape mismatch, as
    SGLang's layers do."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, shard_names=None):
        super().__init__()
        self.input_size, self.output_sizes, self.shard_names = input_size, list(output_sizes), shard_names
        self.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(output_sizes)), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded_weight, loaded_shard_id=None):
        shard, target = loaded_shard_id, param.data
        if shard is not None:
            index = self.shard_names.index(shard) if isinstance(shard, str) else int(shard)
            target = target.narrow(0, sum(self.output_sizes[:index]), self.output_sizes[index])
        if tuple(target.shape) != tuple(loaded_weight.shape):
            where = f"shard {shard!r} of shape" if shard is not None else "parameter of shape"
            raise AssertionError(f"tensor of shape {tuple(loaded_weight.shape)} into {where} {tuple(target.shape)}")
        target.copy_(loaded_weight)


class QKVParallelLinear(StandInLinear):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads=None, bias=True, *args, **kwargs):
        kv = total_num_kv_heads or total_num_heads
        super().__init__(
            hidden_size, [total_num_heads * head_size, kv * head_size, kv * head_size], bias, ["q", "k", "v"]
        )


class MergedColumnParallelLinear(StandInLinear):
    def __init__(self, input_size, output_sizes, bias=True, *args, **kwargs):
        super().__init__(input_size, output_sizes, bias)


class RowParallelLinear(StandInLinear):
    def __init__(self, input_size, output_size, bias=True, *args, **kwargs):
        super().__init__(input_size, [output_size], bias)


class RMSNorm(nn.Module):
    """RMSNorm's one parameter, `weight` [hidden]."""

    def __init__(self, hidden_size, eps=1e-6, *args, **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def fuse_input_quant(self, *args, **kwargs):  # SGLang: fuses activation quantization; none here
        pass


class VocabParallelEmbedding(nn.Module):
    """Embedding / lm_head weight [vocab, hidden] at tensor-parallel size 1, without SGLang's padding of the
    vocabulary to a multiple of 64 (its weight_loader checks the unpadded size, as this one does)."""

    def __init__(self, num_embeddings, embedding_dim, *args, **kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight):
        if tuple(param.shape) != tuple(loaded_weight.shape):
            raise AssertionError(
                f"tensor of shape {tuple(loaded_weight.shape)} into parameter of shape {tuple(param.shape)}"
            )
        param.data.copy_(loaded_weight)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class RopeRecorder:
    """get_rope: returns a parameter-free module and records the RoPE base each layer asked for."""

    def __init__(self):
        self.bases: list[float] = []

    def __call__(self, *args, **kwargs):
        base = kwargs.get("base")  # llama.py / llama_eagle3.py: get_rope(..., base=rope_theta, ...)
        self.bases.append(float(base) if base is not None else math.nan)
        return NoWeights()


def not_exercised(what: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"{what} is a stand-in that these exports must not reach")

    return fail


PP_GROUP = SimpleNamespace(world_size=1, is_first_rank=True, is_last_rank=True, rank_in_group=0)


LINEARS = {
    "QKVParallelLinear": QKVParallelLinear,
    "MergedColumnParallelLinear": MergedColumnParallelLinear,
    "RowParallelLinear": RowParallelLinear,
}

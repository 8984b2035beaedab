"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Every parameter carries the metadata that the rest of the system needs:

- ``tp_dim`` / ``tp_sections``: how the canonical tensor is split over TP ranks (None: replicated);
- ``full_shape``: the canonical shape, and ``init_method(tensor, generator)``: its initialiser;
- ``allreduce_over_tp``: the gradient is partial on each TP rank and must be summed over TP
  (sequence-parallel norms and biases, KV projections replicated because there are fewer KV heads
  than TP ranks).

Initialisation builds the canonical tensor from a generator seeded by the parameter's global name and
takes this rank's shard, so every TP/PP layout starts from identical weights.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel_state as ps
from . import mappings
from .utils import divide, shard_tensor

InitMethod = Callable[[torch.Tensor, torch.Generator], None]


def normal_init(std: float) -> InitMethod:
    def init(t: torch.Tensor, gen: torch.Generator) -> None:
        t.normal_(0.0, std, generator=gen)

    return init


def zeros_init(t: torch.Tensor, gen: torch.Generator) -> None:
    t.zero_()


def ones_init(t: torch.Tensor, gen: torch.Generator) -> None:
    t.fill_(1.0)


def set_param_meta(param: nn.Parameter, *, full_shape, init_method: InitMethod, tp_dim: int | None = None,
                   tp_sections: list[int] | None = None, allreduce_over_tp: bool = False) -> nn.Parameter:
    param.full_shape = tuple(full_shape)
    param.init_method = init_method
    param.tp_dim = tp_dim
    param.tp_sections = tp_sections
    param.allreduce_over_tp = allreduce_over_tp
    return param


def initialize_parameters(module: nn.Module, seed: int) -> None:
    """Initialise every parameter from its canonical tensor (layout-invariant, see module docstring)."""
    tp_rank, tp_world = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    seen = set()
    for name, param in module.named_parameters():
        if id(param) in seen or not hasattr(param, "init_method"):
            continue
        seen.add(id(param))
        init_name = getattr(param, "init_name", name)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(init_name.encode())) % 2**63)
        full = torch.empty(param.full_shape, dtype=torch.float32)
        param.init_method(full, gen)
        if param.tp_dim is not None and tp_world > 1:
            full = shard_tensor(full, param.tp_dim, tp_rank, tp_world, param.tp_sections)
        with torch.no_grad():
            param.copy_(full.to(param.dtype))


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output dimension over TP.

    ``sections`` lists the sizes of independently split blocks of the output (fused projections).
    ``replicated=True`` keeps the full weight on every rank (grads summed over TP); ``select`` then
    picks this rank's output columns (used for KV heads when there are fewer KV heads than TP ranks).
    """

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, gather_output: bool = False,
                 init_method: InitMethod, sections: list[int] | None = None, sequence_parallel: bool = False,
                 replicated: bool = False) -> None:
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp > 1
        self.replicated = replicated
        local_out = output_size if replicated else divide(output_size, tp, "output size")
        self.weight = set_param_meta(nn.Parameter(torch.empty(local_out, input_size)),
                                     full_shape=(output_size, input_size), init_method=init_method,
                                     tp_dim=None if replicated else 0,
                                     tp_sections=sections, allreduce_over_tp=replicated and tp > 1)
        if bias:
            self.bias = set_param_meta(nn.Parameter(torch.empty(local_out)), full_shape=(output_size,),
                                       init_method=zeros_init, tp_dim=None if replicated else 0,
                                       tp_sections=sections, allreduce_over_tp=replicated and tp > 1)
        else:
            self.register_parameter("bias", None)
        self.gemm_quantizer: nn.Module | None = None  # set by quantization-aware training

    def forward(self, x: torch.Tensor, predicted_input_rms: torch.Tensor | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x)
        else:
            x = mappings.copy_to_tensor_model_parallel_region(x)
        if self.gemm_quantizer is None:
            y = F.linear(x, self.weight, self.bias)
        else:  # quantization-aware training: quantize both GEMM inputs (see core.quantization)
            y = self.gemm_quantizer.linear(x, self.weight, self.bias, predicted_input_rms=predicted_input_rms)
        if self.gather_output:
            y = mappings.gather_from_tensor_model_parallel_region(y)
        return y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input dimension; the partial outputs are summed over TP
    (reduce-scattered along the sequence under sequence parallelism). The bias is added after."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, init_method: InitMethod,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        self.sequence_parallel = sequence_parallel and tp > 1
        local_in = divide(input_size, tp, "input size")
        self.weight = set_param_meta(nn.Parameter(torch.empty(output_size, local_in)),
                                     full_shape=(output_size, input_size), init_method=init_method, tp_dim=1)
        if bias:
            self.bias = set_param_meta(nn.Parameter(torch.empty(output_size)), full_shape=(output_size,),
                                       init_method=zeros_init, allreduce_over_tp=self.sequence_parallel)
        else:
            self.register_parameter("bias", None)
        self.gemm_quantizer: nn.Module | None = None

    def forward(self, x: torch.Tensor, predicted_input_rms: torch.Tensor | None = None) -> torch.Tensor:
        if self.gemm_quantizer is None:
            y = F.linear(x, self.weight)
        else:
            y = self.gemm_quantizer.linear(x, self.weight, None, predicted_input_rms=predicted_input_rms)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y)
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank looks up its rows, the sum is all-reduced
    (or reduce-scattered along the sequence under sequence parallelism)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: InitMethod,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        self.sequence_parallel = sequence_parallel and tp > 1
        self.num_local = divide(num_embeddings, tp, "padded vocabulary size")
        self.vocab_start = ps.get_tensor_model_parallel_rank() * self.num_local
        self.weight = set_param_meta(nn.Parameter(torch.empty(self.num_local, embedding_dim)),
                                     full_shape=(num_embeddings, embedding_dim), init_method=init_method, tp_dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ps.get_tensor_model_parallel_world_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(out)
        return mappings.reduce_from_tensor_model_parallel_region(out)

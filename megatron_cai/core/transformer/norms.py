"""LayerNorm and RMSNorm with tensor-parallel metadata (grads summed over TP under sequence parallel)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.layers import ones_init, set_param_meta, zeros_init


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_param_meta(nn.Parameter(torch.ones(hidden_size)), full_shape=(hidden_size,),
                                     init_method=ones_init, allreduce_over_tp=sequence_parallel)
        self.bias = set_param_meta(nn.Parameter(torch.zeros(hidden_size)), full_shape=(hidden_size,),
                                   init_method=zeros_init, allreduce_over_tp=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_param_meta(nn.Parameter(torch.ones(hidden_size)), full_shape=(hidden_size,),
                                     init_method=ones_init, allreduce_over_tp=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


def build_norm(kind: str, hidden_size: int, eps: float, sequence_parallel: bool) -> nn.Module:
    cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[kind]
    return cls(hidden_size, eps, sequence_parallel)

"""LayerNorm and RMSNorm with tensor-parallel metadata (grads summed over TP under sequence parallel)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.layers import ones_init, set_param_meta, zeros_init


class LayerNorm(nn.Module):
    """LayerNorm; ``zero_centered``: the weight is stored as (gamma - 1), initialised to 0 (--apply-layernorm-1p)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        init = torch.zeros(hidden_size) if zero_centered else torch.ones(hidden_size)
        self.weight = set_param_meta(nn.Parameter(init), full_shape=(hidden_size,),
                                     init_method=zeros_init if zero_centered else ones_init,
                                     allreduce_over_tp=sequence_parallel)
        self.bias = set_param_meta(nn.Parameter(torch.zeros(hidden_size)), full_shape=(hidden_size,),
                                   init_method=zeros_init, allreduce_over_tp=sequence_parallel)

    @property
    def gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.bias, self.eps)


class RMSNorm(LayerNorm):
    """RMSNorm (no bias); ``zero_centered`` as for LayerNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 zero_centered: bool = False) -> None:
        super().__init__(hidden_size, eps, sequence_parallel, zero_centered)
        del self.bias
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], self.gamma, self.eps)


def build_norm(kind: str, hidden_size: int, eps: float, sequence_parallel: bool,
               zero_centered: bool = False) -> nn.Module:
    """``sequence_parallel`` marks the weights' gradients for a sum over TP ranks."""
    cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[kind]
    return cls(hidden_size, eps, sequence_parallel, zero_centered)

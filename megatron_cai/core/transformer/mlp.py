"""The feed-forward block: fc1 (column parallel) -> activation -> fc2 (row parallel).

Activations: ``relu2`` (squared ReLU, Character.ai's choice and the default), ``swiglu`` (fc1 holds the
gate and up projections as two sections), ``gelu`` (tanh approximation, as GPT-2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.layers import ColumnParallelLinear, InitMethod, RowParallelLinear


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str, bias: bool,
                 init_method: InitMethod, output_init_method: InitMethod, sequence_parallel: bool) -> None:
        super().__init__()
        self.activation = activation
        gated = activation == "swiglu"
        fc1_out = 2 * ffn_hidden_size if gated else ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(hidden_size, fc1_out, bias=bias, init_method=init_method,
                                               sections=[ffn_hidden_size] * 2 if gated else None,
                                               sequence_parallel=sequence_parallel)
        self.linear_fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias=bias,
                                            init_method=output_init_method, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.activation == "relu2":
            h = relu2(h)
        else:
            h = F.gelu(h, approximate="tanh")
        return self.linear_fc2(h)

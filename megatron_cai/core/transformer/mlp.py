"""The feed-forward block: fc1 (column parallel) -> activation -> fc2 (row parallel).

Activations: ``gelu_erf`` (GeLU, Megatron-LM's default MLP), ``gelu_tanh`` (its tanh approximation, as GPT-2
and Megatron-LM's fused bias-GeLU kernel), ``relu2`` (squared ReLU, Character.ai's choice) and ``swiglu`` (fc1
holds the gate and up projections as two sections).

Quantization-aware training with ``--qat-clamp weight-rms``: ``forward(x, input_rms)`` takes the lazy
prediction of RMS(x) (from the preceding norm's weights) for fc1, and hands fc2 the prediction of its
input derived from fc1's weights and the activation (``dynamic_clamp.FFNHiddenRMS``: closed form for
relu2, Gaussian integrals computed numerically for the GeLUs and swiglu). Other clamp rules ignore both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quantization.dynamic_clamp import FFNHiddenRMS
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

    def forward(self, x: torch.Tensor, input_rms=None, visibility=None) -> torch.Tensor:
        """``visibility`` is the MLP slot's (an MoE layer's documents); a dense MLP is per token and ignores it."""
        h = self.linear_fc1(x, predicted_input_rms=input_rms)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.activation == "relu2":
            h = relu2(h)
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        hidden_rms = None if input_rms is None else FFNHiddenRMS(self.linear_fc1, self.activation, input_rms)
        return self.linear_fc2(h, predicted_input_rms=hidden_rms)

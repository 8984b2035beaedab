"""Shared experts: a feed-forward block every token passes through beside its routed experts (DeepSeek,
Qwen-MoE), of width ``--moe-shared-expert-intermediate-size``, optionally scaled by a sigmoid gate
``sigmoid(x . gate_weight)`` per token (``--moe-shared-expert-gate``), as megatron-core's SharedExpertMLP.
Its linears are the dense MLP's (tensor parallel over the TP group, sequence parallel with SP)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...tensor_parallel.layers import InitMethod, set_param_meta
from ..mlp import MLP


class SharedExperts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, gate: bool,
                 init_method: InitMethod, output_init_method: InitMethod, sequence_parallel: bool) -> None:
        super().__init__()
        self.mlp = MLP(hidden_size, intermediate_size, activation, False, init_method, output_init_method,
                       sequence_parallel)
        self.gate_weight = (set_param_meta(nn.Parameter(torch.empty(1, hidden_size)), full_shape=(1, hidden_size),
                                           init_method=init_method, allreduce_over_tp=sequence_parallel)
                            if gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out

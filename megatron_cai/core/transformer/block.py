"""Pre-norm transformer layers, and the block that holds one pipeline stage's layers.

Layers live in a ModuleDict keyed by their *global* layer number, so parameter names
(``decoder.layers.7.mlp.linear_fc1.weight``) are the same under every pipeline layout.

Each layer hands its attention and MLP a lazy prediction of their input's RMS from the norm that
produced it (``NormOutputRMS``); only quantizers with ``--qat-clamp weight-rms`` ever evaluate it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..quantization.dynamic_clamp import NormOutputRMS
from ..tensor_parallel.layers import normal_init
from ..tensor_parallel.random import get_rng_tracker
from .lse_stats import LseStatsCollector
from .mlp import MLP
from .norms import build_norm
from .self_attention import KVCache, SelfAttention


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number: int, lse_stats: LseStatsCollector | None = None) -> None:
        super().__init__()
        self.config = config
        init = normal_init(config.init_method_std)
        out_init = normal_init(config.init_method_std / math.sqrt(2.0 * config.num_layers))
        sp = config.sequence_parallel
        eps = config.layernorm_epsilon
        self.input_layernorm = build_norm(config.normalization, config.hidden_size, eps, sp)
        self.self_attention = SelfAttention(config, layer_number, init, out_init, lse_stats)
        self.pre_mlp_layernorm = build_norm(config.normalization, config.hidden_size, eps, sp)
        self.mlp = MLP(config.hidden_size, config.ffn_hidden_size, config.activation, config.add_bias_linear,
                       init, out_init, sp)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout if self.training else 0.0
        if not p:
            return x
        if self.config.sequence_parallel:  # the sequence is split over TP: draw a per-rank mask
            with get_rng_tracker().fork():
                return F.dropout(x, p, True)
        return F.dropout(x, p, True)

    def forward(self, x: torch.Tensor, rotary, visibility=None, position_ids=None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), rotary, visibility, position_ids,
                                                  kv_cache, input_rms=NormOutputRMS(self.input_layernorm)))
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x), input_rms=NormOutputRMS(self.pre_mlp_layernorm)))


class TransformerBlock(nn.Module):
    def __init__(self, config, layer_numbers: list[int], post_process: bool,
                 lse_stats: LseStatsCollector | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, i, lse_stats) for i in layer_numbers})
        self.final_layernorm = (build_norm(config.normalization, config.hidden_size, config.layernorm_epsilon,
                                           config.sequence_parallel) if post_process else None)
        self.recompute = config.recompute_granularity == "full"

    def forward(self, x: torch.Tensor, rotary, visibility=None, position_ids=None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        for layer in self.layers.values():
            if self.recompute and self.training and kv_cache is None:
                x = torch.utils.checkpoint.checkpoint(layer, x, rotary, visibility, position_ids,
                                                      use_reentrant=False)
            else:
                x = layer(x, rotary, visibility, position_ids, kv_cache)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x

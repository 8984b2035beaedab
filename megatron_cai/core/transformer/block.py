"""Pre-norm transformer layers, and the block that holds one pipeline stage's layers.

Layers live in a ModuleDict keyed by their *global* layer number, so parameter names
(``decoder.layers.7.mlp.linear_fc1.weight``) are the same under every pipeline layout.

Each layer hands its attention and MLP a lazy prediction of their input's RMS from the norm that
produced it (``NormOutputRMS``); only quantizers with ``--qat-clamp weight-rms`` ever evaluate it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quantization.dynamic_clamp import NormOutputRMS
from ..tensor_parallel.layers import normal_init
from ..tensor_parallel.random import checkpoint, get_rng_tracker
from .layer_pattern import check_stage_kv_sources
from .lse_stats import LseStatsCollector
from .mla import MLASelfAttention
from .mlp import MLP
from .moe.moe_layer import DenseShape, MoELayer
from .norms import build_norm
from .self_attention import KVCache, SelfAttention, SharedKV


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number: int, lse_stats: LseStatsCollector | None = None) -> None:
        super().__init__()
        self.config = config
        hidden_std, out_std = config.mup.init_stds(config.init_method_std, config.num_layers, config.hidden_size)
        init, out_init = normal_init(hidden_std), normal_init(out_std)  # MuP divides both by sqrt(m)
        sp = config.sequence_parallel
        eps, one_p = config.layernorm_epsilon, config.apply_layernorm_1p
        self.input_layernorm = build_norm(config.normalization, config.hidden_size, eps, sp, one_p)
        attention = MLASelfAttention if config.multi_latent_attention else SelfAttention
        self.self_attention = attention(config, layer_number, init, out_init, lse_stats)
        self.pre_mlp_layernorm = build_norm(config.normalization, config.hidden_size, eps, sp, one_p)
        if config.moe is not None and config.moe.is_moe_layer(layer_number + 1):
            self.mlp = MoELayer(config.moe, DenseShape.of(config), layer_number)
        else:
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
                kv_cache: KVCache | None = None, shared_kv: SharedKV | None = None) -> torch.Tensor:
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), rotary, visibility, position_ids,
                                                  kv_cache, input_rms=NormOutputRMS(self.input_layernorm),
                                                  shared_kv=shared_kv))
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x), input_rms=NormOutputRMS(self.pre_mlp_layernorm),
                                          visibility=visibility))


class TransformerBlock(nn.Module):
    def __init__(self, config, layer_numbers: list[int], post_process: bool,
                 lse_stats: LseStatsCollector | None = None) -> None:
        super().__init__()
        check_stage_kv_sources(config, layer_numbers)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, i, lse_stats) for i in layer_numbers})
        self.final_layernorm = (build_norm(config.normalization, config.hidden_size, config.layernorm_epsilon,
                                           config.sequence_parallel, config.apply_layernorm_1p)
                                if post_process else None)
        self.config = config

    def recompute_groups(self) -> list[tuple[list[int], bool]]:
        """This stage's layers (local indices) in checkpoint units: (layers, recomputed), Megatron's rule.

        full/uniform: consecutive groups of --recompute-num-layers, each recomputed as one unit;
        full/block: the first --recompute-num-layers layers recomputed one by one, the rest not."""
        n, cfg = len(self.layers), self.config
        if cfg.recompute_granularity != "full":
            return [([i], False) for i in range(n)]
        k = 1 if cfg.recompute_num_layers is None else cfg.recompute_num_layers
        if cfg.recompute_method == "block":
            return [([i], i < k) for i in range(n)]
        return [(list(range(i, min(i + k, n))), True) for i in range(0, n, k)]

    def forward(self, x: torch.Tensor, rotary, visibility=None, position_ids=None,
                kv_cache: KVCache | None = None) -> torch.Tensor:
        layers = list(self.layers.values())
        shared_kv = SharedKV() if self.config.kv_share_pattern else None  # this forward's source K/V
        new_positions = position_ids
        if kv_cache is not None and position_ids is not None:  # windows measure on every key's position
            position_ids = kv_cache.key_positions(position_ids)

        def run(x, idx):
            for i in idx:
                x = layers[i](x, rotary, visibility, position_ids, kv_cache, shared_kv)
            return x

        for idx, recompute in self.recompute_groups():
            if recompute and self.training and kv_cache is None:
                x = checkpoint(run, x, idx)
            else:
                x = run(x, idx)
        if kv_cache is not None and new_positions is not None:
            kv_cache.append_positions(new_positions)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x

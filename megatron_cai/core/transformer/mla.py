"""Multi-latent attention (DeepSeek's MLA) as megatron-core 0.19.2's ``MLASelfAttention`` computes it (local spec,
``--rope-type rope``), over visibility intervals, with the latent cached in generation.

Per token: queries from ``x`` (``linear_q_proj``, or ``linear_q_down_proj`` -> ``q_layernorm`` ->
``linear_q_up_proj`` with ``--q-lora-rank``); one latent ``c = kv_layernorm(down(x)[:kv_lora_rank])`` and one
positional key part ``k_pe = rope(down(x)[kv_lora_rank:])`` shared by all heads (``linear_kv_down_proj``); per
head keys ``[k_nope(c), k_pe]`` and values ``v(c)`` from ``linear_kv_up_proj``. RoPE rotates the last
``qk_pos_emb_head_dim`` dims of queries and keys after megatron-core's MLA de-interleaving (even dims, then odd).
The softmax scale is ``mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)`` with YaRN's
``mscale = 0.1 * mscale_all_dim * ln(rotary_scaling_factor) + 1`` (1 for a factor <= 1). ``q_layernorm`` and
``kv_layernorm`` are the model's norm with ``--qk-layernorm``, identities without (as in megatron-core's spec).

A KV cache stores ``(c, k_pe)`` per token (``kv_lora_rank + qk_pos_emb_head_dim`` numbers, whatever the head
count) and the keys and values are expanded from it at every step.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel_state as ps
from ..tensor_parallel.layers import ColumnParallelLinear, InitMethod, RowParallelLinear
from .layer_pattern import layer_window
from .lse_stats import LseStatsCollector
from .norms import build_norm
from .rope import apply_rotary
from .self_attention import CoreAttention, KVCache

__all__ = ["MLASelfAttention", "mla_softmax_mscale"]


def mla_softmax_mscale(rotary_scaling_factor: float, mscale_all_dim: float) -> float:
    """YaRN's attention temperature as megatron-core applies it to MLA's softmax scale (squared there)."""
    if rotary_scaling_factor <= 1:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(rotary_scaling_factor) + 1.0


def _mla_rope(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """megatron-core's MLA RoPE: dims reordered (even, then odd), then rotate-half."""
    return apply_rotary(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), *rotary)


class MLASelfAttention(CoreAttention):
    def __init__(self, config, layer_number: int, init_method: InitMethod, output_init_method: InitMethod,
                 lse_stats: LseStatsCollector | None = None) -> None:
        super().__init__()
        if ps.get_tensor_model_parallel_world_size() != 1:
            raise ValueError("--multi-latent-attention runs with --tensor-model-parallel-size 1 here")
        self.config, self.layer_number = config, layer_number
        self.lse_slot = lse_stats.slot(layer_number) if lse_stats is not None else None
        self.window = layer_window(config, layer_number)
        self.num_heads = config.num_attention_heads
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        heads, hidden = self.num_heads, config.hidden_size
        norm = (lambda n: build_norm(config.normalization, n, config.layernorm_epsilon, False,
                                     config.apply_layernorm_1p)) if config.qk_layernorm else (lambda n: nn.Identity())
        if config.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(hidden, heads * self.q_head_dim, bias=False,
                                                      init_method=init_method)
        else:
            self.linear_q_down_proj = ColumnParallelLinear(hidden, config.q_lora_rank, bias=False,
                                                           init_method=init_method)
            self.q_layernorm = norm(config.q_lora_rank)
            self.linear_q_up_proj = ColumnParallelLinear(config.q_lora_rank, heads * self.q_head_dim, bias=False,
                                                         init_method=init_method)
        self.linear_kv_down_proj = ColumnParallelLinear(hidden, config.kv_lora_rank + config.qk_pos_emb_head_dim,
                                                        bias=False, init_method=init_method)
        self.kv_layernorm = norm(config.kv_lora_rank)
        self.linear_kv_up_proj = ColumnParallelLinear(config.kv_lora_rank,
                                                      heads * (config.qk_head_dim + config.v_head_dim), bias=False,
                                                      init_method=init_method)
        self.linear_proj = RowParallelLinear(heads * config.v_head_dim, hidden, bias=config.add_bias_linear,
                                             init_method=output_init_method)
        self.mscale = mla_softmax_mscale(config.rotary_scaling_factor, config.mscale_all_dim)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                visibility: tuple[torch.Tensor, torch.Tensor] | None = None,
                position_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                input_rms=None, shared_kv=None) -> torch.Tensor:
        cfg = self.config
        b, s, _ = x.shape
        if cfg.q_lora_rank is None:
            q = self.linear_q_proj(x, predicted_input_rms=input_rms)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x, predicted_input_rms=input_rms)))
        q = q.view(b, s, self.num_heads, self.q_head_dim)
        q_nope, q_pe = q.split([cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        latent, k_pe = self.linear_kv_down_proj(x, predicted_input_rms=input_rms).split(
            [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        latent = self.kv_layernorm(latent)
        k_pe = _mla_rope(k_pe.unsqueeze(2), rotary)  # [b, s, 1, rope dim]
        q = torch.cat([q_nope, _mla_rope(q_pe, rotary)], dim=-1).transpose(1, 2)
        if kv_cache is not None:  # the cache holds the latent and the rotated positional key: [b, 1, t, *]
            latent, k_pe = kv_cache.update(self.layer_number, latent.unsqueeze(1), k_pe.transpose(1, 2))
            latent, k_pe = latent.squeeze(1), k_pe.transpose(1, 2)
        t = latent.shape[1]
        kv = self.linear_kv_up_proj(latent).view(b, t, self.num_heads, cfg.qk_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, t, self.num_heads, -1)], dim=-1).transpose(1, 2)
        out = self._attend_padded(q, k, v.transpose(1, 2), visibility, position_ids, kv_cache is None)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * cfg.v_head_dim))

    def _attend_padded(self, q, k, v, visibility, position_ids, recomputable: bool) -> torch.Tensor:
        """The interval backends take one head dim for q, k and v: zero-pad the smaller to ``D`` and fold the
        softmax scale ``mscale^2 / sqrt(q_head_dim)`` into q (the backends divide by ``sqrt(D)``)."""
        dq, dv = q.shape[-1], v.shape[-1]
        width = max(dq, dv)
        factor = self.mscale ** 2 * math.sqrt(width / dq)
        if factor != 1.0:
            q = q * factor
        if dq < width:
            q, k = F.pad(q, (0, width - dq)), F.pad(k, (0, width - dq))
        if dv < width:
            v = F.pad(v, (0, width - dv))
        return self.attend(q, k, v, visibility, position_ids, recomputable)[..., :dv]

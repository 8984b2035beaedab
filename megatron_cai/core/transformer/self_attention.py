"""Multi-head self-attention with GQA/MQA, RoPE and tensor parallelism (heads split over TP ranks).

The core attention goes through ``core.transformer.attention.attend`` (visibility intervals, Z-Reg);
plain causal attention without Z-Reg takes torch's scaled_dot_product_attention fast path. Under context
parallelism the visibility is an ``attention.SplitSequenceAttention`` (the sequence split over CP ranks:
``core.context_parallel.ContextParallelVisibility``), whose ``attend`` runs the cross-rank attention.

Quantization-aware training with ``--qat-clamp weight-rms``: ``input_rms`` (the lazy prediction of the
input's RMS from the preceding norm's weights) goes to linear_q and linear_kv. linear_proj gets no
prediction and falls back to the "rms" rule: its input is an attention-weighted average of V whose RMS
lies anywhere between RMS(V) / sqrt(keys attended) and RMS(V) depending on how peaked the attention is,
which the weights alone cannot tell.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel_state as ps
from ..tensor_parallel.layers import ColumnParallelLinear, InitMethod, RowParallelLinear
from ..tensor_parallel.random import checkpoint, get_rng_tracker
from ..tensor_parallel.utils import divide
from .layer_pattern import kv_source, layer_window
from .lse_stats import LseStatsCollector
from .norms import build_norm
from .rope import apply_rotary


class SharedKV:
    """The K/V of one forward's source layers, by layer number (cross-layer KV sharing). An object, not a dict:
    FSDP2's forward pre-hook rebuilds dict and list arguments (to cast their tensors), so a dict written by one
    wrapped layer would not reach the next."""

    def __init__(self) -> None:
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._kv[layer] = (k, v)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[layer]


class KVCache:
    """Keys/values of already processed tokens for incremental decoding, one entry per layer.

    ``visibility_start``/``visibility_limit`` hold the key-side intervals of the cached tokens (query
    i sees cached key j iff start[j] <= i < limit[j]); plain causal decoding uses limit = a large value.
    """

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.visibility_start: torch.Tensor | None = None
        self.visibility_limit: torch.Tensor | None = None
        self.position_ids: torch.Tensor | None = None  # [batch, cached] logical positions (sliding windows)

    def key_positions(self, new: torch.Tensor) -> torch.Tensor:
        """Positions of every key of a forward: the cached tokens' then ``new`` ([batch, new tokens])."""
        if self.position_ids is None:
            return new
        return torch.cat([self.position_ids.expand(new.shape[0], -1), new], dim=1)

    def layer_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the cached K/V (for counting bytes)."""
        return [t for pair in self.layers.values() for t in pair]

    def expand_rows(self, rows: int) -> None:
        """Make a one-row cache (a prompt run once) the cache of ``rows`` rows that share it (branch decoding);
        the rows are views of the one row until they append."""
        self.layers = {n: (k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for n, (k, v) in self.layers.items()}
        if self.position_ids is not None:
            self.position_ids = self.position_ids.expand(rows, -1)

    def append_positions(self, new: torch.Tensor) -> None:
        """Record the positions of a forward's new tokens (the model does, after its layers ran)."""
        self.position_ids = self.key_positions(new)

    @property
    def length(self) -> int:
        return 0 if self.visibility_start is None else self.visibility_start.shape[1]

    def append_visibility(self, start: torch.Tensor, limit: torch.Tensor) -> None:
        if self.visibility_start is None:
            self.visibility_start, self.visibility_limit = start, limit
        else:
            self.visibility_start = torch.cat([self.visibility_start, start], dim=1)
            self.visibility_limit = torch.cat([self.visibility_limit, limit], dim=1)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.layers:
            pk, pv = self.layers[layer]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        self.layers[layer] = (k, v)
        return k, v


class CoreAttention(nn.Module):
    """Softmax attention over ``[b, heads, s, d]`` queries and keys for an attention layer: the SDPA fast path
    for plain causal attention, else the visibility-interval backends (windows, Z-Reg, context parallelism).
    A subclass sets ``config``, ``window`` (None: global) and ``lse_slot``."""

    config: object
    window: int | None
    lse_slot: object

    def attend(self, q, k, v, visibility, position_ids, recomputable: bool) -> torch.Tensor:
        """The attention output ``[b, heads, s_q, d]``; the core attention is recomputed in backward under
        ``--recompute-granularity selective`` (training, no cache)."""
        if self.config.recompute_granularity == "selective" and self.training and recomputable:
            out, lse = checkpoint(self._core_attention, q, k, v, visibility, position_ids)
        else:
            out, lse = self._core_attention(q, k, v, visibility, position_ids)
        if lse is not None and self.lse_slot is not None:  # outside the recomputed region: recorded once
            self.lse_slot.record(lse)
        return out

    def _core_attention(self, q, k, v, visibility, position_ids) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, lse)``; lse only on the interval path (None on the SDPA fast path)."""
        cfg = self.config
        dropout = cfg.attention_dropout if self.training else 0.0
        # the TP-split stream only where dropout draws from it (a compiled layer traces no RNG-state swap)
        with get_rng_tracker().fork() if dropout else contextlib.nullcontext():
            if visibility is None and not cfg.attention_zreg_coeff and self.window is None:
                # Plain causal attention (or decoding one step past a causal prefix).
                # The mask decided by a branch (Dynamo guards on it where a compiled layer has dynamic lengths):
                # SDPA's is_causal must be a plain bool, never a symbolic comparison of lengths.
                mask = None
                if q.shape[2] != k.shape[2]:
                    offset = k.shape[2] - q.shape[2]
                    mask = (torch.arange(k.shape[2], device=q.device)[None, :]
                            <= torch.arange(q.shape[2], device=q.device)[:, None] + offset)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                      is_causal=mask is None,
                                                      enable_gqa=q.shape[1] != k.shape[1]), None
            return self._interval_attention(q, k, v, visibility, position_ids, dropout)

    def _interval_attention(self, q, k, v, visibility, position_ids, dropout) -> tuple[torch.Tensor, torch.Tensor]:
        from .attention import ALIASES, SplitSequenceAttention, attend, default_backend  # the interval backends

        cfg = self.config
        zreg = cfg.attention_zreg_coeff * cfg.attention_zreg_scale
        if isinstance(visibility, SplitSequenceAttention):  # the sequence is split over CP ranks
            backend = cfg.attention_backend or default_backend(q.device)
            out, lse = visibility.attend(q, k, v, backend=ALIASES.get(backend, backend), zreg_coeff=zreg,
                                         window=self.window, dropout_p=dropout)
            return out, lse
        if visibility is None:
            t = k.shape[2]
            idx = torch.arange(t, device=q.device).expand(q.shape[0], t)
            visibility = (idx, torch.full_like(idx, t))
        start, limit = visibility
        # Attention dropout takes attend's dense-mask path (O(T^2) memory); Z-Reg composes with it.
        window_pos = position_ids if self.window is not None else None  # positions matter only for windows
        out, lse = attend(q, k, v, start, limit, zreg_coeff=zreg, window=self.window,
                          position_ids=window_pos, backend=cfg.attention_backend, return_lse=True,
                          dropout_p=dropout)
        return out, lse


class SelfAttention(CoreAttention):
    def __init__(self, config, layer_number: int, init_method: InitMethod, output_init_method: InitMethod,
                 lse_stats: LseStatsCollector | None = None) -> None:
        super().__init__()
        # where the interval path records [lse mean, max] (None: not recorded)
        self.lse_slot = lse_stats.slot(layer_number) if lse_stats is not None else None
        tp = ps.get_tensor_model_parallel_world_size()
        self.config = config
        self.layer_number = layer_number
        self.head_dim = config.kv_channels
        self.q_scale = config.mup.q_scale(self.head_dim)
        self.num_heads = divide(config.num_attention_heads, tp, "num-attention-heads")
        groups = config.num_query_groups
        self.kv_replicated = groups % tp != 0
        self.num_groups = groups if self.kv_replicated else groups // tp
        if self.kv_replicated:
            # Fewer KV heads than TP ranks: each rank keeps all KV heads and uses the one its heads share.
            ranks_per_group = tp // groups
            self.kv_group_index = ps.get_tensor_model_parallel_rank() // ranks_per_group
        sp = config.sequence_parallel
        q_size, kv_size = config.num_attention_heads * self.head_dim, groups * self.head_dim
        self.linear_q = ColumnParallelLinear(config.hidden_size, q_size, bias=config.qkv_bias,
                                             init_method=init_method, sequence_parallel=sp)
        self.window = layer_window(config, layer_number)  # None: global attention
        self.kv_source = kv_source(config, layer_number)  # this layer's number unless it shares another's K/V
        self.linear_kv = None
        if self.kv_source == layer_number:
            self.linear_kv = ColumnParallelLinear(config.hidden_size, 2 * kv_size, bias=config.qkv_bias,
                                                  init_method=init_method, sections=[kv_size, kv_size],
                                                  sequence_parallel=sp, replicated=self.kv_replicated)
        self.linear_proj = RowParallelLinear(q_size, config.hidden_size, bias=config.add_bias_linear,
                                             init_method=output_init_method, sequence_parallel=sp)
        # --attention-output-gate: one gate per query head and dim (megatron-core's, packed there in linear_qkv
        # after each group's query heads), sharded over TP with the query heads
        self.linear_gate = None
        if config.attention_output_gate:
            self.linear_gate = ColumnParallelLinear(config.hidden_size, q_size, bias=config.qkv_bias,
                                                    init_method=init_method, sequence_parallel=sp)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:  # one norm over head_dim shared by all heads: weights summed over TP ranks
            self.q_layernorm = build_norm(config.normalization, self.head_dim, config.layernorm_epsilon, True,
                                          config.apply_layernorm_1p)
            if self.linear_kv is not None:
                self.k_layernorm = build_norm(config.normalization, self.head_dim, config.layernorm_epsilon, True,
                                              config.apply_layernorm_1p)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                visibility: tuple[torch.Tensor, torch.Tensor] | None = None,
                position_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                input_rms=None, shared_kv: SharedKV | None = None) -> torch.Tensor:
        """``shared_kv``: the K/V of this forward's source layers by layer number (``[b, kv_heads, s, d]``, after
        RoPE and the cache); a source layer adds its own, a sharing layer (``kv_source`` another layer) reads its
        source's instead of computing any."""
        q = self.linear_q(x, predicted_input_rms=input_rms)
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, self.num_heads, self.head_dim)
        if self.q_layernorm is not None:
            q = self.q_layernorm(q)
        if rotary is not None:
            q = apply_rotary(q, *rotary, self.config.rotary_interleaved)
        if self.q_scale != 1.0:  # --use-mup's softmax scale, folded into q (the backends divide by sqrt(d))
            q = q * self.q_scale
        q = q.transpose(1, 2)  # [b, heads, s, d]
        if self.linear_kv is None:
            k, v = shared_kv.get(self.kv_source)
        else:
            k, v = self._own_kv(x, rotary, kv_cache, input_rms)
            if shared_kv is not None:
                shared_kv.put(self.layer_number, k, v)
        out = self.attend(q, k, v, visibility, position_ids, recomputable=kv_cache is None)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        if self.linear_gate is not None:  # megatron-core's _apply_output_gate: the sigmoid in fp32
            gate = self.linear_gate(x, predicted_input_rms=input_rms)
            out = (out * torch.sigmoid(gate.float())).to(out.dtype)
        return self.linear_proj(out)

    def _own_kv(self, x, rotary, kv_cache: KVCache | None, input_rms) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values ``[b, kv_heads, s, d]`` (after RoPE; with a cache, all tokens so far)."""
        kv = self.linear_kv(x, predicted_input_rms=input_rms)
        b, s = kv.shape[0], kv.shape[1]
        k, v = kv.chunk(2, dim=-1)
        k = k.reshape(b, s, self.num_groups, self.head_dim)
        v = v.reshape(b, s, self.num_groups, self.head_dim)
        if self.kv_replicated:
            k = k[:, :, self.kv_group_index:self.kv_group_index + 1]
            v = v[:, :, self.kv_group_index:self.kv_group_index + 1]
        if self.k_layernorm is not None:
            k = self.k_layernorm(k)
        if rotary is not None:
            k = apply_rotary(k, *rotary, self.config.rotary_interleaved)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_number, k, v)
        return k, v

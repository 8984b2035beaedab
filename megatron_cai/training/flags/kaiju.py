"""KV-efficient attention flags (Character.ai's Kaiju recipe): per-layer sliding windows and cross-layer KV sharing.

- ``--window-attn-skip-freq`` (Megatron-LM's): an int N (every N-th layer global, the rest use ``--window-size``)
  or Megatron's list pattern (``"([1]*5+[0])*2"``: 1 = sliding window, 0 = full attention);
- ``--kv-share-pattern`` (ours, in Megatron's style): an int N (consecutive groups of N layers share the first
  one's K/V) or a list pattern giving each layer's K/V source layer (0-based, e.g. ``"[0,0,2,2]"``).

Multi-latent attention with Megatron-LM's flags and defaults (``--multi-latent-attention``, ``--q-lora-rank``,
``--kv-lora-rank``, ``--qk-head-dim``, ``--qk-pos-emb-head-dim``, ``--v-head-dim``, ``--rotary-scaling-factor``,
``--mscale-all-dim``, ``--rope-type``): :mod:`megatron_cai.core.transformer.mla`. YaRN RoPE (megatron-core's
default for MLA) is refused: pass ``--rope-type rope``.

The semantics live in :mod:`megatron_cai.core.transformer.layer_pattern` and ``mla``; this file only adds the
flags and maps them onto :class:`GPTConfig` fields (``model_fields``).
"""
from __future__ import annotations

import argparse
from typing import Any

from ...core.parallel_state import ParallelLayoutError
from ...core.pipeline_parallel.layer_split import stage_layer_numbers
from ...core.transformer.layer_pattern import (
    LayerPatternError,
    check_stage_kv_sources,
    parse_int_or_pattern,
    validate_patterns,
)
from ..config import ArgumentError
from .pipeline_split import pipeline_split, virtual_pipeline_size

__all__ = ["add_arguments", "model_fields"]


def _pattern(text: str) -> int | list[int]:
    try:
        return parse_int_or_pattern(text)
    except LayerPatternError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV-efficient attention (per-layer windows, cross-layer KV sharing)")
    g.add_argument("--window-attn-skip-freq", type=_pattern, default=None,
                   help="which layers skip the sliding window (--window-size), as megatron-core decides: an int N "
                        "makes every N-th layer global (N = 6: five local layers to one global), or a list pattern "
                        "such as '([1]*5+[0])*2' with one entry per layer (1: sliding window, 0: full attention)")
    g.add_argument("--kv-share-pattern", type=_pattern, default=None,
                   help="cross-layer KV sharing: an int N (consecutive groups of N layers use the K/V of the "
                        "group's first layer) or a list pattern naming each layer's K/V source (0-based, an "
                        "earlier layer or itself, e.g. '[0,0,2,2]'); a sharing layer computes only queries")


    m = p.add_argument_group("multi-latent attention (Megatron-LM's flags and defaults)")
    m.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek's MLA: keys and values from a per-token latent (the KV cache holds the latent)")
    m.add_argument("--q-lora-rank", type=int, default=None, help="rank of the query's low-rank projection "
                   "(default: a full query projection)")
    m.add_argument("--kv-lora-rank", type=int, default=32, help="rank of the key/value latent")
    m.add_argument("--qk-head-dim", type=int, default=128, help="query/key head dims without position embedding")
    m.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="query/key head dims RoPE rotates")
    m.add_argument("--v-head-dim", type=int, default=128, help="value head dims")
    m.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN scaling factor; with --rope-type rope it sets only MLA's softmax temperature")
    m.add_argument("--mscale", type=float, default=1.0, help="YaRN mscale (no effect with --rope-type rope)")
    m.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="MLA's softmax scale is mscale^2 / sqrt(q head dim), mscale = 0.1 x this x "
                        "ln(--rotary-scaling-factor) + 1")
    m.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="RoPE of multi-latent attention; megatron-core's default for MLA is yarn, which is not "
                        "implemented here: pass rope")


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`GPTConfig` fields these flags set; a sharing group split over pipeline stages is refused here,
    on every rank alike, before any model is built."""
    fields = {"window_attn_skip_freq": args.window_attn_skip_freq, "kv_share_pattern": args.kv_share_pattern}
    _check_pipeline_groups(args)
    if args.multi_latent_attention:
        if args.rope_type != "rope":
            raise ArgumentError(f"--multi-latent-attention with --rope-type {args.rope_type or 'yarn (its default)'}:"
                                f" YaRN RoPE is not implemented here; pass --rope-type rope")
        if args.tensor_model_parallel_size != 1:
            raise ArgumentError("--multi-latent-attention runs with --tensor-model-parallel-size 1 here")
        fields.update(multi_latent_attention=True, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
                      qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
                      v_head_dim=args.v_head_dim, rotary_scaling_factor=args.rotary_scaling_factor,
                      mscale_all_dim=args.mscale_all_dim)
    return fields


def _check_pipeline_groups(args: argparse.Namespace) -> None:
    if args.kv_share_pattern is None:
        return
    try:
        pattern = validate_patterns(args.num_layers, None, None, args.kv_share_pattern)
    except LayerPatternError as e:
        raise ArgumentError(str(e)) from None
    pp = args.pipeline_model_parallel_size
    vpp, split = virtual_pipeline_size(args), pipeline_split(args)
    sources = _Sources(args.num_layers, pattern)
    for rank in range(pp):
        for chunk in range(vpp or 1):
            try:
                check_stage_kv_sources(sources, stage_layer_numbers(args.num_layers, rank, pp, chunk, vpp, split))
            except ParallelLayoutError as e:
                raise ArgumentError(str(e)) from None


class _Sources:
    """The two fields :func:`check_stage_kv_sources` reads."""

    def __init__(self, num_layers: int, kv_share_pattern: list[int] | None) -> None:
        self.num_layers, self.kv_share_pattern = num_layers, kv_share_pattern

"""KV-efficient attention flags (Character.ai's Kaiju recipe): per-layer sliding windows and cross-layer KV sharing.

- ``--window-attn-skip-freq`` (Megatron-LM's): an int N (every N-th layer global, the rest use ``--window-size``)
  or Megatron's list pattern (``"([1]*5+[0])*2"``: 1 = sliding window, 0 = full attention);
- ``--kv-share-pattern`` (ours, in Megatron's style): an int N (consecutive groups of N layers share the first
  one's K/V) or a list pattern giving each layer's K/V source layer (0-based, e.g. ``"[0,0,2,2]"``).

The semantics live in :mod:`megatron_cai.core.transformer.layer_pattern`; this file only adds the flags and
maps them onto :class:`GPTConfig` fields (``model_fields``).
"""
from __future__ import annotations

import argparse
from typing import Any

from ...core.parallel_state import ParallelLayoutError
from ...core.transformer.layer_pattern import (
    LayerPatternError,
    check_stage_kv_sources,
    parse_int_or_pattern,
    validate_patterns,
)
from ..config import ArgumentError

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


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`GPTConfig` fields these flags set; a sharing group split over pipeline stages is refused here,
    on every rank alike, before any model is built."""
    fields = {"window_attn_skip_freq": args.window_attn_skip_freq, "kv_share_pattern": args.kv_share_pattern}
    _check_pipeline_groups(args)
    return fields


def _check_pipeline_groups(args: argparse.Namespace) -> None:
    from ...core.models.gpt.model import stage_layer_numbers

    if args.kv_share_pattern is None:
        return
    try:
        pattern = validate_patterns(args.num_layers, None, None, args.kv_share_pattern)
    except LayerPatternError as e:
        raise ArgumentError(str(e)) from None
    pp = args.pipeline_model_parallel_size
    per_vpp = args.num_layers_per_virtual_pipeline_stage
    vpp = args.num_layers // pp // per_vpp if per_vpp else None
    sources = _Sources(args.num_layers, pattern)
    for rank in range(pp):
        for chunk in range(vpp or 1):
            try:
                check_stage_kv_sources(sources, stage_layer_numbers(args.num_layers, rank, pp, chunk, vpp))
            except ParallelLayoutError as e:
                raise ArgumentError(str(e)) from None


class _Sources:
    """The two fields :func:`check_stage_kv_sources` reads."""

    def __init__(self, num_layers: int, kv_share_pattern: list[int] | None) -> None:
        self.num_layers, self.kv_share_pattern = num_layers, kv_share_pattern

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

from ...core.transformer.layer_pattern import LayerPatternError, parse_int_or_pattern

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
    """The :class:`GPTConfig` fields these flags set."""
    return {"window_attn_skip_freq": args.window_attn_skip_freq, "kv_share_pattern": args.kv_share_pattern}

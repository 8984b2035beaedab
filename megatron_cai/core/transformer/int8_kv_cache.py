"""An int8 KV cache for generation (``--kv-cache-dtype int8``), one entry per sharing group like :class:`KVCache`.

Keys and values are stored as int8 codes in blocks of ``block`` tokens, each block with one fp32 scale per
(batch row, KV head), set by the dynamic-clamping rule of QAT (``quantization.dynamic_clamp``): the clamp range
is ``c = alpha * RMS`` of that head's block, codes ``round(clamp(x, -c, c) / (c / 127))``. Tokens of a block
that is not yet full wait in a small tail in the model's dtype (fewer than ``block`` per layer) and are
quantized together once it fills, so a block's scale never changes after it is written. Attention reads the
dequantized keys and values (codes x scale) followed by the tail.

:func:`cache_bytes` counts the bytes a cache holds, from its tensors (codes, scales, tails; the intervals and
positions are per sequence, shared by all layers, and counted once).
"""
from __future__ import annotations

import torch

from ..quantization.dynamic_clamp import compute_clamp
from ..quantization.fake_quant import quantize_codes
from .self_attention import KVCache

__all__ = ["DEFAULT_KV_ALPHA", "KV_CACHE_DTYPES", "Int8KVCache", "cache_bytes", "make_kv_cache"]

KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype
DEFAULT_KV_ALPHA = 12.0  # dynamic clamping's int8 default for the rms rule (dynamic_clamp.DEFAULT_ALPHA)


class _Quantized:
    """One layer's int8 blocks ``[b, h, n_blocks * block, d]`` with scales ``[b, h, n_blocks, 1]`` and the tail."""

    def __init__(self) -> None:
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.tail: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.tail) if t is not None]


class Int8KVCache(KVCache):
    """:class:`KVCache` whose layers hold int8 codes per block of ``block`` tokens (see the module docstring)."""

    def __init__(self, block: int = 16, alpha: float = DEFAULT_KV_ALPHA) -> None:
        super().__init__()
        if block < 1 or alpha <= 0:
            raise ValueError(f"need block >= 1 and alpha > 0, got {block}, {alpha}")
        self.block, self.alpha = block, alpha
        self.stored: dict[int, tuple[_Quantized, _Quantized]] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``/``v`` ``[b, kv_heads, s, d]`` and return all keys and values so far (dequantized)."""
        store = self.stored.setdefault(layer, (_Quantized(), _Quantized()))
        out = tuple(self._append(q, x) for q, x in zip(store, (k, v)))
        return out[0], out[1]

    def _append(self, q: _Quantized, x: torch.Tensor) -> torch.Tensor:
        tail = x if q.tail is None else torch.cat([q.tail, x], dim=2)
        full = tail.shape[2] // self.block * self.block
        if full:
            codes, scales = self.quantize(tail[:, :, :full])
            q.codes = codes if q.codes is None else torch.cat([q.codes, codes], dim=2)
            q.scales = scales if q.scales is None else torch.cat([q.scales, scales], dim=2)
        q.tail = tail[:, :, full:]
        if q.codes is None:
            return q.tail
        return torch.cat([self.dequantize(q.codes, q.scales, x.dtype), q.tail], dim=2)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[b, h, n * block, d]`` -> (int8 codes, like x; fp32 scales ``[b, h, n, 1]``)."""
        b, h, t, d = x.shape
        blocks = x.float().reshape(b, h, t // self.block, self.block * d)
        c = compute_clamp(blocks, "rms", granularity="row", alpha=self.alpha, fmt="int8")
        codes, scale = quantize_codes(blocks, c, "int8")
        return codes.to(torch.int8).reshape(b, h, t, d), scale

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, h, t, d = codes.shape
        blocks = codes.float().reshape(b, h, t // self.block, self.block * d) * scales
        return blocks.reshape(b, h, t, d).to(dtype)

    def expand_rows(self, rows: int) -> None:
        super().expand_rows(rows)
        for pair in self.stored.values():
            for q in pair:
                q.codes, q.scales, q.tail = (None if t is None else t.expand(rows, -1, -1, -1)
                                             for t in (q.codes, q.scales, q.tail))

    def layer_tensors(self) -> list[torch.Tensor]:
        return [t for pair in self.stored.values() for q in pair for t in q.tensors()]


def make_kv_cache(dtype: str = "auto") -> KVCache:
    """The cache for ``--kv-cache-dtype``: ``auto`` keeps the model's dtype, ``int8`` is :class:`Int8KVCache`."""
    if dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got {dtype!r}")
    return Int8KVCache() if dtype == "int8" else KVCache()


def cache_bytes(cache: KVCache) -> int:
    """Bytes of K/V the cache holds (every layer entry's tensors), not counting the per-sequence intervals."""
    return sum(t.numel() * t.element_size() for t in cache.layer_tensors())

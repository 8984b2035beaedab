"""Attention dropout whose mask is a function of positions: the same mask however the sequence is split.

Context parallelism computes a query's attention over key sets held by other ranks; a dropout mask drawn
from a generator stream would depend on that split. Here the keep decision of probability ``P[b, h, i, j]``
is a hash of ``(seed, b, h, i, j)`` with ``i``, ``j`` the *global* sequence positions of the query and the
key: a context-parallel run and a single-process run given the same seed drop exactly the same
probabilities. The seed is one int64 drawn (on the device, no host sync) from the caller's generator stream:
the model-parallel tracker, which all CP ranks of a TP rank share.

The hash is a 32-bit integer mixer (xor-shift-multiply, multipliers below 2^31 so that int64 products never
overflow); ``keep iff hash >= round(p * 2^32)``, so the keep rate is ``1 - p`` up to 2^-32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PositionalDropout"]

_MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x1B873593  # odd multipliers < 2^31


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class PositionalDropout:
    """Dropout probability ``p`` and an int64 scalar ``seed`` tensor (in [0, 2^32))."""

    p: float
    seed: torch.Tensor

    def __post_init__(self) -> None:
        if not 0.0 < self.p < 1.0:
            raise ValueError(f"attention dropout must be in (0, 1), got {self.p}")

    @classmethod
    def draw(cls, p: float, device: torch.device) -> PositionalDropout:
        """A fresh seed from the current default generator of ``device``."""
        return cls(p, torch.randint(0, 2**32, (), device=device, dtype=torch.int64))

    def scale(self, heads: int, query_index: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
        """``[B, heads, Sq, Sk]`` fp32: ``1 / (1 - p)`` where kept, 0 where dropped, for queries at global
        positions ``query_index [Sq]`` and keys at ``key_index [B, Sk]``."""
        device = key_index.device
        bsz = key_index.shape[0]
        b = torch.arange(bsz, device=device, dtype=torch.int64).view(bsz, 1, 1, 1)
        h = torch.arange(heads, device=device, dtype=torch.int64).view(1, heads, 1, 1)
        i = query_index.to(device=device, dtype=torch.int64).view(1, 1, -1, 1)
        j = key_index.to(torch.int64).view(bsz, 1, 1, -1)
        row = _mix(_mix(_mix(self.seed.to(device) ^ b) ^ h) ^ (i & _MASK32))
        col = _mix((j & _MASK32) ^ 0x5BD1E995)
        keep = _mix(row ^ col) >= round(self.p * 2**32)
        return keep.float() / (1.0 - self.p)

"""Squinch v1 wire-format constants: the ONE place the tables S, B and L are defined.

See docs/squinch-format.md (normative). Every table is computed once in float64 (Python floats)
and rounded to float32. Everything else in the package (torch reference, CPU kernel, Triton
kernels) reads these tables from here; derived tables (bit patterns, the q_max bucket table) are
computed from them below.
"""
from __future__ import annotations

import math
import struct
from functools import cache

import torch

VERSION = 1
BLOCK = 8  # elements per block
BLOCK_BYTES = 6  # payload bytes per block: q_max, sign bits, 4 bytes of nibbles
N_SCALES = 256
N_LEVELS = 16


def _fp32(v: float) -> float:
    """Round a Python float (float64) to the nearest float32 (IEEE round-to-nearest-even)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def _fp32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


# Scale grid: S[q] = fp32(exp((q - 128) / 6)), q = 0..255.
S: tuple[float, ...] = tuple(_fp32(math.exp((q - 128) / 6)) for q in range(N_SCALES))
# Rounding thresholds: B[k] = fp32(((k - 0.5) / 15)^2), k = 1..15. B[0] is unused (kept at 0.0 so
# that B[k] indexes naturally); q_i is the number of k in 1..15 with u_i >= B[k].
B: tuple[float, ...] = (0.0,) + tuple(_fp32(((k - 0.5) / 15) ** 2) for k in range(1, N_LEVELS))
# Decode levels: L[q] = fp32((q / 15)^2), q = 0..15.
L: tuple[float, ...] = tuple(_fp32((q / 15) ** 2) for q in range(N_LEVELS))

# ---- derived tables (for the kernels) -------------------------------------------------------------
S_BITS: tuple[int, ...] = tuple(_fp32_bits(s) for s in S)
B_BITS: tuple[int, ...] = tuple(_fp32_bits(b) for b in B)
L_BITS: tuple[int, ...] = tuple(_fp32_bits(v) for v in L)

# q_max without a logarithm. For a non-negative float m with bit pattern mb, the number of S[q] <= m
# (= the smallest q with S[q] > m, before clipping to 255) is QMAX_BUCKET[mb >> QMAX_SHIFT] plus one
# when S[that] <= m. A bucket spans one exponent and the top 4 mantissa bits (a factor <= 17/16 <
# e^(1/6)), so it holds at most one grid point. Positive floats order like their bit patterns, and
# Inf/NaN bit patterns are above every S, so they land on 255 (the spec's value for such blocks).
QMAX_SHIFT = 19
QMAX_BUCKET: tuple[int, ...] = tuple(
    sum(1 for sb in S_BITS if sb <= (b << QMAX_SHIFT)) for b in range(1 << (31 - QMAX_SHIFT))
)
# S bit patterns with a sentinel at index 256 that no |x| bit pattern reaches.
S_BITS_EXT: tuple[int, ...] = S_BITS + (0x7FFFFFFF,)


def n_blocks(numel: int) -> int:
    """Number of 8-element blocks for a tensor of `numel` elements."""
    return (numel + BLOCK - 1) // BLOCK


def payload_nbytes(numel: int) -> int:
    """Payload size in bytes for `numel` elements: 6 * ceil(numel / 8)."""
    return BLOCK_BYTES * n_blocks(numel)


@cache
def _tables_cached(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev = torch.device(device)
    return (
        torch.tensor(S, dtype=torch.float32, device=dev),
        torch.tensor(B, dtype=torch.float32, device=dev),
        torch.tensor(L, dtype=torch.float32, device=dev),
    )


def tables(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(S, B, L) as float32 tensors on `device` (cached; do not modify in place)."""
    return _tables_cached(str(torch.device(device)))


@cache
def _bucket_table_cached(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    dev = torch.device(device)
    return (
        torch.tensor(QMAX_BUCKET, dtype=torch.int32, device=dev),
        torch.tensor(S_BITS_EXT, dtype=torch.int32, device=dev),
    )


def bucket_tables(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(QMAX_BUCKET, S_BITS_EXT) as int32 tensors on `device` (cached; do not modify in place)."""
    return _bucket_table_cached(str(torch.device(device)))

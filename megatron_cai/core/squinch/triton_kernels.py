"""Triton kernels of the Squinch v1 codec (CUDA; on CPU only under TRITON_INTERPRET=1, for tests).

Bit-exactness with the torch reference:
- q_max comes from the integer bucket table of format.py (no logarithm), u from ``tl.div_rn``
  (IEEE division; plain ``/`` is approximate on GPUs), q from the 15 threshold comparisons.
- Kernels launch with ``enable_fp_fusion=False`` so ``y - M * L[q]`` and ``out + s`` never become FMAs.
- Sign bits and the bf16 residual store are done on integer bit patterns (round to nearest even),
  so -0.0 and bf16 rounding do not depend on the compiler or the interpreter.
Stochastic mode draws ``tl.rand(seed, element_index)`` (Philox); its payloads are reproducible for a
given generator but are not byte-specified across backends.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_configs import squinch_launch
from . import format as fmt

BLOCKS_PER_PROGRAM = squinch_launch("encode").blocks  # 8-element blocks per program (1024 elements)
# Sizes are never specialised on their value, so one compiled kernel per table configuration serves
# every bucket size (and tools/compile_kernels.py compiles exactly what runs).
_ENCODE_INTS = ["n", "nb"]
_DECODE_INTS = ["n", "nb", "W", "stride_w"]


@triton.jit(do_not_specialize=_ENCODE_INTS)
def _encode_kernel(g_ptr, r_ptr, out_ptr, flag_ptr, seed_ptr, S_ptr, B_ptr, L_ptr, QT_ptr, SB_ptr,
                   n, nb, HAS_RES: tl.constexpr, RES_BF16: tl.constexpr, STOCH: tl.constexpr,
                   BLOCKS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 8)
    offs = blk[:, None] * 8 + j[None, :]
    emask = offs < n
    y = tl.load(g_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    if HAS_RES:
        if RES_BF16:  # residual passed as int16 bit patterns
            rb = tl.load(r_ptr + offs, mask=emask, other=0).to(tl.int32) & 0xFFFF
            y = y + (rb << 16).to(tl.float32, bitcast=True)
        else:
            y = y + tl.load(r_ptr + offs, mask=emask, other=0.0)
    bits = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    mb = tl.max(bits, axis=1)
    qm = tl.load(QT_ptr + (mb >> 19))
    qm = qm + (tl.load(SB_ptr + qm) <= mb).to(tl.int32)
    qm = tl.minimum(qm, 255)
    M = tl.load(S_ptr + qm)
    u = tl.div_rn(bits.to(tl.float32, bitcast=True), M[:, None])
    q = tl.zeros([BLOCKS, 8], dtype=tl.int32)
    if STOCH:
        for k in tl.static_range(1, 16):
            q += (u >= tl.load(L_ptr + k)).to(tl.int32)
        lo = tl.load(L_ptr + q)
        hi = tl.load(L_ptr + tl.minimum(q + 1, 15))
        p = (u - lo) / (hi - lo)
        r = tl.rand(tl.load(seed_ptr), offs)
        q += ((r < p) & (q < 15)).to(tl.int32)
    else:
        for k in tl.static_range(1, 16):
            q += (u >= tl.load(B_ptr + k)).to(tl.int32)
    neg = (y < 0).to(tl.int32)
    sb = tl.sum(neg << j[None, :], axis=1)
    word = tl.sum(q << (4 * j[None, :]), axis=1)
    c = tl.arange(0, 8)[None, :]
    shift = tl.maximum(c - 2, 0) * 8
    byte = tl.where(c == 0, qm[:, None], tl.where(c == 1, sb[:, None], (word[:, None] >> shift) & 255))
    tl.store(out_ptr + blk[:, None] * 6 + c, byte.to(tl.uint8), mask=(c < 6) & (blk[:, None] < nb))
    if HAS_RES:
        mag = M[:, None] * tl.load(L_ptr + q)
        dec = (mag.to(tl.int32, bitcast=True) | (neg << 31)).to(tl.float32, bitcast=True)
        e = y - dec
        if RES_BF16:
            eb = e.to(tl.int32, bitcast=True)
            rne = (eb + 0x7FFF + ((eb >> 16) & 1)) >> 16
            rne = tl.where((eb & 0x7FFFFFFF) > 0x7F800000, (eb >> 16) | 0x40, rne)
            tl.store(r_ptr + offs, (rne & 0xFFFF).to(tl.int16), mask=emask)
        else:
            tl.store(r_ptr + offs, e, mask=emask)
    tl.store(flag_ptr + pid, tl.max(mb, axis=0))  # per-program max |y| bits, reduced by one amax


@triton.jit(do_not_specialize=_DECODE_INTS)
def _decode_kernel(p_ptr, out_ptr, S_ptr, L_ptr, n, nb, W, stride_w, ACC: tl.constexpr, BLOCKS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * BLOCKS + tl.arange(0, BLOCKS)
    j = tl.arange(0, 8)
    offs = blk[:, None] * 8 + j[None, :]
    emask = offs < n
    bmask = blk < nb
    # s starts at -0.0, the exact additive identity: s = ((d_0 + d_1) + ...) + d_{W-1}
    s = tl.full([BLOCKS, 8], -2147483648, tl.int32).to(tl.float32, bitcast=True)
    stride64 = stride_w.to(tl.int64)
    for w in range(W):
        base = p_ptr + w * stride64 + blk * 6
        qm = tl.load(base, mask=bmask, other=0).to(tl.int32)
        sb = tl.load(base + 1, mask=bmask, other=0).to(tl.int32)
        nib = tl.load(base[:, None] + 2 + j[None, :] // 2, mask=bmask[:, None], other=0).to(tl.int32)
        q = (nib >> ((j[None, :] % 2) * 4)) & 15
        mag = tl.load(S_ptr + qm)[:, None] * tl.load(L_ptr + q)
        sgn = ((sb[:, None] >> j[None, :]) & 1) << 31
        s = s + (mag.to(tl.int32, bitcast=True) | sgn).to(tl.float32, bitcast=True)
    if ACC:
        s = tl.load(out_ptr + offs, mask=emask, other=0.0) + s
    tl.store(out_ptr + offs, s, mask=emask)


_TABLES: dict = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    key = str(device)
    if key not in _TABLES:
        S, B, L = fmt.tables(device)
        qt, sb = fmt.bucket_tables(device)
        _TABLES[key] = (S, B, L, qt, sb)
    return _TABLES[key]


def _grid(nb: int, blocks: int) -> tuple[int]:
    return (max(1, triton.cdiv(nb, blocks)),)


def encode_into(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    stochastic: bool,
    seed: torch.Tensor | None,
) -> torch.Tensor:
    """Launch the fused encoder; returns the 0-dim bool `nonfinite` tensor (no host sync).

    x, residual (fp32/bf16) and out (uint8) are contiguous tensors on one device; seed is an int64
    tensor of one element on that device (stochastic mode only).
    """
    n = x.numel()
    nb = fmt.n_blocks(n)
    if n == 0:
        return torch.zeros((), dtype=torch.bool, device=x.device)
    cfg = squinch_launch("encode")
    grid = _grid(nb, cfg.blocks)
    flags = torch.empty(grid[0], dtype=torch.int32, device=x.device)
    S, B, L, qt, sbits = _tables(x.device)
    if seed is None:
        seed = torch.zeros(1, dtype=torch.int64, device=x.device)
    res_bf16 = residual is not None and residual.dtype == torch.bfloat16
    r = residual if residual is None or not res_bf16 else residual.view(torch.int16)
    _encode_kernel[grid](
        x, r if r is not None else x, out, flags, seed, S, B, L, qt, sbits, n, nb,
        HAS_RES=residual is not None, RES_BF16=res_bf16, STOCH=bool(stochastic),
        BLOCKS=cfg.blocks, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )
    # one int per program instead of an atomic on one address (no contention); NaN/Inf bits >= 0x7F800000
    return flags.amax() >= 0x7F800000


def decode_into(payloads: torch.Tensor, n: int, out: torch.Tensor, accumulate: bool) -> None:
    """out = (out +) ((d_0 + d_1) + ... + d_{W-1}) for [W, nbytes] (or [nbytes]) uint8 payloads."""
    p2 = payloads if payloads.dim() > 1 else payloads.view(1, -1)
    W = p2.shape[0]
    if W == 0 or n == 0:
        return
    nb = fmt.n_blocks(n)
    S, _, L, _, _ = _tables(out.device)
    cfg = squinch_launch("decode")
    _decode_kernel[_grid(nb, cfg.blocks)](
        p2, out, S, L, n, nb, W, p2.stride(0), ACC=bool(accumulate),
        BLOCKS=cfg.blocks, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )

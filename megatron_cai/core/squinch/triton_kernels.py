"""Triton kernels of the Squinch v1 codec (CUDA; on CPU only under TRITON_INTERPRET=1, for tests).

Bit-exactness with the torch reference:
- q_max comes from the integer bucket table of format.py (no logarithm), u from ``tl.div_rn``
  (IEEE division; plain ``/`` is approximate on GPUs), q from the 15 threshold comparisons.
- Kernels launch with ``enable_fp_fusion=False`` so ``y - M * L[q]`` and ``out + s`` never become FMAs.
- Sign bits and the bf16 residual store are done on integer bit patterns (round to nearest even),
  so -0.0 and bf16 rounding do not depend on the compiler or the interpreter.
Stochastic mode draws ``tl.rand(seed, element_index)`` (Philox); its payloads are reproducible for a
given generator but are not byte-specified across backends.

One launch per call, whatever the number of rows (data-parallel ranks): the grid's second axis is the
row, every row at its own stride. A program whose 8-element blocks are all inside its row takes the
unmasked path (loads and stores widen to 16 bytes); only the last program of a row is masked. The
non-finite flag needs no extra launch either: every encode program folds its max |y| bits into a
per-stream scratch word with an atomic, and the last program to finish (an atomic counter) writes the
flag (and the wire rows' flag bytes) and resets the scratch for the next launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernel_configs import squinch_launch
from ..triton_loops import loop_bound
from . import format as fmt

MAX_TAIL = 16  # bytes after a wire row's payload: the flag byte, then zero padding (see encode_rows_into)
# Sizes and strides are never specialised on their value, so one compiled kernel per table configuration
# serves every bucket size and data-parallel size (and tools/compile_kernels.py compiles exactly what runs).
_ENCODE_INTS = ["n", "nb", "out_stride", "flag_stride", "tail", "rows"]
_DECODE_INTS = ["n", "nb", "W", "stride_w", "stride_g", "n_flags", "flag_stride"]


@triton.jit
def _encode_tile(g_ptr, r_ptr, out_ptr, seed, rand_base, S_ptr, B_ptr, L_ptr, QT_ptr, SB_ptr, n, nb, blk0,
                 HAS_RES: tl.constexpr, RES_BF16: tl.constexpr, STOCH: tl.constexpr, BLOCKS: tl.constexpr,
                 MASKED: tl.constexpr):
    """Encode BLOCKS blocks of one row from block ``blk0``; returns their max |y| bit pattern."""
    blk = blk0 + tl.arange(0, BLOCKS)
    j = tl.arange(0, 8)
    offs = blk[:, None] * 8 + j[None, :]
    emask = offs < n
    if MASKED:
        y = tl.load(g_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    else:
        y = tl.load(g_ptr + offs).to(tl.float32)
    if HAS_RES:
        if RES_BF16:  # residual passed as int16 bit patterns
            if MASKED:
                rb = tl.load(r_ptr + offs, mask=emask, other=0)
            else:
                rb = tl.load(r_ptr + offs)
            y = y + ((rb.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            if MASKED:
                y = y + tl.load(r_ptr + offs, mask=emask, other=0.0)
            else:
                y = y + tl.load(r_ptr + offs)
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
        r = tl.rand(seed, rand_base + offs)
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
    if MASKED:
        tl.store(out_ptr + blk[:, None] * 6 + c, byte.to(tl.uint8), mask=(c < 6) & (blk[:, None] < nb))
    else:
        tl.store(out_ptr + blk[:, None] * 6 + c, byte.to(tl.uint8), mask=c < 6)
    if HAS_RES:
        mag = M[:, None] * tl.load(L_ptr + q)
        dec = (mag.to(tl.int32, bitcast=True) | (neg << 31)).to(tl.float32, bitcast=True)
        e = y - dec
        if RES_BF16:
            eb = e.to(tl.int32, bitcast=True)
            rne = (eb + 0x7FFF + ((eb >> 16) & 1)) >> 16
            rne = tl.where((eb & 0x7FFFFFFF) > 0x7F800000, (eb >> 16) | 0x40, rne)
            e_out = (rne & 0xFFFF).to(tl.int16)
        else:
            e_out = e
        if MASKED:
            tl.store(r_ptr + offs, e_out, mask=emask)
        else:
            tl.store(r_ptr + offs, e_out)
    return tl.max(mb, axis=0)


@triton.jit(do_not_specialize=_ENCODE_INTS)
def _encode_kernel(g_ptr, r_ptr, out_ptr, flag_ptr, nonfinite_ptr, scratch_ptr, seed_ptr, S_ptr, B_ptr, L_ptr,
                   QT_ptr, SB_ptr, n, nb, out_stride, flag_stride, tail, rows,
                   HAS_RES: tl.constexpr, RES_BF16: tl.constexpr, STOCH: tl.constexpr, ROW_FLAGS: tl.constexpr,
                   N_ALIGNED: tl.constexpr, BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    blk0 = pid.to(tl.int64) * BLOCKS
    if N_ALIGNED:  # rows of a multiple of 16 elements: the compiler sees 16-aligned rows (16-byte accesses)
        row_start = row * (n // 16) * 16
    else:
        row_start = row * n
    seed = 0
    if STOCH:
        seed = tl.load(seed_ptr)
    g_row = g_ptr + row_start
    r_row = r_ptr + row_start
    o_row = out_ptr + row * out_stride
    if (blk0 + BLOCKS) * 8 <= n:
        worst = _encode_tile(g_row, r_row, o_row, seed, row_start, S_ptr, B_ptr, L_ptr, QT_ptr, SB_ptr, n, nb,
                             blk0, HAS_RES, RES_BF16, STOCH, BLOCKS, False)
    else:
        worst = _encode_tile(g_row, r_row, o_row, seed, row_start, S_ptr, B_ptr, L_ptr, QT_ptr, SB_ptr, n, nb,
                             blk0, HAS_RES, RES_BF16, STOCH, BLOCKS, True)
    # The non-finite flag, without a second launch: NaN/Inf bit patterns are >= 0x7F800000.
    tl.atomic_max(scratch_ptr, worst)
    finished = tl.atomic_add(scratch_ptr + 1, 1)
    if finished == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last program: publish and reset
        total = tl.atomic_xchg(scratch_ptr, 0)
        tl.atomic_xchg(scratch_ptr + 1, 0)
        flag = (total >= 0x7F800000).to(tl.uint8)
        tl.store(nonfinite_ptr, flag)
        if ROW_FLAGS:  # every wire row: [payload | flag | zero padding] (tail bytes after the payload)
            t = tl.arange(0, 16)
            tail_bytes = tl.where(t == 0, flag, 0).to(tl.uint8)
            row_ptr = flag_ptr
            for _ in range(0, loop_bound(rows)):  # a pointer walk: 64-bit addresses whatever rows x stride
                tl.store(row_ptr + t, tail_bytes, mask=t < tail)
                row_ptr += flag_stride


@triton.jit
def _decode_tile(p_ptr, o_ptr, S_ptr, L_ptr, n, nb, W, stride_w, blk0, bad, ACC: tl.constexpr,
                 BLOCKS: tl.constexpr, MASKED: tl.constexpr):
    blk = blk0 + tl.arange(0, BLOCKS)
    j = tl.arange(0, 8)
    offs = blk[:, None] * 8 + j[None, :]
    emask = offs < n
    bmask = blk < nb
    # s starts at -0.0, the exact additive identity: s = ((d_0 + d_1) + ...) + d_{W-1}
    s = tl.full([BLOCKS, 8], -2147483648, tl.int32).to(tl.float32, bitcast=True)
    for w in range(loop_bound(W)):
        base = p_ptr + w * stride_w + blk * 6
        if MASKED:
            qm = tl.load(base, mask=bmask, other=0).to(tl.int32)
            sb = tl.load(base + 1, mask=bmask, other=0).to(tl.int32)
            nib = tl.load(base[:, None] + 2 + j[None, :] // 2, mask=bmask[:, None], other=0).to(tl.int32)
        else:
            qm = tl.load(base).to(tl.int32)
            sb = tl.load(base + 1).to(tl.int32)
            nib = tl.load(base[:, None] + 2 + j[None, :] // 2).to(tl.int32)
        q = (nib >> ((j[None, :] % 2) * 4)) & 15
        mag = tl.load(S_ptr + qm)[:, None] * tl.load(L_ptr + q)
        sgn = ((sb[:, None] >> j[None, :]) & 1) << 31
        s = s + (mag.to(tl.int32, bitcast=True) | sgn).to(tl.float32, bitcast=True)
    s = tl.where(bad != 0, float("nan"), s)
    if ACC:
        if MASKED:
            s = tl.load(o_ptr + offs, mask=emask, other=0.0) + s
        else:
            s = tl.load(o_ptr + offs) + s
    if MASKED:
        tl.store(o_ptr + offs, s, mask=emask)
    else:
        tl.store(o_ptr + offs, s)


@triton.jit(do_not_specialize=_DECODE_INTS)
def _decode_kernel(p_ptr, out_ptr, flag_ptr, S_ptr, L_ptr, n, nb, W, stride_w, stride_g, n_flags, flag_stride,
                   ACC: tl.constexpr, HAS_FLAGS: tl.constexpr, N_ALIGNED: tl.constexpr, BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    blk0 = pid.to(tl.int64) * BLOCKS
    bad = tl.full([], 0, tl.int32)
    if HAS_FLAGS:  # NaN everywhere when any sender flagged non-finite gradients
        f = tl.arange(0, 64)
        for f0 in range(0, loop_bound(n_flags), 64):
            idx = (f0 + f).to(tl.int64)
            fl = tl.load(flag_ptr + idx * flag_stride, mask=idx < n_flags, other=0).to(tl.int32)
            bad = tl.maximum(bad, tl.max(fl, axis=0))
    stride64 = stride_w.to(tl.int64)
    p_g = p_ptr + g * stride_g
    if N_ALIGNED:
        o_g = out_ptr + g * (n // 16) * 16
    else:
        o_g = out_ptr + g * n
    if (blk0 + BLOCKS) * 8 <= n:
        _decode_tile(p_g, o_g, S_ptr, L_ptr, n, nb, W, stride64, blk0, bad, ACC, BLOCKS, False)
    else:
        _decode_tile(p_g, o_g, S_ptr, L_ptr, n, nb, W, stride64, blk0, bad, ACC, BLOCKS, True)


_TABLES: dict = {}
_SCRATCH: dict = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    key = str(device)
    if key not in _TABLES:
        S, B, L = fmt.tables(device)
        qt, sb = fmt.bucket_tables(device)
        _TABLES[key] = (S, B, L, qt, sb)
    return _TABLES[key]


def _scratch(device: torch.device) -> torch.Tensor:
    """The flag scratch of launches on `device`'s current stream: int32 [running max, finished programs].

    Every launch leaves it zeroed, so it is allocated (zeroed) once per stream; launches on one stream
    never overlap, launches on two streams use two scratches."""
    stream = torch.accelerator.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return _SCRATCH[key]


def _grid(nb: int, blocks: int, rows: int) -> tuple[int, int]:
    return (max(1, triton.cdiv(nb, blocks)), rows)


def encode_rows_into(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    stochastic: bool,
    seed: torch.Tensor | None,
    flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encode the ``out.shape[0]`` equal rows of flat ``x`` (each with its chunk of ``residual``, updated
    in place) in ONE launch; returns the 0-dim bool `nonfinite` (OR over every row; no host sync).

    out: uint8 ``[rows, >= payload_nbytes(chunk)]`` with unit column stride (row r's payload starts at
    ``out[r, 0]``). flags: None, or the uint8 view ``[rows, tail]`` (unit column stride, tail <= 16)
    right after each row's payload: its column 0 receives the flag, the rest zeros (the wire rows of
    ``squinch_collectives``). seed: int64 tensor of one element (stochastic mode only).
    """
    rows = out.shape[0]
    n = x.numel() // rows
    nb = fmt.n_blocks(n)
    nonfinite = torch.empty((), dtype=torch.uint8, device=x.device)
    if n == 0:
        nonfinite.zero_()
        if flags is not None:
            flags.zero_()
        return nonfinite.view(torch.bool)
    cfg = squinch_launch("encode")
    S, B, L, qt, sbits = _tables(x.device)
    scratch = _scratch(x.device)
    res_bf16 = residual is not None and residual.dtype == torch.bfloat16
    r = residual if residual is None or not res_bf16 else residual.view(torch.int16)
    tail = 0 if flags is None else flags.shape[1]
    if tail > MAX_TAIL:
        raise ValueError(f"squinch: at most {MAX_TAIL} bytes may follow a row's payload, got {tail}")
    _encode_kernel[_grid(nb, cfg.blocks, rows)](
        x, r if r is not None else x, out, flags if flags is not None else out, nonfinite, scratch,
        seed if seed is not None else scratch, S, B, L, qt, sbits, n, nb, out.stride(0),
        flags.stride(0) if flags is not None else 0, tail, rows,
        HAS_RES=residual is not None, RES_BF16=res_bf16, STOCH=bool(stochastic), ROW_FLAGS=flags is not None,
        N_ALIGNED=n % 16 == 0, BLOCKS=cfg.blocks, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=False,
    )
    return nonfinite.view(torch.bool)


def encode_into(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    stochastic: bool,
    seed: torch.Tensor | None,
) -> torch.Tensor:
    """Launch the fused encoder on one row; returns the 0-dim bool `nonfinite` tensor (no host sync).

    x, residual (fp32/bf16) and out (uint8) are contiguous tensors on one device; seed is an int64
    tensor of one element on that device (stochastic mode only).
    """
    return encode_rows_into(x, residual, out.view(1, -1), stochastic, seed)


def decode_into(payloads: torch.Tensor, n: int, out: torch.Tensor, accumulate: bool,
                flags: torch.Tensor | None = None) -> None:
    """Decode in ONE launch. ``payloads``: uint8 ``[nbytes]``, ``[W, nbytes]`` or ``[G, W, nbytes]``
    (unit byte stride, any row strides); output group g (``n`` elements at ``out[g * n]``, fp32
    contiguous) = (out +) ((d_0 + d_1) + ... + d_{W-1}) over its W rows. ``flags``: None or a 1-D uint8
    view; when any entry is non-zero every output element becomes NaN."""
    p3 = payloads.view(1, 1, -1) if payloads.dim() == 1 else payloads.unsqueeze(0) if payloads.dim() == 2 \
        else payloads
    G, W = p3.shape[0], p3.shape[1]
    if G == 0 or W == 0 or n == 0:
        return
    nb = fmt.n_blocks(n)
    S, _, L, _, _ = _tables(out.device)
    cfg = squinch_launch("decode")
    _decode_kernel[_grid(nb, cfg.blocks, G)](
        p3, out, flags if flags is not None else p3, S, L, n, nb, W, p3.stride(1), p3.stride(0),
        flags.numel() if flags is not None else 0, flags.stride(0) if flags is not None else 0,
        ACC=bool(accumulate), HAS_FLAGS=flags is not None, N_ALIGNED=n % 16 == 0,
        BLOCKS=cfg.blocks, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )

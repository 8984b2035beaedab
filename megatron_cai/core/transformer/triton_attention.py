"""Fused flash-attention forward and backward kernels (Triton) over visibility intervals.

- Tiles: for each query block the kernel walks only the key blocks listed by
  :func:`attention_tiling.block_map` (per-block min/max summaries; fully masked tiles are never visited),
  and applies the element mask ``start[j] <= i < limit[j]`` (and the window) inside a tile.
- GQA/MQA: query head h reads kv head ``h // (heads / kv_heads)``; the dK/dV kernel owns one kv head
  and loops over the query heads of its group, so no atomics are needed.
- Z-Reg: the backward preprocess uses ``D'_i = rowsum(dO_i * O_i) - dlse_i`` with
  ``dlse_i = grad_lse_i + 2 w lse_i / N`` (see :mod:`zreg`).
- Sizes: per-(batch, head) base offsets are int64 scalars (tile offsets stay int32), so B·H·T·D may pass
  2^31; the (batch, head) pairs are folded over grid axes 1 and 2 (each capped at 65,535 by CUDA).
- Backward: a preprocess kernel computes ``rowsum(dO * O)`` in fp32 (no full-size fp32 temporaries).

Runs on CUDA, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1`` set before
this module is imported). fp64 inputs are computed in fp32.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megatron_cai.core import kernel_configs
from megatron_cai.core.transformer import attention_tiling
from megatron_cai.core.transformer.attention_ops import IntervalAttentionOp
from megatron_cai.core.transformer.zreg import zreg_lse_grad
from megatron_cai.core.triton_loops import loop_bound

__all__ = ["triton_attention", "triton_backward", "triton_forward", "triton_prepare"]

LOG2E = 1.4426950408889634
# Integer arguments that are never specialised on their value (divisibility by 16, == 1): one compiled
# kernel per table configuration, whatever the sequence length, head count or window, so the
# ahead-of-time check (core/triton_aot.py) compiles exactly what runs. Strides stay specialised: the
# launcher makes every tensor contiguous with a head dim that is a multiple of 16 or pads nothing else.
_RUNTIME_INTS = ["seq_q", "seq_k", "heads", "kv_heads", "group", "n_kb", "n_qb", "window", "sib", "n_bh"]
GRID_AXIS_MAX = 65535  # CUDA's limit on grid axes 1 and 2: (batch, head) pairs are folded over both


def fold_pairs(n_bh: int) -> tuple[int, int]:
    """Grid axes (1, 2) covering ``n_bh`` (batch, head) pairs, each at most GRID_AXIS_MAX; a program's
    pair is ``program_id(2) * num_programs(1) + program_id(1)`` (those past n_bh return at once)."""
    z = triton.cdiv(n_bh, GRID_AXIS_MAX)
    return triton.cdiv(n_bh, z), z


@triton.jit
def _pair_index(n_bh):
    """This program's (batch, head) pair as int64 (see fold_pairs), and whether it is past the last."""
    bh = tl.program_id(2).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    return bh, bh >= n_bh


@triton.jit
def _tile_scores(q, k_ptrs, start_ptr, limit_ptr, pos_ptr, abs_m, offs_n, pos_m, seq_k, qk_scale,
                 kmask_d, window, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """Scores (log2 units) of one [BLOCK_M, BLOCK_N] tile with masked pairs at -inf, plus the K tile.

    ``abs_m``: absolute query positions of the tile rows (local row + offset past a KV cache)."""
    n_ok = offs_n < seq_k
    k = tl.load(k_ptrs, mask=n_ok[:, None] & kmask_d[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    ks = tl.load(start_ptr + offs_n, mask=n_ok, other=seq_k + 1)
    kl = tl.load(limit_ptr + offs_n, mask=n_ok, other=0)
    vis = (ks[None, :] <= abs_m[:, None]) & (abs_m[:, None] < kl[None, :])
    if HAS_WINDOW:
        pos_n = tl.load(pos_ptr + offs_n, mask=n_ok, other=0)
        diff = pos_m[:, None] - pos_n[None, :]
        vis = vis & (diff < window) & (diff > -window)
    return tl.where(vis, s, float("-inf")), k


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _fwd_kernel(Q, K, V, O, LSE, START, LIMIT, POS, KV_NUM, KV_IDX,
                seq_q, seq_k, heads, group, n_kb, window, qk_scale,
                sqb, sqh, sqt, skb, skh, skt, sib, n_bh,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    qb = tl.program_id(0)
    bh, past = _pair_index(n_bh)
    if past:
        return
    b = bh // heads
    h = bh % heads
    hk = h // group
    n_qb = tl.cdiv(seq_q, BLOCK_M)
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    abs_m = offs_m + (seq_k - seq_q)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_q
    d_ok = offs_d < HEAD_DIM
    q_base = Q + b * sqb + h * sqh
    q = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :],
                other=0.0)
    start_ptr = START + b * sib
    limit_ptr = LIMIT + b * sib
    pos_ptr = POS + b * sib
    pos_m = abs_m
    if HAS_WINDOW:
        pos_m = tl.load(pos_ptr + abs_m, mask=m_ok, other=0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * skb + hk * skh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tile_row = b * n_qb + qb
    num = tl.load(KV_NUM + tile_row)
    for t in range(0, loop_bound(num)):
        kb = tl.load(KV_IDX + tile_row * n_kb + t)
        offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        s, _k = _tile_scores(q, k_base + offs_n[:, None] * skt + offs_d[None, :], start_ptr, limit_ptr,
                             pos_ptr, abs_m, offs_n, pos_m, seq_k, qk_scale, d_ok, window, HAS_WINDOW,
                             PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * skt + offs_d[None, :],
                    mask=(offs_n < seq_k)[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    o_base = O + b * sqb + h * sqh
    tl.store(o_base + offs_m[:, None] * sqt + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + bh * seq_q + offs_m, lse, mask=m_ok)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, START, LIMIT, POS, KV_NUM, KV_IDX,
                   seq_q, seq_k, heads, group, n_kb, window, qk_scale, sm_scale,
                   sqb, sqh, sqt, skb, skh, skt, sib, n_bh,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    qb = tl.program_id(0)
    bh, past = _pair_index(n_bh)
    if past:
        return
    b = bh // heads
    h = bh % heads
    hk = h // group
    n_qb = tl.cdiv(seq_q, BLOCK_M)
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    abs_m = offs_m + (seq_k - seq_q)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_q
    d_ok = offs_d < HEAD_DIM
    qd_mask = m_ok[:, None] & d_ok[None, :]
    q_base = b * sqb + h * sqh  # int64 scalar; the tile's offsets stay int32
    q_off = offs_m[:, None] * sqt + offs_d[None, :]
    q = tl.load(Q + q_base + q_off, mask=qd_mask, other=0.0)
    do = tl.load(DO + q_base + q_off, mask=qd_mask, other=0.0)
    lse = tl.load(LSE + bh * seq_q + offs_m, mask=m_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(DELTA + bh * seq_q + offs_m, mask=m_ok, other=0.0)
    start_ptr = START + b * sib
    limit_ptr = LIMIT + b * sib
    pos_ptr = POS + b * sib
    pos_m = abs_m
    if HAS_WINDOW:
        pos_m = tl.load(pos_ptr + abs_m, mask=m_ok, other=0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * skb + hk * skh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tile_row = b * n_qb + qb
    num = tl.load(KV_NUM + tile_row)
    for t in range(0, loop_bound(num)):
        kb = tl.load(KV_IDX + tile_row * n_kb + t)
        offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        s, k = _tile_scores(q, k_base + offs_n[:, None] * skt + offs_d[None, :], start_ptr, limit_ptr,
                            pos_ptr, abs_m, offs_n, pos_m, seq_k, qk_scale, d_ok, window, HAS_WINDOW,
                             PRECISION)
        p = tl.exp2(s - lse2[:, None])
        v = tl.load(v_base + offs_n[:, None] * skt + offs_d[None, :],
                    mask=(offs_n < seq_k)[:, None] & d_ok[None, :], other=0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + q_base + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, START, LIMIT, POS, Q_NUM, Q_IDX,
                     seq_q, seq_k, heads, kv_heads, group, n_qb, window, qk_scale, sm_scale,
                     sqb, sqh, sqt, skb, skh, skt, sib, n_bh,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    kb = tl.program_id(0)
    bh, past = _pair_index(n_bh)  # (batch, kv head) pairs here
    if past:
        return
    b = bh // kv_heads
    hk = bh % kv_heads
    n_kb = tl.cdiv(seq_k, BLOCK_N)
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seq_k
    d_ok = offs_d < HEAD_DIM
    kd_mask = n_ok[:, None] & d_ok[None, :]
    k_base = b * skb + hk * skh  # int64 scalar; the tile's offsets stay int32
    k_off = offs_n[:, None] * skt + offs_d[None, :]
    k = tl.load(K + k_base + k_off, mask=kd_mask, other=0.0)
    v = tl.load(V + k_base + k_off, mask=kd_mask, other=0.0)
    ks = tl.load(START + b * sib + offs_n, mask=n_ok, other=seq_k + 1)
    kl = tl.load(LIMIT + b * sib + offs_n, mask=n_ok, other=0)
    pos_n = offs_n
    if HAS_WINDOW:
        pos_n = tl.load(POS + b * sib + offs_n, mask=n_ok, other=0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    tile_row = b * n_kb + kb
    num = tl.load(Q_NUM + tile_row)
    for g in range(0, loop_bound(group)):
        h = hk * group + g
        for t in range(0, loop_bound(num)):
            qb = tl.load(Q_IDX + tile_row * n_qb + t)
            offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
            abs_m = offs_m + (seq_k - seq_q)
            m_ok = offs_m < seq_q
            qd_mask = m_ok[:, None] & d_ok[None, :]
            q_base = b * sqb + h * sqh
            q_off = offs_m[:, None] * sqt + offs_d[None, :]
            q = tl.load(Q + q_base + q_off, mask=qd_mask, other=0.0)
            do = tl.load(DO + q_base + q_off, mask=qd_mask, other=0.0)
            row = (b * heads + h) * seq_q
            lse = tl.load(LSE + row + offs_m, mask=m_ok, other=0.0)
            lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
            delta = tl.load(DELTA + row + offs_m, mask=m_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            vis = (ks[None, :] <= abs_m[:, None]) & (abs_m[:, None] < kl[None, :])
            if HAS_WINDOW:
                pos_m = tl.load(POS + b * sib + abs_m, mask=m_ok, other=0)
                diff = pos_m[:, None] - pos_n[None, :]
                vis = vis & (diff < window) & (diff > -window)
            p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    tl.store(DK + k_base + k_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=kd_mask)
    tl.store(DV + k_base + k_off, dv.to(DV.dtype.element_ty), mask=kd_mask)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_delta_kernel(O, DO, DELTA, seq_q, sqh, sqt, n_bh,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = rowsum(dO_i * O_i) in fp32 for BLOCK_M query rows of one (batch, head) pair."""
    qb = tl.program_id(0)
    bh, past = _pair_index(n_bh)
    if past:
        return
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_q
    mask = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    off = offs_m[:, None] * sqt + offs_d[None, :]
    o = tl.load(O + bh * sqh + off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + bh * sqh + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * seq_q + offs_m, tl.sum(o * do, 1), mask=m_ok)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned, so every launch matches the pointer specialisation the check compiles."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _meta(dtype: torch.dtype, dim: int, tiles: kernel_configs.Tiles, has_window: bool) -> dict:
    return dict(
        HEAD_DIM=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        HAS_WINDOW=has_window,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def launch_tiles(q: torch.Tensor, block: int | None) -> dict[str, kernel_configs.Tiles]:
    """The tiles of the three kernels for q's dtype, head dim and device (kernel_configs.ATTENTION_TABLE).

    ``block`` forces square ``block x block`` tiles everywhere (tests and experiments only: such a launch
    is outside what tools/compile_kernels.py checks)."""
    if block is not None:
        forced = kernel_configs.Tiles(block, block, 4, 1 if not q.is_cuda else 2)
        return {name: forced for name in kernel_configs.ATTENTION_KERNELS}
    target = kernel_configs.launch_target(q.device)
    cd = torch.float32 if q.dtype == torch.float64 else q.dtype
    tiles = {name: kernel_configs.attention_tiles(name, cd, q.shape[-1], target)
             for name in kernel_configs.ATTENTION_KERNELS}
    return tiles


def triton_prepare(q, k, v, start, limit, position_ids, window, block: int | None = None):
    """Inputs in the compute dtype (fp32 for fp64 inputs), int32 intervals and the tile lists of one call:
    the ``state = (tensors, launch)`` that :func:`triton_forward` and :func:`triton_backward` run on."""
    cd = _compute_dtype(q.dtype)
    q, k, v = (_aligned(x.to(cd)) for x in (q, k, v))
    seq_q, seq_k = q.shape[2], k.shape[2]
    # Same semantics, int32-safe: positions are in [0, seq_k).
    start32 = _aligned(start.clamp(-1, seq_k + 1).to(torch.int32))
    limit32 = _aligned(limit.clamp(-1, seq_k + 1).to(torch.int32))
    pos = attention_tiling.key_positions(start, position_ids) if window is not None else start
    pos32 = _aligned(pos.to(torch.int32))
    tiles = launch_tiles(q, block)
    fwd, dkdv = tiles["fwd"], tiles["bwd_dkdv"]
    fwd_map, _ = attention_tiling.block_map(start, limit, fwd.block_m, fwd.block_n, window, position_ids, seq_q)
    kv_num, kv_idx = (_aligned(x) for x in attention_tiling.block_indices(fwd_map))
    if (dkdv.block_m, dkdv.block_n) != (fwd.block_m, fwd.block_n):
        bwd_map, _ = attention_tiling.block_map(start, limit, dkdv.block_m, dkdv.block_n, window, position_ids,
                                                seq_q)
    else:
        bwd_map = fwd_map
    q_num, q_idx = (_aligned(x) for x in attention_tiling.block_indices(bwd_map.transpose(-1, -2).contiguous()))
    win = int(window or 0)
    strides = (*q.stride()[:3], *k.stride()[:3], start32.stride(0))
    return (q, k, v, start32, limit32, pos32, kv_num, kv_idx, q_num, q_idx), (tiles, win, strides)


def triton_forward(q, k, v, start, limit, position_ids, window, block: int | None = None):
    """Launch the forward kernel: ``(out, lse, state)``, out in the compute dtype, lse fp32; ``state``
    (:func:`triton_prepare`) is what :func:`triton_backward` needs besides the gradients."""
    state = triton_prepare(q, k, v, start, limit, position_ids, window, block)
    (q, k, v, start32, limit32, pos32, kv_num, kv_idx, _, _), (tiles, win, strides) = state
    bsz, heads, seq_q, dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(bsz, heads, seq_q, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(dim)
    _fwd_kernel[(kv_idx.shape[-2], *fold_pairs(bsz * heads))](
        q, k, v, out, lse, start32, limit32, pos32, kv_num, kv_idx,
        seq_q, k.shape[2], heads, heads // kv_heads, kv_idx.shape[-1], win, scale * LOG2E, *strides, bsz * heads,
        **_meta(q.dtype, dim, tiles["fwd"], win > 0),
    )
    return out, lse, state


def triton_delta(out: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """``D_i = sum_d dO * O`` per query row (fp32), by the delta preprocess kernel."""
    bsz, heads, seq_q, dim = out.shape
    delta = torch.empty(bsz, heads, seq_q, dtype=torch.float32, device=out.device)
    rows = kernel_configs.delta_tiles(kernel_configs.launch_target(out.device))
    _bwd_delta_kernel[(triton.cdiv(seq_q, rows.block_m), *fold_pairs(bsz * heads))](
        out, do, delta, seq_q, out.stride(1), out.stride(2), bsz * heads, HEAD_DIM=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_M=rows.block_m, num_warps=rows.num_warps,
        num_stages=rows.num_stages,
    )
    return delta


def triton_backward(state, grad_out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor):
    """Launch the dQ and dK/dV kernels for :func:`triton_forward`'s ``state``: ``(dq, dk, dv)`` in the
    compute dtype. ``lse`` normalises ``P = exp(S - lse)`` and ``delta`` is ``D_i`` of ``dS = P (dP - D)``:
    this call's own, or those of a softmax merged over several key sets (context parallelism)."""
    (q, k, v, start32, limit32, pos32, kv_num, kv_idx, q_num, q_idx), (tiles, win, strides) = state
    bsz, heads, seq_q, dim = q.shape
    kv_heads = k.shape[1]
    do = _aligned(grad_out.to(q.dtype))
    lse, delta = _aligned(lse.float()), _aligned(delta.float())
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale = 1.0 / math.sqrt(dim)
    group = heads // kv_heads
    _bwd_dq_kernel[(kv_idx.shape[-2], *fold_pairs(bsz * heads))](
        q, k, v, do, dq, lse, delta, start32, limit32, pos32, kv_num, kv_idx,
        seq_q, k.shape[2], heads, group, kv_idx.shape[-1], win, scale * LOG2E, scale, *strides, bsz * heads,
        **_meta(q.dtype, dim, tiles["bwd_dq"], win > 0),
    )
    _bwd_dkdv_kernel[(q_idx.shape[-2], *fold_pairs(bsz * kv_heads))](
        q, k, v, do, dk, dv, lse, delta, start32, limit32, pos32, q_num, q_idx,
        seq_q, k.shape[2], heads, kv_heads, group, q_idx.shape[-1], win, scale * LOG2E, scale, *strides,
        bsz * kv_heads, **_meta(q.dtype, dim, tiles["bwd_dkdv"], win > 0),
    )
    return dq, dk, dv


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else dtype


def _forward(q, k, v, start, limit, position_ids, window, tile_q, tile_k):
    """``(out, lse)``: out in the compute dtype (fp32 for fp64 inputs), lse fp32 (the custom op's forward)."""
    out, lse, _ = triton_forward(q, k, v, start, limit, position_ids, window, tile_q or None)
    return out, lse


def _backward(grad_out, grad_lse, q, k, v, out, lse, start, limit, position_ids, window, coeff, tile_q, tile_k):
    """``(dq, dk, dv)`` in the input dtypes (the custom op's backward; the tile maps are rebuilt: a few small
    kernels)."""
    state = triton_prepare(q, k, v, start, limit, position_ids, window, tile_q or None)
    do = _aligned(grad_out.to(out.dtype))
    delta = triton_delta(out, do)
    dlse = zreg_lse_grad(lse, coeff, grad_lse)
    if dlse is not None:
        delta = delta - dlse.float()
    dq, dk, dv = triton_backward(state, do, lse, delta)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_OP = IntervalAttentionOp("triton_attention", _forward, _backward, out_dtype=_compute_dtype,
                          lse_dtype=lambda dtype: torch.float32)


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    limit: torch.Tensor,
    *,
    zreg_coeff: float = 0.0,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused Triton attention; returns ``(out [B, H, T, D] in q.dtype, lse [B, H, T] fp32)``.

    Semantics as :func:`megatron_cai.core.transformer.attention.attend`. Tiles, warps and stages come
    from :data:`kernel_configs.ATTENTION_TABLE` for the device's shared memory (16 x 16 under the
    interpreter); ``block`` forces square tiles (tests only). Runs as the custom ops
    ``megatron_cai::triton_attention_fwd`` / ``_bwd`` (one node under ``torch.compile``).
    """
    return _OP(q, k, v, start, limit, position_ids, window, zreg_coeff, block or 0, block or 0)

"""Block-skipping attention over visibility intervals, in plain torch (the CPU default backend).

Queries are processed in blocks of ``block_q`` rows. For each query block the key blocks that may
hold a visible pair come from per-block min/max summaries (:func:`attention_tiling.block_map`); only those
keys are gathered (a slice when they are contiguous), and the element mask is built only when a
tile is partial. Memory is O(heads * block_q * visible_keys) per step, never a T x T mask. The
backward is flash-style: it recomputes each block's probabilities from the saved lse and shifts
``D_i = rowsum(dO * O)`` by the lse gradient (Z-Reg: ``2 w lse_i / N``, see :mod:`zreg`).
"""
from __future__ import annotations

import math

import torch

from megatron_cai.core.transformer import attention_tiling
from megatron_cai.core.transformer.attention_ops import IntervalAttentionOp
from megatron_cai.core.transformer.zreg import zreg_lse_grad

__all__ = ["blocked_attention", "blocked_backward", "blocked_forward", "blocked_prepare"]


class _Plan:
    """Per (batch row, query block): the key token positions to gather and whether masking is needed.

    Query rows are local (0..seq_q-1); they sit at absolute positions ``offset + row``.
    """

    def __init__(self, start, limit, window, position_ids, block_q: int, block_k: int, seq_q: int):
        seq = start.shape[-1]
        self.offset = seq - seq_q
        any_, full = attention_tiling.block_map(start, limit, block_q, block_k, window, position_ids, seq_q)
        any_l, full_l = any_.cpu().tolist(), full.cpu().tolist()
        self.steps: list[list[tuple]] = []
        for b in range(start.shape[0]):
            row = []
            for qb, flags in enumerate(any_l[b]):
                qs, qe = qb * block_q, min(seq_q, (qb + 1) * block_q)
                kbs = [kb for kb, f in enumerate(flags) if f]
                if not kbs:
                    row.append((qs, qe, None, False))
                    continue
                needs_mask = not all(full_l[b][qb][kb] for kb in kbs)
                if kbs[-1] - kbs[0] + 1 == len(kbs):
                    keys = slice(kbs[0] * block_k, min(seq, (kbs[-1] + 1) * block_k))
                else:
                    idx = torch.tensor(kbs, dtype=torch.int64).view(-1, 1) * block_k + torch.arange(block_k)
                    idx = idx.flatten()
                    keys = idx[idx < seq].to(start.device)
                row.append((qs, qe, keys, needs_mask))
            self.steps.append(row)


def _tile_mask(start_b, limit_b, pos_b, window, qs: int, qe: int, keys) -> torch.Tensor:
    """Bool [qe - qs, n_keys] visibility of the gathered keys from absolute query positions qs..qe-1."""
    qi = torch.arange(qs, qe, device=start_b.device).view(-1, 1)
    s, lim = start_b[keys].view(1, -1), limit_b[keys].view(1, -1)
    mask = (s <= qi) & (qi < lim)
    if window is not None:
        mask &= (pos_b[qs:qe].view(-1, 1) - pos_b[keys].view(1, -1)).abs() < window
    return mask


def _gather(x_b: torch.Tensor, keys) -> torch.Tensor:
    """x_b [kv_heads, T, D] -> [kv_heads, n_keys, D] (a view for a slice)."""
    return x_b[:, keys] if isinstance(keys, slice) else x_b.index_select(1, keys)


def _q_block(x_b: torch.Tensor, qs: int, qe: int, kv_heads: int) -> torch.Tensor:
    """x_b [heads, T, D] rows qs..qe-1 -> [kv_heads, group * rows, D] (GQA groups stacked)."""
    h, _, d = x_b.shape
    return x_b[:, qs:qe].reshape(kv_heads, (h // kv_heads) * (qe - qs), d)


def _tile(state, b: int, qs: int, qe: int, keys, needs_mask: bool):
    """Scores ``[kv_heads, group * rows, n_keys]`` of batch row b's query rows qs..qe-1 against the gathered
    keys (scaled; invisible pairs at -inf when the tile is partial), with the query block and the gathered
    K and V."""
    qf, kf, vf, start, limit, pos, window, plan = state
    kv_heads = kf.shape[1]
    group = qf.shape[1] // kv_heads
    kb, vb = _gather(kf[b], keys), _gather(vf[b], keys)
    qb = _q_block(qf[b], qs, qe, kv_heads)
    s = torch.matmul(qb, kb.transpose(1, 2)).mul_(1.0 / math.sqrt(qf.shape[-1]))
    if needs_mask:
        pos_b = pos[b] if pos is not None else None
        mask = _tile_mask(start[b], limit[b], pos_b, window, qs + plan.offset, qe + plan.offset, keys)
        s.view(kv_heads, group, qe - qs, -1).masked_fill_(~mask, float("-inf"))
    return s, qb, kb, vb


def _tiles(state):
    """Every query block with keys to visit, as ``(b, qs, qe, keys, scores, q block, K, V)`` (:func:`_tile`)."""
    for b, row in enumerate(state[-1].steps):
        for qs, qe, keys, needs_mask in row:
            if keys is not None:
                yield (b, qs, qe, keys, *_tile(state, b, qs, qe, keys, needs_mask))


def blocked_prepare(q, k, v, start, limit, position_ids, window, block_q: int, block_k: int):
    """The tiling of one call (which key tiles each query block visits) and its inputs in the compute
    dtype (fp32, fp64 for fp64 inputs): the ``state`` that :func:`blocked_forward` and
    :func:`blocked_backward` run on."""
    cd = _compute_dtype(q.dtype)
    pos = attention_tiling.key_positions(start, position_ids) if window is not None else None
    plan = _Plan(start, limit, window, pos, block_q, block_k, q.shape[2])
    return q.to(cd), k.to(cd), v.to(cd), start, limit, pos, window, plan


def blocked_forward(q, k, v, start, limit, position_ids, window, block_q: int, block_k: int):
    """Forward over the tiles that may hold visible pairs: ``(out, lse, state)`` in the compute dtype;
    ``state`` (:func:`blocked_prepare`) is what :func:`blocked_backward` needs besides the gradients."""
    state = blocked_prepare(q, k, v, start, limit, position_ids, window, block_q, block_k)
    qf = state[0]
    bsz, heads, seq_q, dim = q.shape
    out = torch.zeros(bsz, heads, seq_q, dim, dtype=qf.dtype, device=q.device)
    lse = torch.full((bsz, heads, seq_q), float("-inf"), dtype=qf.dtype, device=q.device)
    for b, qs, qe, _, s, _, _, vb in _tiles(state):
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = s.sub_(m).exp_()
        z = p.sum(-1, keepdim=True)
        o = torch.matmul(p, vb).div_(torch.where(z > 0, z, torch.ones_like(z)))
        out[b, :, qs:qe] = o.view(heads, qe - qs, dim)
        lse[b, :, qs:qe] = (z.log() + m).view(heads, qe - qs)
    return out, lse, state


def blocked_backward(state, grad_out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor):
    """``(dq, dk, dv)`` in the compute dtype for the tiles of :func:`blocked_forward`'s ``state``.

    ``lse`` normalises the probabilities (``P = exp(S - lse)``) and ``delta`` is ``D_i`` of
    ``dS = P * (dP - D)``: this call's own, or those of a softmax merged over several key sets
    (context parallelism), so that each set's gradients are the exact share of the merged attention."""
    qf, kf, vf = state[0], state[1], state[2]
    bsz, heads, seq_q, dim = qf.shape
    kv_heads = kf.shape[1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim)
    cd = qf.dtype
    do = grad_out.to(cd)
    delta = delta.to(cd)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(cd)
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
    for b, qs, qe, keys, s, qb, kb, vb in _tiles(state):
        rows = qe - qs
        dob = _q_block(do[b], qs, qe, kv_heads)
        p = s.sub_(lse_safe[b, :, qs:qe].reshape(kv_heads, group * rows, 1)).exp_()
        dvb = torch.matmul(p.transpose(1, 2), dob)
        dp = torch.matmul(dob, vb.transpose(1, 2))
        ds = p.mul_(dp.sub_(delta[b, :, qs:qe].reshape(kv_heads, group * rows, 1))).mul_(scale)
        dq[b, :, qs:qe] = torch.matmul(ds, kb).view(heads, rows, dim)
        dkb = torch.matmul(ds.transpose(1, 2), qb)
        if isinstance(keys, slice):
            dk[b, :, keys] += dkb
            dv[b, :, keys] += dvb
        else:
            dk[b].index_add_(1, keys, dkb)
            dv[b].index_add_(1, keys, dvb)
    return dq, dk, dv


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward(q, k, v, start, limit, position_ids, window, block_q, block_k):
    """``(out, lse)`` in the compute dtype (the custom op's forward)."""
    out, lse, _ = blocked_forward(q, k, v, start, limit, position_ids, window, block_q, block_k)
    return out, lse


def _backward(grad_out, grad_lse, q, k, v, out, lse, start, limit, position_ids, window, coeff, block_q, block_k):
    """``(dq, dk, dv)`` in the input dtypes (the custom op's backward; the tiling is planned again)."""
    state = blocked_prepare(q, k, v, start, limit, position_ids, window, block_q, block_k)
    delta = (grad_out.to(out.dtype) * out).sum(-1)  # D_i
    dlse = zreg_lse_grad(lse, coeff, grad_lse)
    if dlse is not None:
        delta = delta - dlse.to(out.dtype)
    dq, dk, dv = blocked_backward(state, grad_out, lse, delta)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_OP = IntervalAttentionOp("blocked_attention", _forward, _backward, out_dtype=_compute_dtype,
                          lse_dtype=_compute_dtype)


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    limit: torch.Tensor,
    *,
    zreg_coeff: float = 0.0,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-skipping attention; returns ``(out [B, H, T, D] in q.dtype, lse [B, H, T] fp32)``.

    Shapes and semantics as :func:`megatron_cai.core.transformer.attention.attend`. Runs as the custom
    ops ``megatron_cai::blocked_attention_fwd`` / ``_bwd`` (one node under ``torch.compile``).
    """
    return _OP(q, k, v, start, limit, position_ids, window, zreg_coeff, block_q, block_k)

"""Attention tiling over visibility intervals: the kernel-side views of ``(start, limit)``.

:func:`dense_mask` (the O(T^2) reference), :func:`key_positions`, and the block summaries
:func:`block_map` / :func:`block_indices` that the blocked, Flex and Triton backends use to skip tiles
without visible pairs, from per-block min/max of start/limit (and positions with a window): the fast
paths never evaluate T x T pairs. Semantics: :mod:`megatron_cai.core.transformer.visibility`.
"""
from __future__ import annotations

import torch

__all__ = ["block_indices", "block_map", "dense_mask", "key_positions"]


def dense_mask(
    start: torch.Tensor,
    limit: torch.Tensor,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask ``[..., num_queries, seq]`` (True = visible) from the intervals; O(T x T) memory.

    ``queries`` selects query positions (default all). Reference and small-block use only.
    """
    seq = start.shape[-1]
    qi = torch.arange(seq, device=start.device) if queries is None else queries.to(start.device)
    s, lim = start.unsqueeze(-2), limit.unsqueeze(-2)
    q = qi.view(-1, 1)
    mask = (s <= q) & (q < lim)
    if window is not None:
        pos = key_positions(start, position_ids)
        diff = pos[..., qi].unsqueeze(-1) - pos.unsqueeze(-2)
        mask &= diff.abs() < window
    return mask


def key_positions(start: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Logical positions per token, ``[..., seq]`` like ``start`` (default 0..seq-1): what a window measures."""
    if position_ids is None:
        return torch.arange(start.shape[-1], device=start.device).expand(start.shape)
    if position_ids.shape[-1] != start.shape[-1]:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not match seq_len {start.shape[-1]}")
    return position_ids.expand(start.shape)


def _block_reduce(x: torch.Tensor, block: int, op: str, fill: int) -> torch.Tensor:
    """Per-block min or max over the last dim (padded with ``fill``): [..., ceil(T / block)]."""
    seq = x.shape[-1]
    nb = -(-seq // block)
    padded = torch.nn.functional.pad(x.to(torch.int64), (0, nb * block - seq), value=fill)
    blocks = padded.view(*x.shape[:-1], nb, block)
    return blocks.amin(-1) if op == "min" else blocks.amax(-1)


def block_map(
    start: torch.Tensor,
    limit: torch.Tensor,
    block_q: int,
    block_k: int,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    num_queries: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query block, key block) tiles may hold a visible pair, and which are fully visible.

    ``start``/``limit`` are ``[batch, seq]``. The queries are the last ``num_queries`` positions
    (default all ``seq``; fewer when decoding past a cache), tiled from the first of them.
    Returns bool ``(any, full)`` of shape
    ``[batch, ceil(num_queries / block_q), ceil(T / block_k)]`` computed from per-key-block min/max of
    start/limit (and per-block min/max of positions with a window): O(T / block) work per tile row,
    never a T x T evaluation. ``any`` is conservative (it may flag a tile without visible pairs),
    ``full`` is exact-safe (every pair of a full tile is visible; the tiles at the ragged end count
    only their in-range pairs).
    """
    seq = start.shape[-1]
    big = 1 << 40
    min_s = _block_reduce(start, block_k, "min", big)
    max_s = _block_reduce(start, block_k, "max", -big)
    min_l = _block_reduce(limit, block_k, "min", big)
    max_l = _block_reduce(limit, block_k, "max", -big)
    n_queries = seq if num_queries is None else num_queries
    offset = seq - n_queries
    if not 0 <= offset <= seq:
        raise ValueError(f"num_queries ({num_queries}) must be in [0, seq_len={seq}]")
    nq = -(-n_queries // block_q)
    qs = torch.arange(nq, device=start.device, dtype=torch.int64) * block_q + offset
    qe = torch.clamp(qs + block_q, max=seq)  # exclusive, absolute positions
    qs_, qe_ = qs.view(-1, 1), qe.view(-1, 1)
    ms, xs = min_s.unsqueeze(-2), max_s.unsqueeze(-2)
    ml, xl = min_l.unsqueeze(-2), max_l.unsqueeze(-2)
    any_ = (ms < qe_) & (xl > qs_)
    full = (xs <= qs_) & (ml >= qe_)
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        pos = key_positions(start, position_ids)
        kmin = _block_reduce(pos, block_k, "min", big).unsqueeze(-2)
        kmax = _block_reduce(pos, block_k, "max", -big).unsqueeze(-2)
        qmin = _block_reduce(pos[..., offset:], block_q, "min", big).unsqueeze(-1)
        qmax = _block_reduce(pos[..., offset:], block_q, "max", -big).unsqueeze(-1)
        # diff = pos_q - pos_k ranges over [qmin - kmax, qmax - kmin]; visible needs |diff| < window.
        any_ &= (qmin - kmax < window) & (qmax - kmin > -window)
        full &= (qmax - kmin < window) & (kmax - qmin < window)
    return any_, full & any_


def block_indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact a bool tile map ``[..., n_rows, n_cols]`` into ``(count [..., n_rows] int32,
    indices [..., n_rows, n_cols] int32)``: the flagged columns first, in increasing order."""
    n_cols = tiles.shape[-1]
    cols = torch.arange(n_cols, device=tiles.device, dtype=torch.int64)
    key = torch.where(tiles, cols, cols + n_cols)
    indices = torch.sort(key, dim=-1).values % n_cols
    return tiles.sum(-1).to(torch.int32), indices.to(torch.int32)

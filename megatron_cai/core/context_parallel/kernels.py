"""Per-chunk attention kernels for context parallelism: one key set at a time, backward with given lse/delta.

Context-parallel attention runs the local queries against several key sets (this rank's keys, then the
keys received from each peer) and merges the partial results by log-sum-exp. The forward of one key set
is an ordinary attention call; its backward needs the *merged* softmax's ``lse`` and
``D_i = rowsum(dO_i * O_i) - dlse_i`` so that every key set gets its exact share of the gradient. The
blocked (CPU) and Triton (CUDA) launchers expose exactly that split (``*_forward`` / ``*_backward``); the
``eager`` kernel is the same contract over a dense mask (O(queries x keys) memory; small sizes only), and the
one that takes attention dropout: a ``[B, H, Sq, Sk]`` keep scale (0 or ``1 / (1 - p)``) on the probabilities,
with lse that of the undropped softmax (so the key sets still merge by lse, and ``D_i = rowsum(dO_i * O_i)``
of the dropped output is still the softmax backward's row term).

Key sets follow the kernels' convention: queries are the last ``seq_q`` of the ``seq_k`` key positions
and query row r (absolute position ``seq_k - seq_q + r``) sees key j iff ``start[j] <= seq_k - seq_q + r
< limit[j]`` (and the window on ``position_ids``). :mod:`.plan` builds such intervals for every key set.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch

from ..transformer import attention_tiling

__all__ = ["CHUNK_BACKENDS", "ChunkAttention", "chunk_attention"]

CHUNK_BACKENDS = ("eager", "blocked", "triton")


class ChunkAttention(Protocol):
    """One key set's attention for the local queries."""

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, H, Sq, D], lse [B, H, Sq])`` over this key set alone, in the kernel's compute dtype
        (lse at least fp32)."""
        ...

    def backward(self, grad_out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` of this key set's share, for the merged ``lse`` and ``delta``."""
        ...


class _Blocked:
    def __init__(self, q, k, v, start, limit, window, position_ids, block: int) -> None:
        self.args = (q, k, v, start, limit, position_ids, window, block, block)
        self.state = None

    def forward(self):
        from ..transformer.blocked_attention import blocked_forward

        out, lse, self.state = blocked_forward(*self.args)
        return out, lse

    def backward(self, grad_out, lse, delta):
        from ..transformer.blocked_attention import blocked_backward, blocked_prepare

        if self.state is None:  # the backward of a key set whose forward ran in another call
            self.state = blocked_prepare(*self.args)
        return blocked_backward(self.state, grad_out, lse, delta)


class _Triton:
    def __init__(self, q, k, v, start, limit, window, position_ids, block: int | None) -> None:
        self.args = (q, k, v, start, limit, position_ids, window, block)
        self.state = None

    def forward(self):
        from ..transformer.triton_attention import triton_forward

        out, lse, self.state = triton_forward(*self.args)
        return out, lse

    def backward(self, grad_out, lse, delta):
        from ..transformer.triton_attention import triton_backward, triton_prepare

        if self.state is None:
            self.state = triton_prepare(*self.args)
        return triton_backward(self.state, grad_out, lse, delta)


class _Eager:
    """Dense reference: explicit scores and mask for this key set (fp32, fp64 for fp64 inputs); ``dropout``: the
    keep scale on the probabilities (None: no dropout)."""

    def __init__(self, q, k, v, start, limit, window, position_ids, dropout: torch.Tensor | None = None) -> None:
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.group = q.shape[1] // k.shape[1]
        self.q, self.k, self.v = q.to(cd), k.to(cd), v.to(cd)
        seq_k, seq_q = k.shape[2], q.shape[2]
        queries = torch.arange(seq_k - seq_q, seq_k, device=q.device)
        self.mask = attention_tiling.dense_mask(start, limit, window, position_ids, queries=queries).unsqueeze(1)
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        self.dropout = None if dropout is None else dropout.to(cd)

    def _scores(self) -> torch.Tensor:
        k = self.k.repeat_interleave(self.group, dim=1)
        s = torch.matmul(self.q, k.transpose(-1, -2)) * self.scale
        return s.masked_fill(~self.mask, float("-inf"))

    def forward(self):
        s = self._scores()
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
        if self.dropout is not None:
            p = p * self.dropout
        out = torch.matmul(p, self.v.repeat_interleave(self.group, dim=1))
        return out, lse

    def backward(self, grad_out, lse, delta):
        cd = self.q.dtype
        lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(cd)
        p = torch.exp(self._scores() - lse_safe.unsqueeze(-1))
        do = grad_out.to(cd)
        v = self.v.repeat_interleave(self.group, dim=1)
        dp = torch.matmul(do, v.transpose(-1, -2))
        kept = p
        if self.dropout is not None:  # out = (P * M) V: dV = (P * M)^T dO, dP = M * (dO V^T)
            kept, dp = p * self.dropout, dp * self.dropout
        ds = p * (dp - delta.to(cd).unsqueeze(-1)) * self.scale
        dq = torch.matmul(ds, self.k.repeat_interleave(self.group, dim=1))
        dk = torch.matmul(ds.transpose(-1, -2), self.q)
        dv = torch.matmul(kept.transpose(-1, -2), do)
        b, h, t, d = dk.shape
        fold = (b, h // self.group, self.group, t, d)
        return dq, dk.view(fold).sum(2), dv.view(fold).sum(2)


def chunk_attention(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
                    limit: torch.Tensor, *, window: int | None = None, position_ids: torch.Tensor | None = None,
                    block: int | None = None, dropout: torch.Tensor | None = None) -> ChunkAttention:
    """The per-chunk kernel ``backend`` names (:data:`CHUNK_BACKENDS`); shapes as ``attention.attend``.
    ``dropout`` (the keep scale ``[B, H, Sq, Sk]``) runs the eager kernel whatever ``backend`` says."""
    if dropout is not None:
        return _Eager(q, k, v, start, limit, window, position_ids, dropout)
    if backend == "blocked":
        return _Blocked(q, k, v, start, limit, window, position_ids, block or 128)
    if backend == "triton":
        return _Triton(q, k, v, start, limit, window, position_ids, block)
    if backend == "eager":
        return _Eager(q, k, v, start, limit, window, position_ids)
    raise ValueError(f"context parallelism runs the attention backends {CHUNK_BACKENDS}, not {backend!r}")

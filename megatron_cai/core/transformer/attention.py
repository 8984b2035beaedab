"""Attention over visibility intervals: one interface, four backends.

``attend(q, k, v, start, limit, ...)`` with key-side visibility (query i sees key j iff
``start[b, j] <= i < limit[b, j]``, see :mod:`visibility`):

- ``eager``: fp32 (fp64 for fp64 inputs) reference with an explicit T x T mask and explicit lse;
- ``blocked``: block-skipping torch path, O(T * block) memory, flash-style backward (CPU default);
- ``flex``: FlexAttention with a ``BlockMask`` built from per-block interval summaries (CUDA; its
  forward also runs, unfused, on CPU);
- ``triton``: fused flash-attention forward/backward kernels taking the intervals (CUDA, or the
  Triton interpreter with ``TRITON_INTERPRET=1``).

``backend=None`` picks ``triton`` on CUDA (``flex`` when Triton is missing) and ``blocked`` elsewhere.
"""
from __future__ import annotations

import functools
import math
from typing import Protocol, runtime_checkable

import torch

from megatron_cai.core.transformer import attention_tiling
from megatron_cai.core.transformer.blocked_attention import blocked_attention
from megatron_cai.core.transformer.zreg import inject_zreg

__all__ = ["ALIASES", "BACKENDS", "SplitSequenceAttention", "attend", "default_backend", "eager_attention",
           "flex_attention_intervals"]

BACKENDS = ("eager", "blocked", "flex", "triton")
ALIASES = {"cpu": "blocked"}
FLEX_BLOCK = 128


@runtime_checkable
class SplitSequenceAttention(Protocol):
    """The visibility of a sequence split over ranks (context parallelism: ``core.context_parallel``'s
    ``ContextParallelVisibility``). An attention layer hands it this rank's q, k, v and gets the attention
    of its queries over every key of the sequence they can see: ``(out in q.dtype, lse fp32)``."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str, zreg_coeff: float = 0.0,
               window: int | None = None, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]: ...


def default_backend(device: torch.device) -> str:
    """``triton`` on CUDA when Triton imports, else ``flex`` on CUDA, else ``blocked``."""
    if torch.device(device).type != "cuda":
        return "blocked"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "flex"
    return "triton"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    limit: torch.Tensor,
    *,
    zreg_coeff: float = 0.0,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention where query i sees key j iff ``start[b, j] <= i < limit[b, j]``.

    Args:
        q: ``[batch, heads, seq_q, head_dim]``; k, v: ``[batch, kv_heads, seq, head_dim]`` with
            ``heads % kv_heads == 0`` (GQA; ``kv_heads == 1`` is MQA). Softmax scale 1/sqrt(head_dim).
            Usually ``seq_q == seq``; with a KV cache q may hold only the last ``seq_q < seq``
            positions: query row r is position ``seq - seq_q + r``.
        start, limit: int ``[batch, seq]`` key-side visibility intervals (see :mod:`visibility`);
            a limit past ``seq`` (e.g. "visible to all future tokens") acts as ``seq``.
        zreg_coeff: Attention Z-Reg weight w. The virtual term is
            ``Omega = w * mean over (batch, heads, query rows that see at least one key) of lse_i^2``
            with ``lse_i = log sum_{j visible} exp(q_i . k_j / sqrt(head_dim))``. Its gradient
            ``dOmega/ds_ij = 2 w lse_i P_ij / N`` is injected in backward; the forward output is
            unchanged and Omega is never part of any returned value. ``w = 0`` is exactly no Z-Reg.
            The mean is per call; scale w like the main loss under gradient accumulation.
        window: optional sliding window W on ``position_ids``: additionally ``|pos_i - pos_j| < W``.
        position_ids: ``[batch, seq]`` (or ``[seq]``) logical positions of the keys (the queries
            take the last ``seq_q``) for the window; default 0..seq-1.
        backend: one of :data:`BACKENDS` (``"cpu"`` is an alias of ``"blocked"``), or None for
            :func:`default_backend`.
        return_lse: also return lse ``[batch, heads, seq_q]`` fp32 (differentiable; for logging).
        dropout_p: attention dropout on the probabilities (training). Any ``dropout_p > 0`` runs the
            ``eager`` dense-mask path (O(T^2) memory) whatever ``backend`` says; Z-Reg composes with it
            (lse and its gradient are those of the undropped softmax).

    Fully masked query rows (possible only with intervals that fail :func:`visibility_layouts.validate`)
    give output 0 and lse ``-inf``, are excluded from N and produce no NaN in forward or backward.
    """
    _check_shapes(q, k, v, start, limit, position_ids)
    if position_ids is not None and position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0).expand(q.shape[0], -1)
    backend = default_backend(q.device) if backend is None else ALIASES.get(backend, backend)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS} or None")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if backend == "eager" or dropout_p > 0:
        out, lse = eager_attention(q, k, v, start, limit, window=window, position_ids=position_ids,
                                   dropout_p=dropout_p)
        out, lse = inject_zreg(out, lse, zreg_coeff)
        lse = lse.float()
    elif backend == "blocked":
        out, lse = blocked_attention(
            q, k, v, start, limit, zreg_coeff=zreg_coeff, window=window, position_ids=position_ids
        )
    elif backend == "flex":
        out, lse = flex_attention_intervals(q, k, v, start, limit, window=window, position_ids=position_ids)
        out, lse = inject_zreg(out, lse, zreg_coeff)
    else:  # triton
        from megatron_cai.core.transformer.triton_attention import triton_attention

        out, lse = triton_attention(
            q, k, v, start, limit, zreg_coeff=zreg_coeff, window=window, position_ids=position_ids
        )
    return (out, lse) if return_lse else out


def _check_shapes(q, k, v, start, limit, position_ids) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [batch, heads, seq, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    bsz, heads, seq_q, dim = q.shape
    seq = k.shape[2]
    if k.shape != v.shape or k.shape[0] != bsz or k.shape[3] != dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [{bsz}, kv_heads, seq, {dim}]")
    if seq_q > seq:
        raise ValueError(f"q has {seq_q} positions but k/v only {seq}: q must be the last seq_q <= seq")
    if heads % k.shape[1] != 0:
        raise ValueError(f"kv_heads ({k.shape[1]}) must divide heads ({heads})")
    for name, t in (("visibility_start", start), ("visibility_limit", limit)):
        if tuple(t.shape) != (bsz, seq):
            raise ValueError(f"{name} must be [batch, seq] = [{bsz}, {seq}], got {tuple(t.shape)}")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if position_ids is not None and position_ids.shape[-1] != seq:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must end in seq = {seq}")


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    limit: torch.Tensor,
    *,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: dense fp32 (fp64 for fp64 inputs) mask and softmax; returns ``(out, lse)``, lse in
    the compute dtype.

    Autograd flows through both outputs; masked rows have output 0, lse -inf and zero gradients.
    ``dropout_p > 0`` drops attention probabilities (scaling the rest by 1 / (1 - p)); lse is unchanged.
    """
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    qf = q.to(cd)
    kf = k.to(cd).repeat_interleave(group, dim=1)
    vf = v.to(cd).repeat_interleave(group, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    seq = k.shape[2]
    queries = torch.arange(seq - q.shape[2], seq, device=q.device)
    mask = attention_tiling.dense_mask(start, limit, window, position_ids, queries=queries).unsqueeze(1)
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    seen = z > 0
    z_safe = torch.where(seen, z, torch.ones_like(z))
    p = e / z_safe
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p, training=True)
    out = torch.matmul(p, vf)
    lse = torch.where(seen, torch.log(z_safe) + m, torch.full_like(z, float("-inf"))).squeeze(-1)
    return out.to(q.dtype), lse


def flex_block_mask(
    start: torch.Tensor,
    limit: torch.Tensor,
    *,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    block_size: int = FLEX_BLOCK,
    num_queries: int | None = None,
):
    """A FlexAttention ``BlockMask`` from per-block min/max of the intervals (O(T / block) per tile row).

    Full tiles skip the element mask; partial tiles evaluate ``mask_mod`` on their own pairs only.
    """
    from torch.nn.attention.flex_attention import BlockMask

    seq = start.shape[-1]
    n_q = seq if num_queries is None else num_queries
    offset = seq - n_q
    any_, full = attention_tiling.block_map(start, limit, block_size, block_size, window, position_ids, n_q)
    kv_num, kv_idx = attention_tiling.block_indices(any_ & ~full)
    full_num, full_idx = attention_tiling.block_indices(full)
    start_l, limit_l = start.long(), limit.long()
    pos = attention_tiling.key_positions(start, position_ids).long() if window is not None else None

    def mask_mod(b, h, q_idx, kv_idx):
        qa = q_idx + offset
        vis = (start_l[b, kv_idx] <= qa) & (qa < limit_l[b, kv_idx])
        if pos is not None:
            vis = vis & ((pos[b, qa] - pos[b, kv_idx]).abs() < window)
        return vis

    return BlockMask.from_kv_blocks(
        kv_num.unsqueeze(1),
        kv_idx.unsqueeze(1),
        full_num.unsqueeze(1),
        full_idx.unsqueeze(1),
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(n_q, seq),
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_intervals(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    limit: torch.Tensor,
    *,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention with the interval BlockMask; returns ``(out, lse fp32)`` (lse differentiable on CUDA).

    On CPU, torch runs flex unfused and forward-only (inputs must not require grad).
    """
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    block_mask = flex_block_mask(start, limit, window=window, position_ids=position_ids,
                                 num_queries=q.shape[2])
    fn = _compiled_flex() if q.is_cuda else flex_attention
    out, aux = fn(
        q,
        k,
        v,
        block_mask=block_mask,
        scale=1.0 / math.sqrt(q.shape[-1]),
        enable_gqa=q.shape[1] != k.shape[1],
        return_aux=AuxRequest(lse=True),
    )
    return out, aux.lse.float()

"""Gumbel-top-k teacher sampling and the priority-sampling (Horvitz-Thompson) estimator.

Sampling. For a row of teacher logits ``l`` and temperature ``tau`` the teacher distribution is
``p = softmax(l / tau)``. Draw ``G_v ~ Gumbel(0, 1)`` i.i.d. and form keys ``g_v = l_v / tau + G_v``; the
``k`` largest keys are an exact sample of ``k`` tokens from ``p`` *without replacement* (Vieira 2014; Kool,
van Hoof & Welling 2019). We keep, per row: the ``k`` ids (in decreasing key order), the raw teacher logits
at those ids (not divided by ``tau``), ``kappa`` = the ``(k+1)``-th largest key and ``lse`` =
``logsumexp(l / tau)``.

Estimator. Conditioned on ``kappa``, token ``v`` is in the sample iff ``g_v > kappa``, which happens with
probability ``q_v(kappa) = 1 - exp(-exp(l_v / tau - kappa))``. Priority sampling (Duffield et al. 2007;
Kool et al. 2020) gives the weights ``w_v = p_v / q_v(kappa)`` for the sampled ``v``, and
``sum_{v in S} w_v f(v)`` is an unbiased estimate of ``E_p[f]`` for every ``f``. The self-normalised
variant ``w / sum(w)`` has lower variance and a small bias; the deterministic top-k baseline (renormalised
teacher probabilities over the ``k`` most likely ids) is biased and kept only for comparison.

When ``k >= V`` every token is kept, ``kappa = -inf``, ``q = 1`` and ``w = p``: the estimate is exact.
Tokens with zero teacher probability (``-inf`` logits) always get weight 0, so with ``k`` at least the
support size the estimate is exact as well.

Randomness. ``generator=`` uses torch's RNG (reproducible for the same device type and call sequence).
:func:`counter_gumbel` is a counter-based alternative: the noise of (row key, token id) is a fixed hash of
``(seed, row key, token id)``: the same random bits on any device (CPU and GPU agree up to the rounding
of an elementwise log) and independent of batching, vocab sharding and world size, so a teacher dump can
recompute any shard exactly.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = [
    "ESTIMATORS",
    "counter_gumbel",
    "estimator_weights",
    "gumbel_noise",
    "gumbel_topk",
    "priority_weights",
    "self_normalized_weights",
    "topk_select",
    "topk_weights",
    "vocab_parallel_gumbel_topk",
]

ESTIMATORS = ("priority", "self-normalized", "topk")

_MASK32 = 0xFFFFFFFF


def gumbel_noise(shape: torch.Size | tuple[int, ...], *, generator: torch.Generator | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Standard Gumbel(0, 1) noise in fp32 from torch's RNG (``-log(E)``, ``E ~ Exp(1)``)."""
    if generator is not None and device is None:
        device = generator.device
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    # u in [0, 1): E = -log1p(-u) is in [0, inf) and exact near u = 0; clamp away E = 0 (G = +inf).
    e = (-torch.log1p(-u)).clamp_min_(torch.finfo(torch.float32).tiny)
    return -torch.log(e)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without signed overflow."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (Wellons' lowbias32) on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def _hash_rows(seed: int, rows: torch.Tensor) -> torch.Tensor:
    rows = rows.to(torch.int64)
    s = torch.tensor([seed & _MASK32, (seed >> 32) & _MASK32], dtype=torch.int64, device=rows.device)
    h = _mix32((rows & _MASK32) ^ _mix32(s[0] ^ 0x9E3779B9))
    h = _mix32(h ^ ((rows >> 32) & _MASK32) ^ _mix32(s[1] ^ 0x85EBCA6B))
    return h


def counter_gumbel(seed: int, rows: torch.Tensor, vocab_end: int, *, vocab_start: int = 0) -> torch.Tensor:
    """Counter-based Gumbel(0, 1) noise: ``out[..., j]`` depends only on (seed, rows[...], vocab_start + j).

    ``rows`` is an int64 tensor of row keys of shape ``[...]`` (e.g. ``sample_index * seq_length +
    position``, non-negative); the result is fp32 ``[..., vocab_end - vocab_start]`` on ``rows.device``.
    Uses 24 random bits per entry, so the noise is truncated to about [-2.85, 17.3] (each tail has
    probability ~3e-8).
    """
    if seed < 0:
        raise ValueError(f"counter_gumbel: seed must be non-negative, got {seed}")
    r = _hash_rows(seed, rows)
    cols = torch.arange(vocab_start, vocab_end, device=rows.device, dtype=torch.int64)
    c = _mix32((cols & _MASK32) ^ 0x27D4EB2F)
    h = _mix32(_mix32(r.unsqueeze(-1) ^ c) ^ (r.unsqueeze(-1) >> 3))
    m = (h >> 8).to(torch.float32)  # 24 bits: exactly representable in fp32
    # 1 - u with u = (m + 0.5) / 2**24, both exact; E = -log(u) computed accurately at both ends.
    one_minus_u = (2.0**24 - m - 0.5) * (2.0**-24)
    e = -torch.log1p(-one_minus_u)
    return -torch.log(e)


def _lse(logits: torch.Tensor, tau: float) -> torch.Tensor:
    return torch.logsumexp(logits.float() / tau, dim=-1)


def _check_tau(tau: float) -> None:
    if not tau > 0:
        raise ValueError(f"temperature tau must be > 0, got {tau}")


def gumbel_topk(logits: torch.Tensor, k: int, *, tau: float = 1.0, generator: torch.Generator | None = None,
                gumbel: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gumbel-top-k sample of ``k`` tokens without replacement over the last dim of ``logits`` [..., V].

    Returns ``(ids, teacher_logits, kappa, lse)``: ids int64 [..., k'] in decreasing key order, the raw
    logits at those ids [..., k'] (dtype of ``logits``), ``kappa`` the (k+1)-th largest key (fp32 [...],
    ``-inf`` when ``k >= V``) and ``lse = logsumexp(logits / tau)`` (fp32 [...]), where ``k' = min(k, V)``.
    ``gumbel`` (fp32 [..., V], e.g. from :func:`counter_gumbel`) overrides the noise from ``generator``.
    """
    _check_tau(tau)
    if k < 1:
        raise ValueError(f"gumbel_topk: k must be >= 1, got {k}")
    vocab = logits.shape[-1]
    if gumbel is None:
        gumbel = gumbel_noise(logits.shape, generator=generator, device=logits.device)
    elif gumbel.shape != logits.shape:
        raise ValueError(f"gumbel_topk: noise shape {tuple(gumbel.shape)} != logits shape "
                         f"{tuple(logits.shape)}")
    keys = logits.float() / tau + gumbel.to(device=logits.device, dtype=torch.float32)
    lse = _lse(logits, tau)
    if k >= vocab:
        top_keys, ids = torch.sort(keys, dim=-1, descending=True)
        kappa = torch.full(logits.shape[:-1], -math.inf, device=logits.device, dtype=torch.float32)
    else:
        top_keys, ids = torch.topk(keys, k + 1, dim=-1)
        kappa = top_keys[..., k].contiguous()
        ids = ids[..., :k].contiguous()
    return ids, torch.gather(logits, -1, ids), kappa, lse


def topk_select(logits: torch.Tensor, k: int, *, tau: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic top-k (the baseline), same outputs as :func:`gumbel_topk`.

    ``kappa`` is the (k+1)-th largest ``logit / tau`` (informational; the top-k estimator ignores it).
    """
    _check_tau(tau)
    vocab = logits.shape[-1]
    kk = min(k, vocab)
    scaled = logits.float() / tau
    top, ids = torch.topk(scaled, min(kk + 1, vocab), dim=-1)
    kappa = (top[..., kk].contiguous() if kk < vocab
             else torch.full(logits.shape[:-1], -math.inf, device=logits.device))
    ids = ids[..., :kk].contiguous()
    return ids, torch.gather(logits, -1, ids), kappa, _lse(logits, tau)


def _log_q(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(-exp(x))), stable for very negative x (where it is x - exp(x)/2 + ...)."""
    direct = torch.log(-torch.expm1(-torch.exp(x)))
    return torch.where(x < -20.0, x - 0.5 * torch.exp(x), direct)


def priority_weights(teacher_logits: torch.Tensor, kappa: torch.Tensor, lse: torch.Tensor, *,
                     tau: float = 1.0) -> torch.Tensor:
    """Unbiased priority-sampling weights ``w_v = p_v / q_v(kappa)`` (fp32 [..., k]).

    ``p_v = exp(teacher_logit_v / tau - lse)``, ``q_v = 1 - exp(-exp(teacher_logit_v / tau - kappa))``;
    ``q = 1`` where ``kappa = -inf`` and ``w = 0`` where ``p_v = 0``.
    """
    _check_tau(tau)
    s = teacher_logits.float() / tau
    log_p = s - lse.float().unsqueeze(-1)
    x = s - kappa.float().unsqueeze(-1)
    w = torch.exp(log_p - _log_q(x))
    return torch.where(torch.isneginf(s), torch.zeros_like(w), w)


def self_normalized_weights(teacher_logits: torch.Tensor, kappa: torch.Tensor, lse: torch.Tensor, *,
                            tau: float = 1.0) -> torch.Tensor:
    """Priority weights divided by their sum over the sample (consistent, small bias, lower variance)."""
    w = priority_weights(teacher_logits, kappa, lse, tau=tau)
    return w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def topk_weights(teacher_logits: torch.Tensor, *, tau: float = 1.0) -> torch.Tensor:
    """Top-k baseline: teacher probabilities renormalised over the kept ids, ``softmax(logits / tau)``."""
    _check_tau(tau)
    return torch.softmax(teacher_logits.float() / tau, dim=-1)


def estimator_weights(teacher_logits: torch.Tensor, kappa: torch.Tensor, lse: torch.Tensor, *,
                      estimator: str = "priority", tau: float = 1.0) -> torch.Tensor:
    """Weights of ``estimator`` in :data:`ESTIMATORS` ("priority" | "self-normalized" | "topk")."""
    if estimator == "priority":
        return priority_weights(teacher_logits, kappa, lse, tau=tau)
    if estimator == "self-normalized":
        return self_normalized_weights(teacher_logits, kappa, lse, tau=tau)
    if estimator == "topk":
        return topk_weights(teacher_logits, tau=tau)
    raise ValueError(f"unknown distillation estimator {estimator!r}; expected one of {ESTIMATORS}")


def _all_gather_last(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def vocab_parallel_gumbel_topk(logits_shard: torch.Tensor, k: int, *, group: dist.ProcessGroup | None = None,
                               tau: float = 1.0, vocab_size: int | None = None,
                               generator: torch.Generator | None = None, gumbel: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gumbel_topk` for logits sharded over the vocab across ``group`` (every rank gets the result).

    Rank r holds columns ``[r * V_local, (r + 1) * V_local)``. Columns ``>= vocab_size`` (vocab padding)
    are excluded. ``gumbel`` is the noise of the local columns (e.g. ``counter_gumbel(seed, rows,
    vocab_end, vocab_start=vocab_start)``, which makes the draw identical to the single-process one);
    with ``generator`` each rank must use a different stream. Requires ``k`` < the global vocabulary.
    """
    _check_tau(tau)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    v_local = logits_shard.shape[-1]
    start = rank * v_local
    total = vocab_size if vocab_size is not None else v_local * world
    if k >= total:
        raise ValueError(f"vocab_parallel_gumbel_topk: k={k} must be < vocabulary size {total}")
    if gumbel is None:
        gumbel = gumbel_noise(logits_shard.shape, generator=generator, device=logits_shard.device)
    scaled = logits_shard.float() / tau
    cols = torch.arange(start, start + v_local, device=logits_shard.device)
    scaled = scaled.masked_fill(cols >= total, -math.inf)
    keys = scaled + gumbel.to(device=logits_shard.device, dtype=torch.float32)
    m = min(k + 1, v_local)
    loc_keys, loc_idx = torch.topk(keys, m, dim=-1)
    loc_logits = torch.gather(logits_shard, -1, loc_idx).float()
    all_keys = _all_gather_last(loc_keys, group)
    all_ids = _all_gather_last(loc_idx + start, group)
    all_logits = _all_gather_last(loc_logits, group)
    top_keys, pos = torch.topk(all_keys, k + 1, dim=-1)
    ids = torch.gather(all_ids, -1, pos[..., :k])
    teacher_logits = torch.gather(all_logits, -1, pos[..., :k]).to(logits_shard.dtype)
    lse = _all_gather_last(torch.logsumexp(scaled, dim=-1, keepdim=True), group).logsumexp(-1)
    return ids, teacher_logits, top_keys[..., k].contiguous(), lse

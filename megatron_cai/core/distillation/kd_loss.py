"""Sparse-target distillation losses (single-process and vocab-parallel) and the full-KD reference.

Per position, with teacher distribution ``p = softmax(l_T / tau)`` and student distribution
``q_s = softmax(z / tau)`` over the student's *full* (possibly padded) vocabulary:

* full KD (reference): ``loss = -sum_v p_v log q_s(v)``, ``kl = sum_v p_v (log p_v - log q_s(v))``
* sparse KD: ``loss = -sum_{v in S} w_v log q_s(v)``, ``kl = sum_{v in S} w_v (log p_v - log q_s(v))``

with ``S`` the stored ids and ``w`` the weights of the chosen estimator (see :mod:`.gumbel`). With the
unbiased "priority" weights both sparse quantities are unbiased estimates of the full ones, and so is the
gradient ``d loss / d z = ((sum_S w) q_s - w_S) / tau`` (its expectation is ``(q_s - p) / tau``).
``loss`` is the cross-entropy form (the KL plus the teacher entropy, a constant); ``kl`` is a metric.

Temperature: the student logits are divided by the same ``tau`` as the teacher's (standard KD). No
``tau**2`` factor is applied; callers that want Hinton's gradient scaling multiply the loss themselves.
The weights of a stored sample are only valid for the temperature it was drawn at, so ``tau`` must equal
the store's ``tau``. Losses and metrics are fp32 per token (shape ``[...]``), zero where
``loss_mask == 0``; reduce them as the CE loss is reduced.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .gumbel import _check_tau, estimator_weights

__all__ = ["full_kd_loss", "sparse_kd_loss", "vocab_parallel_full_kd_loss", "vocab_parallel_sparse_kd_loss"]


def _apply_mask(loss_mask: torch.Tensor | None, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if loss_mask is None:
        return values
    m = loss_mask.to(torch.float32)
    return tuple(v * m for v in values)


def _teacher_log_p(teacher_logits: torch.Tensor, lse: torch.Tensor, tau: float) -> torch.Tensor:
    return teacher_logits.float() / tau - lse.float().unsqueeze(-1)


def _kl_metric(loss: torch.Tensor, w: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    # sum_S w (log p - log q_s) = loss + sum_S w log p; w = 0 where log p = -inf.
    wlogp = torch.where(w > 0, w * log_p, torch.zeros_like(w)).sum(-1)
    return loss.detach() + wlogp


def sparse_kd_loss(student_logits: torch.Tensor, ids: torch.Tensor, teacher_logits: torch.Tensor,
                   kappa: torch.Tensor, lse: torch.Tensor, *, estimator: str = "priority", tau: float = 1.0,
                   loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse KD from stored teacher samples; returns ``(loss_per_token, kl_per_token)`` (fp32 [...]).

    ``student_logits`` [..., V] (any float dtype, differentiable); ``ids`` [..., k] (< V); the teacher's
    ``teacher_logits`` [..., k], ``kappa`` and ``lse`` [...] as returned by
    :func:`~megatron_cai.core.distillation.gumbel.gumbel_topk` (or read from a teacher-sample store).
    """
    _check_tau(tau)
    w = estimator_weights(teacher_logits, kappa, lse, estimator=estimator, tau=tau).detach()
    z = student_logits.float() / tau
    student_lse = torch.logsumexp(z, dim=-1)
    z_s = torch.gather(z, -1, ids.long())
    loss = w.sum(-1) * student_lse - (w * z_s).sum(-1)
    kl = _kl_metric(loss, w, _teacher_log_p(teacher_logits, lse, tau))
    return _apply_mask(loss_mask, loss, kl)


def full_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float = 1.0, *,
                 loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-distribution KD (the online/full baseline); returns ``(loss_per_token, kl_per_token)``.

    ``teacher_logits`` [..., V] is treated as a constant (no gradient flows into the teacher).
    """
    _check_tau(tau)
    log_p = torch.log_softmax(teacher_logits.detach().float() / tau, dim=-1)
    p = log_p.exp()
    log_q = torch.log_softmax(student_logits.float() / tau, dim=-1)
    loss = -(p * log_q).sum(-1)
    kl = loss.detach() + torch.where(p > 0, p * log_p, torch.zeros_like(p)).sum(-1)
    return _apply_mask(loss_mask, loss, kl)


# ----------------------------------------------------------------------------------------------------------
# Vocab-parallel versions: logits sharded over the vocab, rank r of `group` holds [r*V_local, (r+1)*V_local).
# ----------------------------------------------------------------------------------------------------------

def _vocab_range(v_local: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    start = dist.get_rank(group) * v_local
    return start, start + v_local


def _softmax_shard(z: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Local part of the global softmax of ``z`` (fp32 [..., V_local]) and the global logsumexp [...]."""
    m = z.max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m.unsqueeze(-1))
    s = e.sum(-1)
    dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
    return e / s.unsqueeze(-1), torch.log(s) + m


class _VocabParallelSparseKD(torch.autograd.Function):
    """loss = (sum w) lse_s - sum_S w z_s / tau over vocab-sharded z; grad = ((sum w) q_s - w) / tau."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, tau: float,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        z = logits.float() / tau
        start, end = _vocab_range(z.shape[-1], group)
        softmax, lse_s = _softmax_shard(z, group)
        own = (ids >= start) & (ids < end)
        local_ids = torch.where(own, ids - start, torch.zeros_like(ids))
        z_s = torch.where(own, torch.gather(z, -1, local_ids), torch.zeros_like(w))
        dist.all_reduce(z_s, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(softmax, local_ids, torch.where(own, w, torch.zeros_like(w)), w.sum(-1))
        ctx.tau = tau
        ctx.in_dtype = logits.dtype
        return w.sum(-1) * lse_s - (w * z_s).sum(-1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        softmax, local_ids, w_own, w_sum = ctx.saved_tensors
        grad = softmax * w_sum.unsqueeze(-1)
        grad.scatter_add_(-1, local_ids, -w_own)
        grad.mul_((grad_out / ctx.tau).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_sparse_kd_loss(student_logits_shard: torch.Tensor, ids: torch.Tensor,
                                  teacher_logits: torch.Tensor, kappa: torch.Tensor, lse: torch.Tensor, *,
                                  group: dist.ProcessGroup | None = None, estimator: str = "priority",
                                  tau: float = 1.0, loss_mask: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_kd_loss` for student logits sharded over the vocab across the TP ``group``.

    ``student_logits_shard`` [..., V_local] holds global ids ``[rank * V_local, (rank + 1) * V_local)``;
    ``ids``/``teacher_logits``/``kappa``/``lse`` are the full (replicated) teacher sample. Every rank gets
    the same per-token loss and metric, and the gradient of its own shard.
    """
    _check_tau(tau)
    w = estimator_weights(teacher_logits, kappa, lse, estimator=estimator, tau=tau).detach()
    loss = _VocabParallelSparseKD.apply(student_logits_shard, ids.long(), w, tau, group)
    kl = _kl_metric(loss, w, _teacher_log_p(teacher_logits, lse, tau))
    return _apply_mask(loss_mask, loss, kl)


class _VocabParallelFullKD(torch.autograd.Function):
    """loss = lse_s - sum_v p_v z_v/tau over sharded logits; grad = (q_s - p) / tau."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor, tau: float,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        z = logits.float() / tau
        softmax, lse_s = _softmax_shard(z, group)
        pz = (p * z).sum(-1)
        dist.all_reduce(pz, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(softmax, p)
        ctx.tau = tau
        ctx.in_dtype = logits.dtype
        return lse_s - pz

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        softmax, p = ctx.saved_tensors
        grad = (softmax - p) * (grad_out / ctx.tau).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_full_kd_loss(student_logits_shard: torch.Tensor, teacher_logits_shard: torch.Tensor,
                                tau: float = 1.0, *, group: dist.ProcessGroup | None = None,
                                loss_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`full_kd_loss` with both student and teacher logits sharded the same way over ``group``."""
    _check_tau(tau)
    with torch.no_grad():
        p, lse_t = _softmax_shard(teacher_logits_shard.detach().float() / tau, group)
        log_p = teacher_logits_shard.detach().float() / tau - lse_t.unsqueeze(-1)
        plogp = torch.where(p > 0, p * log_p, torch.zeros_like(p)).sum(-1)
        dist.all_reduce(plogp, op=dist.ReduceOp.SUM, group=group)
    loss = _VocabParallelFullKD.apply(student_logits_shard, p, tau, group)
    return _apply_mask(loss_mask, loss, loss.detach() + plogp)

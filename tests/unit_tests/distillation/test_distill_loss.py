"""Sparse-target KD losses: formula, exactness, expected gradient = full-KD gradient, vocab-parallel TP=2."""
import math

import pytest
import torch
from testlib.distributed import run_distributed

from megatron_cai.core.distillation import (
    counter_gumbel,
    full_kd_loss,
    gumbel_topk,
    sparse_kd_loss,
    topk_select,
    vocab_parallel_full_kd_loss,
    vocab_parallel_gumbel_topk,
    vocab_parallel_sparse_kd_loss,
)

V = 50


def _ref_weights(tl, kappa, lse, estimator, tau):
    """Estimator weights in float64, written out from the definitions."""
    s = tl.double() / tau
    p = torch.exp(s - lse.double().unsqueeze(-1))
    if estimator == "topk":
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        return e / e.sum(-1, keepdim=True)
    q = 1 - torch.exp(-torch.exp(s - kappa.double().unsqueeze(-1)))
    w = p / q
    return w / w.sum(-1, keepdim=True) if estimator == "self-normalized" else w


def _ref_log_q(z, tau):
    z = z.double() / tau
    return z - torch.log(torch.exp(z - z.max(-1, keepdim=True).values).sum(-1, keepdim=True)) \
        - z.max(-1, keepdim=True).values


@pytest.mark.parametrize("estimator", ["priority", "self-normalized", "topk"])
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_sparse_loss_matches_definition(estimator, tau):
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(3, 5, V, generator=g) * 2
    z = (torch.randn(3, 5, V, generator=g) * 2).requires_grad_()
    sample = topk_select(teacher, 6, tau=tau) if estimator == "topk" else gumbel_topk(teacher, 6, tau=tau,
                                                                                        generator=g)
    ids, tl, kappa, lse = sample
    loss, kl = sparse_kd_loss(z, ids, tl, kappa, lse, estimator=estimator, tau=tau)
    (loss * torch.linspace(0.5, 1.5, 15).view(3, 5)).sum().backward()
    z2 = z.detach().clone().requires_grad_()
    w = _ref_weights(tl, kappa, lse, estimator, tau)
    log_q = torch.gather(_ref_log_q(z2, tau), -1, ids)
    ref_loss = -(w * log_q).sum(-1)
    ref_kl = (w * (tl.double() / tau - lse.double().unsqueeze(-1) - log_q)).sum(-1)
    (ref_loss * torch.linspace(0.5, 1.5, 15).view(3, 5).double()).sum().backward()
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl.double(), ref_kl.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z.grad.double(), z2.grad.double(), rtol=1e-5, atol=1e-6)


def test_full_kd_loss_matches_torch_kl_div():
    teacher, z = torch.randn(4, V) * 3, (torch.randn(4, V) * 2).requires_grad_()
    for tau in (1.0, 3.0):
        loss, kl = full_kd_loss(z, teacher, tau)
        log_p = torch.log_softmax(teacher.double() / tau, -1)
        log_q = torch.log_softmax(z.detach().double() / tau, -1)
        ref_kl = torch.nn.functional.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        torch.testing.assert_close(kl.double(), ref_kl, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss.double(), ref_kl + entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tau", [1.0, 1.5])
def test_exact_when_k_covers_vocab_or_support(tau):
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(4, V, generator=g) * 2
    teacher[2, 10:] = -math.inf  # a row with a support of 10 tokens
    z = torch.randn(4, V, generator=g).requires_grad_()
    full_loss, full_kl = full_kd_loss(z, teacher, tau)
    full_loss.sum().backward()
    full_grad, z.grad = z.grad.clone(), None
    for k in (V, V + 3):
        ids, tl, kappa, lse = gumbel_topk(teacher, k, tau=tau, generator=g)
        loss, kl = sparse_kd_loss(z, ids, tl, kappa, lse, tau=tau)
        loss.sum().backward()
        torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kl, full_kl, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(z.grad, full_grad, rtol=1e-5, atol=1e-6)
        z.grad = None
    # Only the support row: k = 10 = |support| is exact too.
    ids, tl, kappa, lse = gumbel_topk(teacher[2], 10, tau=tau, generator=g)
    loss, kl = sparse_kd_loss(z[2], ids, tl, kappa, lse, tau=tau)
    torch.testing.assert_close(loss, full_loss[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl, full_kl[2], rtol=1e-4, atol=1e-5)


def _mc_sparse_grads(teacher, z, k, tau, n, estimator="priority", seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids, tl, kappa, lse = gumbel_topk(teacher.expand(n, V), k, tau=tau, generator=gen)
    zn = z.detach().expand(n, V).clone().requires_grad_()
    loss, kl = sparse_kd_loss(zn, ids, tl, kappa, lse, estimator=estimator, tau=tau)
    loss.sum().backward()
    return zn.grad.double(), kl.double()


@pytest.mark.parametrize("case", ["gaussian", "zipf_tail", "peaked_tau2"])
def test_expected_sparse_gradient_equals_full_kd_gradient(case):
    g = torch.Generator().manual_seed(31)
    if case == "gaussian":
        teacher, tau = torch.randn(V, generator=g), 1.0
    elif case == "zipf_tail":
        teacher, tau = -0.7 * torch.log(torch.randperm(V, generator=g).float() + 1), 1.0
    else:
        teacher, tau = 3.0 * torch.randn(V, generator=g), 2.0
    z = (torch.randn(V, generator=g) * 1.5).requires_grad_()
    full_loss, full_kl = full_kd_loss(z, teacher, tau)
    full_loss.backward()
    n = 20_000
    grads, kl = _mc_sparse_grads(teacher, z, 4, tau, n)
    mean, se = grads.mean(0), grads.std(0) / math.sqrt(n)
    z_score = ((mean - z.grad.double()).abs() / (se + 1e-12)).max()
    assert z_score < 4.5, float(z_score)
    assert float(se.max()) < 0.05 * float(z.grad.abs().max()) + 1e-3  # the check has power
    kl_se = float(kl.std()) / math.sqrt(n)
    assert abs(float(kl.mean()) - float(full_kl)) < 4.5 * kl_se
    # The renormalised top-k gradient is off by many standard errors.
    ids, tl, kappa, lse = topk_select(teacher, 4, tau=tau)
    z2 = z.detach().clone().requires_grad_()
    sparse_kd_loss(z2, ids, tl, kappa, lse, estimator="topk", tau=tau)[0].backward()
    assert float(((z2.grad.double() - z.grad.double()).abs() / (se + 1e-12)).max()) > 20


def test_loss_mask_and_bf16_student():
    g = torch.Generator().manual_seed(2)
    teacher = torch.randn(2, 6, V, generator=g)
    z = (torch.randn(2, 6, V, generator=g)).bfloat16().requires_grad_()
    mask = torch.tensor([[1, 1, 0, 1, 0, 1], [0, 1, 1, 1, 1, 0]])
    ids, tl, kappa, lse = gumbel_topk(teacher, 5, generator=g)
    loss, kl = sparse_kd_loss(z, ids, tl, kappa, lse, loss_mask=mask)
    loss.sum().backward()
    assert z.grad.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert (loss[mask == 0] == 0).all() and (kl[mask == 0] == 0).all()
    assert (z.grad[mask == 0] == 0).all() and (z.grad[mask == 1] != 0).any()
    unmasked, _ = sparse_kd_loss(z.detach().float(), ids, tl, kappa, lse)
    torch.testing.assert_close(loss[mask == 1], unmasked[mask == 1])


# ---------------------------------------------------------------- vocab-parallel (TP = 2, gloo) ----------

def _tp_worker(rank, world_size):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5)
    b, t, vp, v_real = 2, 3, 26 * world_size, 50  # padded vocab 52, real vocab 50
    teacher = torch.randn(b, t, vp, generator=g) * 2
    student = torch.randn(b, t, vp, generator=g) * 2
    upstream = torch.rand(b, t, generator=g) + 0.5
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    lo, hi = rank * vp // world_size, (rank + 1) * vp // world_size
    # Sampling from vocab-sharded teacher logits with counter noise = the single-process draw.
    rows = torch.arange(b * t).view(b, t)
    single = gumbel_topk(teacher[..., :v_real], 6, tau=1.3, gumbel=counter_gumbel(9, rows, v_real))
    shard = vocab_parallel_gumbel_topk(teacher[..., lo:hi], 6, tau=1.3, vocab_size=v_real,
                                       gumbel=counter_gumbel(9, rows, hi, vocab_start=lo))
    assert torch.equal(single[0], shard[0]) and torch.equal(single[1], shard[1])
    torch.testing.assert_close(single[2], shard[2])
    torch.testing.assert_close(single[3], shard[3])
    ids, tl, kappa, lse = single
    for estimator in ("priority", "self-normalized", "topk"):
        z = student.clone().requires_grad_()
        ref_loss, ref_kl = sparse_kd_loss(z, ids, tl, kappa, lse, estimator=estimator, tau=1.3,
                                          loss_mask=mask)
        (ref_loss * upstream).sum().backward()
        zs = student[..., lo:hi].clone().requires_grad_()
        loss, kl = vocab_parallel_sparse_kd_loss(zs, ids, tl, kappa, lse, group=dist.group.WORLD,
                                                 estimator=estimator, tau=1.3, loss_mask=mask)
        (loss * upstream).sum().backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kl, ref_kl, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(zs.grad, z.grad[..., lo:hi], rtol=1e-5, atol=1e-6)
    z = student.clone().requires_grad_()
    ref_loss, ref_kl = full_kd_loss(z, teacher, 1.3, loss_mask=mask)
    (ref_loss * upstream).sum().backward()
    zs = student[..., lo:hi].clone().requires_grad_()
    loss, kl = vocab_parallel_full_kd_loss(zs, teacher[..., lo:hi], 1.3, group=dist.group.WORLD,
                                           loss_mask=mask)
    (loss * upstream).sum().backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(zs.grad, z.grad[..., lo:hi], rtol=1e-5, atol=1e-6)
    return float(loss.sum())


def test_vocab_parallel_tp2_matches_single_process():
    results = run_distributed(_tp_worker, world_size=2)
    assert results[0] == results[1]

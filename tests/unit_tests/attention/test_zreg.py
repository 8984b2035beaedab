"""Attention Z-Reg: injected gradients == autograd of sum(out * g) + w * mean(lse^2) in fp64."""
from __future__ import annotations

import random

import pytest
import torch
from testlib.attention import explicit_loss, interval_mask, random_forest

from megatron_cai.core.transformer import visibility as V
from megatron_cai.core.transformer.attention import attend
from megatron_cai.core.transformer.zreg import inject_zreg, lse_stats, zreg_lse_grad

BACKENDS = ["eager", "blocked"]  # flex/triton: see the GPU test and test_attention_triton.py


def _case(seed, seq=120, heads=4, kv_heads=2, dim=16, broken_rows=()):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    lays = [V.from_tree(*random_forest(rng, max_nodes=7, max_len=6, p_bidir=0.3)) for _ in range(4)]
    lay = V.concat_layouts(lays)
    s, lim, pos = V.batch([(lay.start, lay.limit, lay.position_ids)] * 2, seq)
    for b, j in broken_rows:  # make query row j of batch b see nothing (invalid intervals on purpose)
        s[b] = torch.where((s[b] <= j) & (j < lim[b]), torch.full_like(s[b], j + 1), s[b])
    qkv = [torch.randn(2, h, seq, dim, dtype=torch.float64) * 2 for h in (heads, kv_heads, kv_heads)]
    dout = torch.randn(2, heads, seq, dim, dtype=torch.float64)
    return s, lim, pos, qkv, dout


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("w", [1e-3, 0.5])
def test_injected_gradient_equals_explicit_virtual_term(backend, w):
    s, lim, pos, qkv, dout = _case(1)
    q, k, v = (x.clone().requires_grad_() for x in qkv)
    out = attend(q, k, v, s, lim, zreg_coeff=w, backend=backend)
    got = torch.autograd.grad((out * dout).sum(), [q, k, v])
    q2, k2, v2 = (x.clone().requires_grad_() for x in qkv)
    exp = torch.autograd.grad(explicit_loss(q2, k2, v2, interval_mask(s, lim), dout, w), [q2, k2, v2])
    base = torch.autograd.grad((attend(q, k, v, s, lim, backend=backend) * dout).sum(), [q, k, v])
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    for a, c in zip(got[:2], base[:2]):  # the injected term is really there (lse does not depend on v)
        assert (a - c).abs().max() > 1e-3 * w


@pytest.mark.parametrize("backend", BACKENDS)
def test_zreg_with_window_gqa_and_used_lse(backend):
    """Caller's own lse gradient and Z-Reg add up; window and MQA on."""
    s, lim, pos, qkv, dout = _case(2, kv_heads=1)
    lse_weight = torch.randn(2, 4, 120, dtype=torch.float64)
    q, k, v = (x.clone().requires_grad_() for x in qkv)
    out, lse = attend(q, k, v, s, lim, zreg_coeff=0.2, window=9, position_ids=pos, backend=backend,
                      return_lse=True)
    got = torch.autograd.grad((out * dout).sum() + (lse.double() * lse_weight).sum(), [q, k, v])
    q2, k2, v2 = (x.clone().requires_grad_() for x in qkv)
    loss = explicit_loss(q2, k2, v2, interval_mask(s, lim, 9, pos), dout, 0.2, lse_weight)
    exp = torch.autograd.grad(loss, [q2, k2, v2])
    for a, b in zip(got, exp):  # lse is returned in fp32, so the caller's lse term is fp32-rounded
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_excluded(backend):
    s, lim, pos, qkv, dout = _case(3, broken_rows=[(0, 5), (1, 60)])
    mask = interval_mask(s, lim)
    assert not mask[0, 5].any() and not mask[1, 60].any()
    q, k, v = (x.clone().requires_grad_() for x in qkv)
    out, lse = attend(q, k, v, s, lim, zreg_coeff=0.3, backend=backend, return_lse=True)
    assert torch.isinf(lse[0, :, 5]).all() and torch.isinf(lse[1, :, 60]).all()
    got = torch.autograd.grad((out * dout).sum(), [q, k, v])
    assert all(torch.isfinite(g).all() for g in got)
    q2, k2, v2 = (x.clone().requires_grad_() for x in qkv)
    exp = torch.autograd.grad(explicit_loss(q2, k2, v2, mask, dout, 0.3), [q2, k2, v2])
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_coeff_is_bit_identical_and_forward_unchanged(backend):
    s, lim, pos, qkv, dout = _case(4)
    qkv = [x.float() for x in qkv]
    q, k, v = (x.clone().requires_grad_() for x in qkv)
    out0 = attend(q, k, v, s, lim, backend=backend)
    g0 = torch.autograd.grad((out0 * dout.float()).sum(), [q, k, v])
    outw0 = attend(q, k, v, s, lim, backend=backend, zreg_coeff=0.0)
    gw0 = torch.autograd.grad((outw0 * dout.float()).sum(), [q, k, v])
    outw = attend(q, k, v, s, lim, backend=backend, zreg_coeff=0.7)
    assert torch.equal(out0, outw0) and torch.equal(out0, outw)
    for a, b in zip(g0, gw0):
        assert torch.equal(a, b)


def test_lse_grad_helper_and_inject():
    lse = torch.tensor([[1.0, -2.0, float("-inf"), 3.0]])
    g = zreg_lse_grad(lse, 0.5)
    torch.testing.assert_close(g, torch.tensor([[1.0, -2.0, 0.0, 3.0]]) * 2 * 0.5 / 3)
    assert zreg_lse_grad(lse, 0.0) is None
    incoming = torch.ones(1, 4)
    torch.testing.assert_close(zreg_lse_grad(lse, 0.5, incoming),
                               torch.tensor([[1.0, 1.0, 0.0, 1.0]]) + g)
    x = torch.randn(3, requires_grad=True)
    out, lse2 = inject_zreg(x * 2, x.exp().log(), 0.25)
    (gx,) = torch.autograd.grad(out.sum(), x)  # lse unused by the caller: still gets 2w lse / N
    torch.testing.assert_close(gx, 2 + 2 * 0.25 * x.detach() / 3)
    stats = lse_stats(lse)
    assert stats == {"lse mean": pytest.approx(2 / 3), "lse max": 3.0}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "triton"])
def test_zreg_cuda_backends(backend):
    s, lim, pos, qkv, dout = _case(5)
    q, k, v = (x.float().cuda().requires_grad_() for x in qkv)
    out = attend(q, k, v, s.cuda(), lim.cuda(), zreg_coeff=0.3, backend=backend)
    got = torch.autograd.grad((out * dout.float().cuda()).sum(), [q, k, v])
    q2, k2, v2 = (x.clone().requires_grad_() for x in qkv)
    exp = torch.autograd.grad(explicit_loss(q2, k2, v2, interval_mask(s, lim), dout, 0.3), [q2, k2, v2])
    for a, b in zip(got, exp):
        torch.testing.assert_close(a.double().cpu(), b, atol=2e-3, rtol=2e-3)

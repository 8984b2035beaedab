"""Squinch stochastic mode: unbiased in the linear domain (Monte Carlo), bracketing, reproducibility."""
from __future__ import annotations

import pytest
import torch
from testlib import squinch_oracle as oracle

from megatron_cai.core import squinch


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_stochastic_mean_converges_to_input(backend):
    x = oracle.stochastic_input()
    gen = torch.Generator().manual_seed(1234)
    r = oracle.monte_carlo(
        lambda v: squinch.encode(v, stochastic=True, generator=gen, backend=backend),
        lambda p, n: squinch.decode(p, n, backend=backend),
        x,
        trials=3000,
    )
    assert r["bracketed"] and r["qmax_same"]
    assert r["n_spread"] >= 50
    z = r["z"]
    assert z.abs().max() < 5.0, z
    assert 0.6 < (z**2).mean() < 1.5, (z**2).mean()  # z ~ N(0, 1) per element
    assert r["zero_spread_gap"] <= 1e-6 * x.abs().max().item()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_deterministic_mode_is_biased_so_the_test_has_power(backend):
    """The same statistic on deterministic payloads fails: the Monte Carlo test can tell them apart."""
    x = oracle.stochastic_input()
    payload = squinch.encode(x, backend=backend)
    dec = squinch.decode(payload, x.numel(), backend=backend).double()
    err = (dec - x.double()).abs()
    gen = torch.Generator().manual_seed(99)
    trials = 3000
    p = squinch.encode(x.repeat(trials), stochastic=True, generator=gen, backend=backend)
    d = squinch.decode(p, x.numel() * trials, backend=backend).view(trials, -1).double()
    se = d.std(0) / trials**0.5
    assert ((err > 10 * se) & (se > 0)).sum() >= 10  # rounding bias dwarfs the stochastic standard error


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_stochastic_reproducible_with_generator(backend):
    x = torch.randn(1003, generator=torch.Generator().manual_seed(0))
    p1 = squinch.encode(x, stochastic=True, generator=torch.Generator().manual_seed(7), backend=backend)
    p2 = squinch.encode(x, stochastic=True, generator=torch.Generator().manual_seed(7), backend=backend)
    p3 = squinch.encode(x, stochastic=True, generator=torch.Generator().manual_seed(8), backend=backend)
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_stochastic_feedback_residual_is_exact_error(backend):
    g = torch.Generator().manual_seed(2)
    grad, res = torch.randn(777, generator=g), torch.randn(777, generator=g) * 0.1
    y = grad + res
    payload, nonfinite = squinch.encode_with_feedback(grad, res, stochastic=True, generator=g,
                                                      backend=backend)
    dec = squinch.decode(payload, 777, backend=backend)
    assert not bool(nonfinite)
    assert oracle.same_bits(res, y - dec)

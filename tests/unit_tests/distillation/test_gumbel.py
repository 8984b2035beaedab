"""Gumbel-top-k sampling and the priority-sampling estimator (acceptance 1: unbiasedness by Monte Carlo)."""
import itertools
import math

import numpy as np
import pytest
import torch

from megatron_cai.core.distillation import (
    counter_gumbel,
    estimator_weights,
    gumbel_topk,
    priority_weights,
    self_normalized_weights,
    topk_select,
    topk_weights,
)

V = 50


def _dists() -> dict[str, tuple[torch.Tensor, float]]:
    """Toy teacher logits over V tokens (and the temperature they are sampled at)."""
    g = torch.Generator().manual_seed(123)
    ranks = torch.randperm(V, generator=g).float() + 1.0
    return {
        "gaussian": (torch.randn(V, generator=g), 1.0),
        "peaked": (4.0 * torch.randn(V, generator=g), 1.0),
        "zipf_tail": (-0.7 * torch.log(ranks), 1.0),
        "peaked_tau2": (3.0 * torch.randn(V, generator=g), 2.0),
    }


def _fs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "indicator": (torch.rand(V, generator=g) < 0.3).double(),
        "gaussian": torch.randn(V, generator=g, dtype=torch.float64),
        "index_sq": (torch.arange(V, dtype=torch.float64) / V) ** 2,
    }


def _p64(logits: torch.Tensor, tau: float) -> torch.Tensor:
    """Teacher probabilities in float64, written out without torch.softmax."""
    s = logits.double() / tau
    e = torch.exp(s - s.max())
    return e / e.sum()


def _estimates(ids: torch.Tensor, w: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return (w.double() * f[ids]).sum(-1)


def test_keys_ids_kappa_lse_match_brute_force():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 9, V, generator=g) * 2
    noise = -torch.log(-torch.log(torch.rand(6, 9, V, generator=g, dtype=torch.float64)))
    for tau, k in [(1.0, 4), (0.7, 1), (2.5, 7)]:
        ids, tl, kappa, lse = gumbel_topk(logits, k, tau=tau, gumbel=noise.float())
        keys = (logits.double() / tau + noise.float().double()).numpy()
        order = np.argsort(-keys, axis=-1, kind="stable")
        assert ids.dtype == torch.int64 and ids.shape == (6, 9, k)
        np.testing.assert_array_equal(ids.numpy(), order[..., :k])
        np.testing.assert_allclose(kappa.numpy(), np.take_along_axis(keys, order[..., k:k + 1], -1)[..., 0],
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(tl.numpy(), np.take_along_axis(logits.numpy(), ids.numpy(), -1))
        s = logits.double().numpy() / tau
        ref_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
        np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-5)
        assert (kappa.unsqueeze(-1) < torch.gather(torch.from_numpy(keys), -1, ids).float()).all()


def test_bf16_logits_returned_raw():
    logits = (torch.randn(3, V) * 3).bfloat16()
    ids, tl, kappa, lse = gumbel_topk(logits, 5, tau=2.0, generator=torch.Generator().manual_seed(1))
    assert tl.dtype == torch.bfloat16 and torch.equal(tl, torch.gather(logits, -1, ids))
    assert kappa.dtype == lse.dtype == torch.float32


def test_inclusion_probabilities_match_plackett_luce_enumeration():
    """P(v in S) for k=2 of V=4, against the exact without-replacement (Plackett-Luce) enumeration."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.10], dtype=torch.float64)
    exact_first = p.numpy()
    exact_incl = np.zeros(4)
    for a, b in itertools.permutations(range(4), 2):
        exact_incl[a] += p[a] * p[b] / (1 - p[a])
        exact_incl[b] += p[a] * p[b] / (1 - p[a])
    n = 200_000
    logits = torch.log(p).float().expand(n, 4)
    ids, *_ = gumbel_topk(logits, 2, generator=torch.Generator().manual_seed(3))
    first = torch.bincount(ids[:, 0], minlength=4).double().numpy() / n
    incl = torch.bincount(ids.flatten(), minlength=4).double().numpy() / n
    for emp, ex in ((first, exact_first), (incl, exact_incl)):
        se = np.sqrt(ex * (1 - ex) / n)
        assert np.all(np.abs(emp - ex) < 4.5 * se), (emp, ex)
    assert (ids[:, 0] != ids[:, 1]).all()


@pytest.mark.parametrize("dist", list(_dists()))
def test_priority_estimator_unbiased_and_topk_biased(dist):
    logits, tau = _dists()[dist]
    p = _p64(logits, tau)
    n, k = 20_000, 4
    ids, tl, kappa, lse = gumbel_topk(logits.expand(n, V), k, tau=tau,
                                      generator=torch.Generator().manual_seed(11))
    w = priority_weights(tl, kappa, lse, tau=tau)
    t_ids, t_tl, t_kappa, t_lse = topk_select(logits, k, tau=tau)
    w_topk = topk_weights(t_tl, tau=tau)
    worst_topk_bias = 0.0
    for name, f in _fs().items():
        truth = float((p * f).sum())
        est = _estimates(ids, w, f)
        mean, se = float(est.mean()), float(est.std() / math.sqrt(n))
        assert abs(mean - truth) < 4.5 * se, (dist, name, mean, truth, se)
        assert se < 0.05 * max(1.0, float(f.abs().max())), (dist, name, se)  # a useful, not a vacuous, check
        topk_est = float(_estimates(t_ids, w_topk, f))
        worst_topk_bias = max(worst_topk_bias, abs(topk_est - truth) / se)
    assert worst_topk_bias > 20, (dist, worst_topk_bias)  # renormalised top-k misses the tail mass


def test_weights_sum_estimates_one_and_self_normalized_sums_to_one():
    logits, tau = _dists()["zipf_tail"]
    n = 20_000
    gen = torch.Generator().manual_seed(5)
    _, tl, kappa, lse = gumbel_topk(logits.expand(n, V), 6, tau=tau, generator=gen)
    w = priority_weights(tl, kappa, lse, tau=tau).double().sum(-1)
    assert abs(float(w.mean()) - 1.0) < 4.5 * float(w.std()) / math.sqrt(n)
    sn = self_normalized_weights(tl, kappa, lse, tau=tau)
    torch.testing.assert_close(sn.sum(-1), torch.ones(n), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(estimator_weights(tl, kappa, lse, estimator="self-normalized", tau=tau), sn)
    with pytest.raises(ValueError, match="unknown distillation estimator"):
        estimator_weights(tl, kappa, lse, estimator="bogus")


@pytest.mark.parametrize("tau", [1.0, 1.7])
def test_exact_when_k_covers_vocab(tau):
    logits = torch.randn(7, V) * 3
    ids, tl, kappa, lse = gumbel_topk(logits, V + 5, tau=tau, generator=torch.Generator().manual_seed(2))
    assert ids.shape == (7, V) and torch.isneginf(kappa).all()
    assert (torch.sort(ids, -1).values == torch.arange(V)).all()
    f = _fs()["gaussian"]
    for est in ("priority", "self-normalized"):
        w = estimator_weights(tl, kappa, lse, estimator=est, tau=tau)
        for r in range(7):
            truth = float((_p64(logits[r], tau) * f).sum())
            assert abs(float(_estimates(ids[r], w[r], f)) - truth) < 1e-5


@pytest.mark.parametrize("k", [10, 13])
def test_exact_when_k_covers_support(k):
    """Support of 10 tokens (the rest -inf): with k >= 10 every draw gives E_p[f] exactly."""
    g = torch.Generator().manual_seed(9)
    logits = torch.full((V,), -math.inf)
    support = torch.randperm(V, generator=g)[:10]
    logits[support] = torch.randn(10, generator=g) * 2
    p = _p64(logits, 1.0)
    f = _fs()["gaussian"]
    ids, tl, kappa, lse = gumbel_topk(logits.expand(500, V), k, generator=g)
    w = priority_weights(tl, kappa, lse)
    assert torch.isfinite(w).all() and torch.isneginf(kappa).all()
    assert (w[:, 10:] == 0).all()  # zero-probability tokens picked beyond the support get weight 0
    est = _estimates(ids, w, f)
    torch.testing.assert_close(est, torch.full_like(est, float((p * f).sum())), rtol=0, atol=1e-6)


def test_priority_weights_numerics_against_float64():
    g = torch.Generator().manual_seed(4)
    tl = torch.randn(4000, generator=g) * 5
    lse = torch.full((4000,), 8.0)
    x = torch.linspace(-60, 12, 4000)  # logit - kappa: from far below the threshold to far above
    kappa = tl - x
    w = priority_weights(tl.unsqueeze(-1), kappa, lse).squeeze(-1)
    tl64, kappa64 = tl.double(), kappa.double()
    p = torch.exp(tl64 - 8.0)
    q = -torch.expm1(-torch.exp(tl64 - kappa64))
    torch.testing.assert_close(w.double(), p / q, rtol=2e-4, atol=0)
    w_inf = priority_weights(tl.unsqueeze(-1), torch.full((4000,), -math.inf), lse).squeeze(-1)
    torch.testing.assert_close(w_inf.double(), p, rtol=1e-5, atol=0)


def test_topk_select_is_deterministic_top_k():
    logits = torch.randn(5, V)
    ids, tl, kappa, lse = topk_select(logits, 4, tau=0.5)
    ref = torch.sort(logits, -1, descending=True)
    assert torch.equal(ids, ref.indices[:, :4]) and torch.equal(tl, ref.values[:, :4])
    torch.testing.assert_close(kappa, ref.values[:, 4] / 0.5)
    w = topk_weights(tl, tau=0.5)
    e = torch.exp((tl - tl.max(-1, keepdim=True).values).double() / 0.5)
    torch.testing.assert_close(w.double(), e / e.sum(-1, keepdim=True))


def test_draw_reproducible_from_generator():
    logits = torch.randn(8, 16, V)
    a = gumbel_topk(logits, 4, generator=torch.Generator().manual_seed(42))
    b = gumbel_topk(logits, 4, generator=torch.Generator().manual_seed(42))
    c = gumbel_topk(logits, 4, generator=torch.Generator().manual_seed(43))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])


def test_counter_gumbel_is_gumbel_and_batch_and_shard_invariant():
    rows = torch.arange(4000, dtype=torch.int64) * 37 + 5
    noise = counter_gumbel(2024, rows, V)
    # Same values whatever the batching or vocab sharding.
    chunks = torch.cat([counter_gumbel(2024, rows[i:i + 300], V) for i in range(0, 4000, 300)])
    assert torch.equal(noise, chunks)
    assert torch.equal(noise[:, 20:35], counter_gumbel(2024, rows, 35, vocab_start=20))
    assert torch.equal(noise.flip(0), counter_gumbel(2024, rows.flip(0), V))
    assert not torch.equal(noise, counter_gumbel(2025, rows, V))
    # Gumbel(0, 1): Kolmogorov-Smirnov distance, and no correlation between neighbours.
    x = np.sort(noise.flatten().double().numpy())
    n = x.size
    cdf = np.exp(-np.exp(-x))
    ks = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert ks < 1.95 / math.sqrt(n), ks  # 0.1% level
    flat = noise.double()
    for a, b in ((flat[:, :-1], flat[:, 1:]), (flat[:-1], flat[1:])):
        corr = float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])
        assert abs(corr) < 4.5 / math.sqrt(a.numel()), corr
    # Wide row keys (beyond 32 bits) are hashed, not truncated.
    big = counter_gumbel(1, torch.tensor([5, 5 + (1 << 32)]), V)
    assert not torch.equal(big[0], big[1])


def test_counter_noise_draw_is_unbiased():
    """The counter-based noise is good enough for the estimator: same Monte Carlo check as torch's RNG."""
    logits, tau = _dists()["zipf_tail"]
    n = 20_000
    noise = counter_gumbel(77, torch.arange(n), V)
    ids, tl, kappa, lse = gumbel_topk(logits.expand(n, V), 4, tau=tau, gumbel=noise)
    w = priority_weights(tl, kappa, lse, tau=tau)
    p = _p64(logits, tau)
    for f in _fs().values():
        est = _estimates(ids, w, f)
        assert abs(float(est.mean()) - float((p * f).sum())) < 4.5 * float(est.std()) / math.sqrt(n)

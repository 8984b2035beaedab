"""The grad-norm clip and non-finite check both optimizers share (``core.optimizer.clip_grads``), against
``torch.nn.utils.clip_grad_norm_`` (the same rule: scale by max_norm / (norm + 1e-6) when that is < 1)."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_cai.core.optimizer.clip_grads import GlobalNormClipping


class _Grads(GlobalNormClipping):
    """Owns ``grads``; counts ``grads[i]`` for i in ``counted`` in the norm (a DP / TP replica counts none)."""

    def __init__(self, grads: list[torch.Tensor], counted: list[int]) -> None:
        self.grads, self.counted = grads, counted

    def owned_grads(self):
        return iter(self.grads)

    def norm_grads(self):
        return (self.grads[i] for i in self.counted)

    def norm_params(self):
        return (self.grads[i] for i in self.counted)

    def grad_device(self) -> torch.device:
        return torch.device("cpu")

    def moment_tensors(self):
        return iter(())


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, generator=g) * 3, torch.randn(3, 5, generator=g), torch.randn(11, generator=g) * 0.1]


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 15.0, 100.0, 0.0])  # the norm is 10.4
def test_clip_matches_torch_clip_grad_norm(max_norm):
    ours = _Grads(_grads(0), [0, 1, 2])
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ours.grads]
    for p, g in zip(params, ours.grads):
        p.grad = g.clone()
    norm, finite = ours.clip_and_check(max_norm)
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    assert finite and norm == pytest.approx(float(expected), rel=1e-6)  # ours sums fp32 products in fp64
    for p, g in zip(params, ours.grads):
        assert torch.allclose(g, p.grad, rtol=1e-6, atol=0)


def test_the_norm_counts_only_norm_grads_and_clipping_scales_every_owned_grad():
    ours, reference = _Grads(_grads(1), [1]), _grads(1)
    norm, finite = ours.clip_and_check(1.0)
    assert finite and norm == pytest.approx(float(reference[1].double().norm()), rel=1e-6)
    coeff = 1.0 / (norm + 1e-6)
    assert coeff < 1
    assert all(torch.allclose(g, r * coeff) for g, r in zip(ours.grads, reference))


def test_a_non_finite_gradient_is_reported_and_nothing_is_scaled():
    grads = _grads(2)
    grads[2][4] = float("inf")
    ours = _Grads([g.clone() for g in grads], [0, 1, 2])
    norm, finite = ours.clip_and_check(1.0)
    assert not finite and math.isnan(norm)
    assert all(torch.equal(g, r) for g, r in zip(ours.grads, grads))


def test_scale_grads_multiplies_every_owned_grad():
    ours, reference = _Grads(_grads(3), []), _grads(3)
    ours.scale_grads(0.25)
    assert all(torch.equal(g, r * 0.25) for g, r in zip(ours.grads, reference))
    ours.scale_grads(8.0)
    assert all(torch.equal(g, r * 2.0) for g, r in zip(ours.grads, reference))
    assert ours.grad_norm() == 0.0

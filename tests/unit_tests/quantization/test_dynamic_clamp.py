"""Clamp statistics against loops, the weight-RMS prediction rules against numerical integration and measured
activations, and the TP all-reduce of the statistics (2 gloo ranks)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from testlib.distributed import run_distributed

from megatron_cai.core.quantization import dynamic_clamp as dc
from megatron_cai.core.quantization import fake_quant, quantization_error_stats


def test_group_stats_match_loops() -> None:
    x = torch.randn(3, 2, 300, generator=torch.Generator().manual_seed(0))
    rows = x.reshape(-1, 300).double().numpy()
    amax_rows = np.array([np.abs(r).max() for r in rows]).reshape(3, 2, 1)
    rms_rows = np.array([np.sqrt(np.mean(r ** 2)) for r in rows]).reshape(3, 2, 1)
    np.testing.assert_allclose(dc.group_absmax(x, "row").numpy(), amax_rows, rtol=0)
    np.testing.assert_allclose(dc.group_rms(x, "row").numpy(), rms_rows, rtol=1e-6)
    np.testing.assert_allclose(float(dc.group_rms(x, "tensor")), np.sqrt(np.mean(rows ** 2)), rtol=1e-6)
    blocks = [(0, 128), (128, 256), (256, 300)]  # the last block has 44 real elements, not 128
    rms_blocks = np.array([[np.sqrt(np.mean(r[a:b] ** 2)) for a, b in blocks] for r in rows])
    rms_blocks = rms_blocks.reshape(3, 2, 3, 1)
    amax_blocks = np.array([[np.abs(r[a:b]).max() for a, b in blocks] for r in rows]).reshape(3, 2, 3, 1)
    np.testing.assert_allclose(dc.group_rms(x, "block").numpy(), rms_blocks, rtol=1e-6)
    np.testing.assert_allclose(dc.group_absmax(x, "block").numpy(), amax_blocks, rtol=0)


def test_default_alpha_and_rules() -> None:
    x = torch.randn(64, 64)
    assert dc.default_alpha("int8", "rms") == dc.DEFAULT_ALPHA["int8"]
    assert dc.default_alpha("fp8_e4m3", "weight-rms") == dc.DEFAULT_ALPHA["fp8"]
    assert dc.default_alpha("int8", "absmax") == 1.0
    torch.testing.assert_close(dc.compute_clamp(x, "rms", fmt="int8"), 12.0 * x.pow(2).mean().sqrt())
    assert float(dc.compute_clamp(x, "static", static_value=3.0, alpha=99.0)) == 3.0  # alpha unused
    assert float(dc.compute_clamp(x, "weight-rms", predicted_rms=0.5, alpha=4.0)) == 2.0


def _integrate(f, s: float) -> float:
    """E[f(h)] for h ~ N(0, s^2) by the trapezoid rule on [-14 s, 14 s]."""
    h = np.linspace(-14 * s, 14 * s, 400_001)
    pdf = np.exp(-0.5 * (h / s) ** 2) / (s * math.sqrt(2 * math.pi))
    y = f(h) * pdf
    return float(np.sum((y[1:] + y[:-1]) * np.diff(h)) / 2)


@pytest.mark.parametrize("s", [1.0, 0.3, 0.003])
def test_relu_and_relu2_constants_by_numerical_integration(s: float) -> None:
    relu = lambda h: np.maximum(h, 0.0)  # noqa: E731
    assert _integrate(lambda h: relu(h) ** 4, s) == pytest.approx(1.5 * s ** 4, rel=1e-8)
    assert float(dc.relu2_rms(s)) == pytest.approx(math.sqrt(_integrate(lambda h: relu(h) ** 4, s)), rel=1e-6)
    assert float(dc.relu_rms(s)) == pytest.approx(math.sqrt(_integrate(lambda h: relu(h) ** 2, s)), rel=1e-6)


def _rms_normalised(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


@pytest.mark.parametrize("scale", [1.0, 0.1, 0.01])
def test_linear_output_rms_prediction(scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    d, out = 256, 1024
    w = torch.randn(out, d, generator=gen, dtype=torch.float64) * 0.02 * scale
    b = torch.randn(out, generator=gen, dtype=torch.float64) * 0.3 * scale
    x = _rms_normalised(512, d, gen) * 2.5
    measured = float((x @ w.T).pow(2).mean().sqrt())
    predicted = float(dc.linear_output_rms(dc.weight_rms(w), d, 2.5))
    assert predicted == pytest.approx(measured, rel=0.03)
    measured_b = float((x @ w.T + b).pow(2).mean().sqrt())
    predicted_b = float(dc.linear_output_rms(dc.weight_rms(w), d, 2.5, dc.weight_rms(b)))
    assert predicted_b == pytest.approx(measured_b, rel=0.03)


def test_post_norm_rms_prediction() -> None:
    gen = torch.Generator().manual_seed(2)
    d = 384
    g = 0.5 + torch.rand(d, generator=gen, dtype=torch.float64)
    bias = 0.2 * torch.randn(d, generator=gen, dtype=torch.float64)
    x = torch.randn(2048, d, generator=gen, dtype=torch.float64) * 3 + 1
    rms_norm = g * x / x.pow(2).mean(-1, keepdim=True).sqrt()
    assert float(dc.post_norm_rms(g)) == pytest.approx(float(rms_norm.pow(2).mean().sqrt()), rel=0.02)
    xc = x - x.mean(-1, keepdim=True)
    layer_norm = g * xc / xc.pow(2).mean(-1, keepdim=True).sqrt() + bias
    assert float(dc.post_norm_rms(g, bias)) == pytest.approx(float(layer_norm.pow(2).mean().sqrt()), rel=0.02)
    per_block = dc.post_norm_rms(g, granularity="block")
    assert per_block.shape == (3, 1)
    for i in range(3):
        assert float(per_block[i, 0]) == pytest.approx(float(g[128 * i:128 * (i + 1)].pow(2).mean().sqrt()))
        measured = float(rms_norm[:, 128 * i:128 * (i + 1)].pow(2).mean().sqrt())
        assert float(per_block[i, 0]) == pytest.approx(measured, rel=0.03)


@pytest.mark.parametrize("scale", [1.0, 0.1, 0.01])
def test_relu2_ffn_prediction_tracks_the_activation(scale: float) -> None:
    """RMSNorm -> fc1 (hidden 256 -> ffn 1024, init std 0.02, scaled) -> relu^2: the prediction from the
    weights alone matches the measured RMS, and the weight-rms clamp therefore equals alpha * RMS."""
    gen = torch.Generator().manual_seed(3)
    d, ffn = 256, 1024
    g = 0.8 + 0.4 * torch.rand(d, generator=gen)
    w1 = torch.randn(ffn, d, generator=gen) * 0.02 * scale
    x = _rms_normalised(256, d, gen).float() * g
    h = torch.relu(x @ w1.T) ** 2
    measured = float(h.pow(2).mean().sqrt())
    predicted = float(dc.predict_relu2_ffn_rms(w1, dc.post_norm_rms(g)))
    assert predicted == pytest.approx(measured, rel=0.05)
    c_pred = dc.compute_clamp(h, "weight-rms", predicted_rms=predicted, fmt="int8")
    c_meas = dc.compute_clamp(h, "rms", fmt="int8")
    assert float(c_pred) == pytest.approx(float(c_meas), rel=0.05)
    stats = quantization_error_stats(h, fake_quant(h, "int8", clamp="weight-rms", predicted_rms=predicted))
    assert stats["rel_rmse"] < 0.05


def test_needs_group_reduction_table() -> None:
    f = dc.needs_group_reduction
    assert f("tensor", sharded=True, sharded_along_last_dim=False)
    assert not f("tensor", sharded=False, sharded_along_last_dim=False)
    assert f("row", sharded=True, sharded_along_last_dim=True)
    assert not f("row", sharded=True, sharded_along_last_dim=False)
    assert not f("block", sharded=True, sharded_along_last_dim=True)


def _tp_stats_worker(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(11))
    shard = x.chunk(world, dim=-1)[rank]  # split along the last dim, as RowParallelLinear's input
    group = dist.group.WORLD
    errors = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.allclose(got, want, rtol=1e-6, atol=0):
            errors.append(f"rank {rank} {name}: {got.flatten()[:4]} vs {want.flatten()[:4]}")

    for gran in ("tensor", "row"):
        check(f"absmax/{gran}", dc.group_absmax(shard, gran, group=group), dc.group_absmax(x, gran))
        check(f"rms/{gran}", dc.group_rms(shard, gran, group=group), dc.group_rms(x, gran))
    # blocks of a 128-aligned shard are blocks of the full tensor: no communication
    full_blocks = dc.group_rms(x, "block").chunk(world, dim=-2)[rank]
    check("rms/block", dc.group_rms(shard, "block"), full_blocks)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(12))
    check("weight_rms", dc.weight_rms(w.chunk(world, dim=0)[rank], group=group), dc.weight_rms(w))
    return errors


def test_statistics_all_reduced_over_tp_equal_the_unsplit_tensor() -> None:
    results = run_distributed(_tp_stats_worker, world_size=2, timeout=120)
    assert results == [[], []], results

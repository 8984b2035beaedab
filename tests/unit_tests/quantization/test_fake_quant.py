"""fake_quant against independent references: int8 by a float64 formula, FP8 by direct float8 casts (and the
casts against a round-to-nearest-even on the enumerated FP8 grid), for every clamp rule and granularity;
straight-through gradients; the clamp is never zero or NaN."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from testlib.quant import (
    FMT_MAX,
    assert_quant_close,
    fp8_grid,
    ref_clamp,
    ref_fp8_cast,
    ref_int8,
    rne_on_grid,
)

from megatron_cai.core.quantization import (
    compute_clamp,
    expand_clamp,
    fake_quant,
    quantization_error_stats,
)

RULES = ["absmax", "static", "rms", "weight-rms"]
GRANS = ["tensor", "row", "block"]
ALPHA = {"absmax": 0.5, "rms": 2.5, "weight-rms": 3.0, "static": None}  # alphas that make clipping happen


def _input(seed: int = 0) -> torch.Tensor:
    """(2, 3, 300): rows of very different scale, a ragged last block (300 = 2 * 128 + 44)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 300, generator=g)
    row_scale = torch.logspace(-3, 2, 6).reshape(2, 3, 1)
    x = x * row_scale
    x[..., 256:] *= 7.0  # the ragged block has its own scale
    return x


def _kwargs(rule: str) -> dict:
    return {"alpha": ALPHA[rule], "static_value": 0.8, "predicted_rms": 0.05}


def _ref_c(x: np.ndarray, rule: str, gran: str) -> np.ndarray:
    return ref_clamp(x, rule, gran, alpha=ALPHA[rule] or 1.0, static=0.8, predicted=0.05)


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("rule", RULES)
def test_int8_matches_independent_formula(rule: str, gran: str) -> None:
    x = _input()
    q = fake_quant(x, "int8", clamp=rule, granularity=gran, **_kwargs(rule))
    xn = x.double().numpy()
    c = _ref_c(xn, rule, gran)
    assert_quant_close(q, ref_int8(xn, c), xn, c, "int8")
    levels = np.round(q.double().numpy() / (c / 127.0))
    assert np.abs(levels).max() <= 127


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_matches_direct_cast(fmt: str, rule: str, gran: str) -> None:
    x = _input(1)
    q = fake_quant(x, fmt, clamp=rule, granularity=gran, **_kwargs(rule))
    xn = x.double().numpy()
    c = _ref_c(xn, rule, gran)
    assert_quant_close(q, ref_fp8_cast(xn, c, fmt), xn, c, fmt)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_cast_is_round_to_nearest_even_on_the_grid(fmt: str) -> None:
    """The cast that defines FP8 rounding is round-to-nearest-even on the format's value grid: random values,
    exact midpoints between neighbours, and subnormals; fake_quant with c = fmt_max is that cast."""
    m = FMT_MAX[fmt]
    g = torch.Generator().manual_seed(2)
    rand = (torch.rand(2000, generator=g, dtype=torch.float64) * 2 - 1) * m
    sub = 2.0 ** -8 if fmt == "fp8_e4m3" else 2.0 ** -15  # around the subnormal range
    tiny = torch.randn(500, generator=g, dtype=torch.float64) * sub
    vals, _ = fp8_grid(fmt)
    mids = torch.from_numpy((vals[1:] + vals[:-1]) / 2)  # exact ties, representable in fp32
    v = torch.cat([rand, tiny, mids]).float()
    expected = rne_on_grid(v.double().numpy(), fmt)
    cast = v.to(torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2).double().numpy()
    np.testing.assert_array_equal(cast, expected)
    q = fake_quant(v, fmt, clamp="static", static_value=m)
    np.testing.assert_array_equal(q.double().numpy(), expected)


def test_int8_hand_values_round_half_to_even_and_clip() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.4, 200.0, -300.0, 3.49])
    q = fake_quant(x, "int8", clamp="static", static_value=127.0)  # step exactly 1
    assert q.tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 126.0, 127.0, 127.0, -127.0, 3.0]


def test_fp8_e4m3_hand_values() -> None:
    # c = 448 -> scale 1: 1.0625 is the midpoint of 1 (mantissa 000) and 1.125 (001) -> 1; 1.1875 lies between
    # 1.125 (001) and 1.25 (010) -> 1.25; 500 is clipped to 448; 2^-10 is half the smallest subnormal -> 0.
    x = torch.tensor([1.0625, 1.1875, 500.0, 2.0 ** -10, 3 * 2.0 ** -10, -17.0])
    q = fake_quant(x, "fp8_e4m3", clamp="static", static_value=448.0)
    assert q.tolist() == [1.0, 1.25, 448.0, 0.0, 2.0 ** -8, -16.0]


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_straight_through_gradient(fmt: str, rule: str, gran: str) -> None:
    x = _input(3).requires_grad_(True)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    fake_quant(x, fmt, clamp=rule, granularity=gran, **_kwargs(rule)).backward(g)
    c = _ref_c(x.detach().double().numpy(), rule, gran)
    inside = np.abs(x.detach().double().numpy()) <= c * (1 + 1e-6)
    # the clamp rules with these alphas really clip something (except absmax with alpha<1 per tiny group)
    if rule != "absmax":
        assert (~inside).sum() > 0
    np.testing.assert_array_equal(x.grad.numpy(), np.where(inside, g.numpy(), 0.0))


def test_gradient_passes_at_the_boundary_and_not_beyond() -> None:
    x = torch.tensor([1.0, -1.0, 1.0001, -1.5, 0.3], requires_grad=True)
    fake_quant(x, "int8", clamp="static", static_value=1.0).backward(torch.full((5,), 2.0))
    assert x.grad.tolist() == [2.0, 2.0, 0.0, 0.0, 2.0]


def test_absmax_gradient_is_identity_and_c_gets_no_gradient() -> None:
    """With absmax the clamp depends on x (its max): a gradient through c would change the max's grad."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    g = torch.randn(4, 64)
    fake_quant(x, "int8", clamp="absmax", granularity="row").backward(g)
    assert torch.equal(x.grad, g)
    x.grad = None
    fake_quant(x, "fp8_e4m3", clamp="rms", granularity="tensor", alpha=100.0).backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("rule", ["absmax", "rms", "weight-rms"])
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_clamp_never_zero_or_nan(fmt: str, rule: str, gran: str) -> None:
    kw = {"predicted_rms": 0.0}  # a degenerate prediction (all-zero producing weights) must be floored too
    for scale in (0.0, 1e-25, 1e-15):
        x = (torch.randn(3, 200, generator=torch.Generator().manual_seed(6)) * scale).requires_grad_(True)
        c = compute_clamp(x, rule, granularity=gran, fmt=fmt, **kw)
        assert torch.all(c > 0) and torch.all(torch.isfinite(c))
        q = fake_quant(x, fmt, clamp=rule, granularity=gran, **kw)
        q.sum().backward()
        assert torch.all(torch.isfinite(q)) and torch.all(torch.isfinite(x.grad))
        if scale == 0.0:
            assert torch.all(q == 0)
        if scale == 1e-15 and rule != "weight-rms":
            # tiny but representable values are quantized relative to their own scale, not collapsed
            assert quantization_error_stats(x, q)["rel_rmse"] < 0.1


def test_bf16_input_keeps_dtype_and_matches_fp32_path() -> None:
    x = _input(7)
    for fmt in ("int8", "fp8_e4m3"):
        xb = x.bfloat16()
        qb = fake_quant(xb, fmt, clamp="rms", granularity="row")
        assert qb.dtype == torch.bfloat16
        q32 = fake_quant(xb.float(), fmt, clamp="rms", granularity="row")
        torch.testing.assert_close(qb, q32.bfloat16(), rtol=0, atol=0)


def test_statistic_shapes() -> None:
    x = torch.randn(2, 3, 300)
    assert compute_clamp(x, "rms", granularity="tensor").shape == ()
    assert compute_clamp(x, "rms", granularity="row").shape == (2, 3, 1)
    assert compute_clamp(x, "absmax", granularity="block").shape == (2, 3, 3, 1)
    assert compute_clamp(x, "absmax", granularity="block", block_size=100).shape == (2, 3, 3, 1)
    c = compute_clamp(x, "absmax", granularity="block")
    full = expand_clamp(c, x, "block")
    assert full.shape == x.shape
    assert torch.equal(full[0, 1, 256:], x[0, 1, 256:].abs().max().expand(44))


def test_per_block_prediction_broadcasts() -> None:
    x = torch.randn(4, 256)
    pred = torch.tensor([[0.5], [2.0]])  # one prediction per block of 128
    q = fake_quant(x, "int8", clamp="weight-rms", alpha=1.0, predicted_rms=pred, granularity="block")
    assert q[:, :128].abs().max() <= 0.5 and q[:, 128:].abs().max() > 0.5
    assert torch.allclose(q[:, :128].abs().max(), torch.tensor(0.5))


def test_quantization_error_stats_hand_computed() -> None:
    x = torch.tensor([0.0, 1.0, -2.0, 0.1, 4.0])
    q = torch.tensor([0.0, 1.0, -2.0, 0.0, 3.0])
    s = quantization_error_stats(x, q, torch.full((5,), 3.0))
    assert s["zeroed"] == pytest.approx(1 / 4)
    assert s["clipped"] == pytest.approx(1 / 5)
    assert s["rel_rmse"] == pytest.approx(np.sqrt(0.01 + 1.0) / np.sqrt(1 + 4 + 0.01 + 16))


@pytest.mark.parametrize("kwargs, match", [
    ({"fmt": "int4", "clamp": "absmax"}, "format"),
    ({"fmt": "int8", "clamp": "percentile"}, "clamp rule"),
    ({"fmt": "int8", "clamp": "absmax", "granularity": "column"}, "granularity"),
    ({"fmt": "int8", "clamp": "static"}, "static_value"),
    ({"fmt": "int8", "clamp": "static", "static_value": float("nan")}, "static_value"),
    ({"fmt": "int8", "clamp": "weight-rms"}, "predicted_rms"),
    ({"fmt": "int8", "clamp": "rms", "eps": 0.0}, "eps"),
])
def test_bad_arguments_raise_clear_errors(kwargs: dict, match: str) -> None:
    fmt = kwargs.pop("fmt")
    with pytest.raises(ValueError, match=match):
        fake_quant(torch.randn(4, 8), fmt, **kwargs)

"""GemmInputQuantizer / QATConfig: quantized GEMM inputs against the independent references, STE gradients
through the GEMM, output-gradient quantization, static-clamp state in checkpoints, attaching to TP layers,
TP invariance (2 gloo ranks), and the real int8 / FP8 GEMM backends against the fake-quant path."""
from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from testlib.distributed import run_distributed
from testlib.quant import ref_clamp, ref_fp8_cast, ref_int8
from torch import nn

from megatron_cai.core.quantization import (
    GemmInputQuantizer,
    QATConfig,
    apply_qat,
    attach_gemm_quantizers,
    quantize_output_grad,
)
from megatron_cai.core.quantization import gemm_backends as gb


def _xw(seed: int = 0, k: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 6, k, generator=g) * 1.7, torch.randn(40, k, generator=g) * 0.02


# ------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs, match", [
    ({"fmt": "int4"}, "--qat"),
    ({"fmt": "int8", "clamp": "p99"}, "--qat-clamp"),
    ({"fmt": "fp8", "fp8_format": "e5m2"}, "--fp8-format"),
    ({"fmt": "int8", "weight_clamp": "weight-rms"}, "weight_clamp"),
    ({"fmt": "int8", "granularity": "col"}, "granularity"),
    ({"fmt": "int8", "alpha": -1.0}, "alpha"),
    ({"fmt": "int8", "gemm_backend": "cutlass"}, "gemm_backend"),
])
def test_config_rejects_bad_values_naming_the_flag(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QATConfig(**kwargs)


def test_config_from_flags_and_derived_settings() -> None:
    from megatron_cai.training.arguments import parse_config

    base = ["--mock-data", "--vocab-size", "64", "--train-iters", "1"]
    cfg = parse_config(base + ["--qat", "fp8", "--qat-clamp", "weight-rms", "--qat-clamp-alpha", "20",
                               "--fp8-format", "hybrid", "--qat-granularity", "row"], world_size=1).model.qat
    assert (cfg.fmt, cfg.clamp, cfg.alpha, cfg.fp8_format, cfg.granularity) == ("fp8", "weight-rms", 20.0, "hybrid",
                                                                               "row")
    cfg = parse_config(base + ["--qat", "int8", "--qat-clamp", "static", "--qat-static-clamp", "2.5"], world_size=1)
    assert cfg.model.qat.static_value == 2.5
    assert parse_config(base, world_size=1).model.qat.enabled is False
    assert QATConfig.from_dict({}) == QATConfig()  # checkpoints saved before QATConfig: {} means off
    with pytest.raises(ValueError, match="unknown settings.*colour"):
        QATConfig.from_dict({"fmt": "int8", "colour": "red"})
    cases = {  # (fmt, fp8_format, quantize_output_grad) -> (output grad quantized, grad format)
        ("fp8", "hybrid", None): (True, "fp8_e5m2"),
        ("fp8", "e4m3", None): (False, "fp8_e4m3"),
        ("fp8", "e4m3", True): (True, "fp8_e4m3"),
        ("int8", "e4m3", None): (False, "fp8_e5m2"),
        ("int8", "e4m3", True): (True, "fp8_e5m2"),
        ("none", "hybrid", True): (False, "fp8_e5m2"),
    }
    for (fmt, f8, qg), (on, gfmt) in cases.items():
        cfg = QATConfig(fmt=fmt, fp8_format=f8, quantize_output_grad=qg)
        assert (cfg.output_grad_enabled, cfg.grad_fmt) == (on, gfmt), (fmt, f8, qg)
    assert QATConfig(fmt="fp8").operand_fmt == "fp8_e4m3" and QATConfig(fmt="int8").operand_fmt == "int8"


def test_disabled_quantizer_is_the_identity() -> None:
    x, w = _xw()
    q = GemmInputQuantizer(QATConfig())
    xq, wq = q(x, w)
    assert xq is x and wq is w
    b = torch.randn(40)
    assert torch.equal(q.linear(x, w, b), F.linear(x, w, b))
    assert len(q.state_dict()) == 0


# ------------------------------------------------------------------------------------------- forward, backward

@pytest.mark.parametrize("fmt, gran, wgran", [("int8", "tensor", "row"), ("int8", "row", "block"),
                                              ("fp8", "block", "row"), ("fp8", "tensor", "tensor")])
def test_quantized_inputs_match_reference(fmt: str, gran: str, wgran: str) -> None:
    x, w = _xw(1)
    cfg = QATConfig(fmt=fmt, clamp="rms", alpha=3.0, granularity=gran, weight_clamp="absmax",
                    weight_granularity=wgran)
    xq, wq = GemmInputQuantizer(cfg)(x, w)
    xn, wn = x.double().numpy(), w.double().numpy()
    cx, cw = ref_clamp(xn, "rms", gran, alpha=3.0), ref_clamp(wn, "absmax", wgran)
    if fmt == "int8":
        rx, rw = ref_int8(xn, cx), ref_int8(wn, cw)
    else:
        rx, rw = ref_fp8_cast(xn, cx, "fp8_e4m3"), ref_fp8_cast(wn, cw, "fp8_e4m3")
    np.testing.assert_allclose(xq.double().numpy(), rx, rtol=0, atol=1e-6 * cx.max())
    np.testing.assert_allclose(wq.double().numpy(), rw, rtol=0, atol=1e-6 * cw.max())


def test_linear_gradients_are_straight_through_the_gemm() -> None:
    x, w = _xw(2)
    x, w, b = x.requires_grad_(), w.requires_grad_(), torch.zeros(40, requires_grad=True)
    cfg = QATConfig(fmt="int8", clamp="static", static_value=2.0, weight_clamp="static",
                    weight_static_value=0.03)  # both clip a visible fraction
    y = GemmInputQuantizer(cfg).linear(x, w, b)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    y.backward(g)
    xn, wn = x.detach().double().numpy(), w.detach().double().numpy()
    xq, wq = ref_int8(xn, np.full_like(xn, 2.0)), ref_int8(wn, np.full_like(wn, 0.03))
    mx, mw = np.abs(xn) <= 2.0, np.abs(wn) <= 0.03
    assert 0 < (~mx).sum() and 0 < (~mw).sum()
    gn = g.double().numpy().reshape(-1, 40)
    np.testing.assert_allclose(y.detach().double().numpy(), xq @ wq.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x.grad.double().numpy(), (g.double().numpy() @ wq) * mx, rtol=1e-5, atol=1e-6)
    grad_w = (gn.T @ xq.reshape(-1, 300)) * mw
    np.testing.assert_allclose(w.grad.double().numpy(), grad_w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), gn.sum(0), rtol=1e-5, atol=1e-5)


def test_quantize_output_grad_is_identity_forward_and_e5m2_backward() -> None:
    y = torch.randn(8, 16, requires_grad=True)
    out = quantize_output_grad(y)
    assert torch.equal(out, y)
    g = torch.randn(8, 16, generator=torch.Generator().manual_seed(4)) * 1e-3
    out.backward(g)
    gn = g.double().numpy()
    expected = ref_fp8_cast(gn, np.full_like(gn, np.abs(gn).max()), "fp8_e5m2")
    np.testing.assert_allclose(y.grad.double().numpy(), expected, rtol=0, atol=1e-9)
    assert not torch.equal(y.grad, g)


def test_hybrid_fp8_quantizes_the_output_gradient_before_both_backward_gemms() -> None:
    x, w = _xw(5)
    x, w = x.requires_grad_(), w.requires_grad_()
    q = GemmInputQuantizer(QATConfig(fmt="fp8", fp8_format="hybrid", clamp="absmax", weight_clamp="absmax"))
    y = q.linear(x, w)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(6))
    y.backward(g)
    xq, wq = (t.detach() for t in q(x, w))
    gn = g.double().numpy()
    gq = torch.from_numpy(ref_fp8_cast(gn, np.full_like(gn, np.abs(gn).max()), "fp8_e5m2")).float()
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, gq.reshape(-1, 40).T @ xq.reshape(-1, 300), rtol=1e-5, atol=1e-5)


def test_weight_rms_uses_the_prediction_and_falls_back_to_rms() -> None:
    x, w = _xw(7)
    q = GemmInputQuantizer(QATConfig(fmt="int8", clamp="weight-rms", alpha=4.0))
    c_pred, rule = q.input_clamp(x, 0.25)
    assert rule == "weight-rms" and float(c_pred) == pytest.approx(1.0)
    c_fallback, rule = q.input_clamp(x)
    assert rule == "rms" and float(c_fallback) == pytest.approx(4.0 * float(x.pow(2).mean().sqrt()), rel=1e-6)
    xq, _ = q(x, w, predicted_input_rms=0.25)
    assert float(xq.abs().max()) == pytest.approx(1.0)  # values beyond c = 1 are clipped to it


# ------------------------------------------------------------------------------------------- state

class _Linear(nn.Module):
    """Stands in for a parallel linear: a weight with TP metadata and a gemm_quantizer slot."""

    def __init__(self, n_in: int, n_out: int, tp_dim: int | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.05)
        self.weight.tp_dim = tp_dim
        self.gemm_quantizer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm_quantizer is None:
            return F.linear(x, self.weight)
        return self.gemm_quantizer.linear(x, self.weight)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.output_layer = _Linear(32, 64, 0), _Linear(64, 32, 1), _Linear(32, 16, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.fc2(torch.relu(self.fc1(x)) ** 2))


def test_static_clamp_is_calibrated_once_and_restored_from_a_checkpoint() -> None:
    cfg = QATConfig(fmt="int8", clamp="static", weight_clamp="static")
    torch.manual_seed(0)
    model = _MLP()
    assert attach_gemm_quantizers(model, cfg) == 3
    x1, x2 = torch.randn(8, 32), torch.randn(8, 32) * 0.1
    model(x1)
    c1 = model.fc1.gemm_quantizer.input_static_c.clone()
    assert float(c1) == float(x1.abs().max())
    model(x2)  # a static clamp does not follow the data
    assert torch.equal(model.fc1.gemm_quantizer.input_static_c, c1)
    sd = model.state_dict()
    for name in ("fc1", "fc2", "output_layer"):
        for buffer in ("input_static_c", "weight_static_c"):
            assert f"{name}.gemm_quantizer.{buffer}" in sd
    buf = io.BytesIO()
    torch.save(sd, buf)
    torch.manual_seed(1)
    restored = _MLP()
    attach_gemm_quantizers(restored, cfg)
    restored(torch.randn(8, 32) * 5)  # calibrates to something else first; loading must override it
    buf.seek(0)
    restored.load_state_dict(torch.load(buf))
    assert torch.equal(restored(x2), model(x2))
    fresh = _MLP()
    fresh.load_state_dict({k: v for k, v in sd.items() if "static_c" not in k}, strict=False)
    attach_gemm_quantizers(fresh, cfg)
    assert not torch.equal(fresh(x2), model(x2))  # without the restored state it calibrates on x2


def test_attach_reads_the_tp_split_and_honours_exclude() -> None:
    model = _MLP()
    n = attach_gemm_quantizers(model, QATConfig(fmt="fp8"), exclude=("output_layer",))
    assert n == 2 and model.output_layer.gemm_quantizer is None
    assert (model.fc1.gemm_quantizer.weight_shard_dim, model.fc1.gemm_quantizer.input_sharded) == (0, False)
    assert (model.fc2.gemm_quantizer.weight_shard_dim, model.fc2.gemm_quantizer.input_sharded) == (1, True)
    assert attach_gemm_quantizers(_MLP(), QATConfig()) == 0
    other = _MLP()  # apply_qat: the training loop's entry, settings as GPTConfig.qat holds them
    settings = {"fmt": "int8", "clamp": "weight-rms", "alpha": None, "static_value": None, "fp8_format": "hybrid"}
    assert apply_qat(other, settings) == 2 and other.output_layer.gemm_quantizer is None
    assert other.fc2.gemm_quantizer.config.clamp == "weight-rms"
    y = model(torch.randn(4, 32))
    assert torch.isfinite(y).all()


# ------------------------------------------------------------------------------------------- TP invariance

def _tp_worker(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, 5, 256, generator=g)       # replicated input of the column-parallel layer
    w_col = torch.randn(64, 256, generator=g) * 0.02
    h = torch.randn(3, 5, 256, generator=g) ** 2   # input of the row-parallel layer (split along K)
    w_row = torch.randn(48, 256, generator=g) * 0.02
    errors = []
    for gran in ("tensor", "row", "block"):
        for rule in ("absmax", "rms"):
            def same(a: torch.Tensor, b: torch.Tensor, rule=rule) -> bool:
                return torch.equal(a, b) if rule == "absmax" else torch.allclose(a, b, rtol=1e-6, atol=0)

            cfg = QATConfig(fmt="int8", clamp=rule, granularity=gran, weight_clamp=rule, weight_alpha=3.0,
                            weight_granularity=gran)
            full = GemmInputQuantizer(cfg)
            col = GemmInputQuantizer(cfg, tp_group=group, weight_shard_dim=0)
            row = GemmInputQuantizer(cfg, tp_group=group, weight_shard_dim=1, input_sharded=True)
            xq, wq = full(x, w_col)
            xq_r, wq_r = col(x, w_col.chunk(world, 0)[rank])
            if not (same(xq_r, xq) and same(wq_r, wq.chunk(world, 0)[rank])):
                errors.append(f"column-parallel {gran}/{rule} differs from the unsplit layer")
            hq, wq = full(h, w_row)
            hq_r, wq_r = row(h.chunk(world, -1)[rank], w_row.chunk(world, 1)[rank])
            # all-reduced sums of squares differ from the unsplit sum by fp32 rounding only
            for got, want in ((hq_r, hq.chunk(world, -1)[rank]), (wq_r, wq.chunk(world, 1)[rank])):
                if not same(got, want):
                    err = float((got - want).abs().max() / want.abs().max())
                    errors.append(f"row-parallel {gran}/{rule} differs from the unsplit layer by {err:.2e}")
            y = row.linear(h.chunk(world, -1)[rank], w_row.chunk(world, 1)[rank])
            dist.all_reduce(y, group=group)
            if not torch.allclose(y, full.linear(h, w_row), rtol=1e-5, atol=1e-6):
                errors.append(f"row-parallel {gran}/{rule}: summed partial outputs differ")
    return errors


def test_quantization_is_tp_invariant() -> None:
    assert run_distributed(_tp_worker, world_size=2, timeout=120) == [[], []]


# ------------------------------------------------------------------------------------------- real GEMMs

COMBOS = [("tensor", "row"), ("row", "row"), ("block", "block"), ("row", "block"), ("tensor", "tensor")]


def _compare_real_to_fake(fmt: str, gran: str, wgran: str, device: str, m: int, k: int, n: int,
                          rel_tol: float = 1e-5) -> None:
    """Forward equal up to accumulation order (rel_tol of max|y|); backward identical formulas."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(m, k, generator=g) * 2).to(device)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device)
    cfg = QATConfig(fmt=fmt, clamp="rms", granularity=gran, weight_granularity=wgran)
    fake, real = GemmInputQuantizer(cfg), GemmInputQuantizer(dataclasses.replace(cfg, gemm_backend="real"))
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ws = [w.clone().requires_grad_() for _ in range(2)]
    b = torch.randn(n, generator=g).to(device)
    y_fake, y_real = fake.linear(xs[0], ws[0], b), real.linear(xs[1], ws[1], b)
    scale = float(y_fake.detach().abs().max())
    torch.testing.assert_close(y_real, y_fake, rtol=0, atol=rel_tol * scale)
    gy = torch.randn(y_fake.shape, generator=g).to(device)
    y_fake.backward(gy)
    y_real.backward(gy)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ws[1].grad, ws[0].grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gran, wgran", COMBOS)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_real_gemm_matches_fake_quant_on_cpu(fmt: str, gran: str, wgran: str) -> None:
    op = "int8" if fmt == "int8" else "fp8_e4m3"
    if not gb.real_gemm_available(op, "cpu", require_gpu=False):
        pytest.skip(f"this torch build has no CPU {op} GEMM")
    _compare_real_to_fake(fmt, gran, wgran, "cpu", m=10, k=300, n=40)  # odd sizes exercise the padding


def test_gemm_codes_against_integer_matmul() -> None:
    if not gb.real_gemm_available("int8", "cpu", require_gpu=False):
        pytest.skip("this torch build has no CPU int8 GEMM")
    g = torch.Generator().manual_seed(9)
    a = torch.randint(-127, 128, (5, 37), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (11, 37), generator=g, dtype=torch.int8)
    assert torch.equal(gb.gemm_codes(a, b, "int8"), (a.long() @ b.long().T).float())


def test_transformer_engine_helpers_without_te() -> None:
    if gb.transformer_engine_available():
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(ImportError, match="transformer_engine"):
        gb.te_fp8_recipe("hybrid")
    with gb.te_fp8_autocast(enabled=False):
        pass


def test_transformer_engine_recipe() -> None:
    pytest.importorskip("transformer_engine")
    from transformer_engine.common.recipe import Format

    assert gb.te_fp8_recipe("hybrid").fp8_format == Format.HYBRID
    assert gb.te_fp8_recipe("e4m3").fp8_format == Format.E4M3


@pytest.mark.gpu
@pytest.mark.parametrize("gran, wgran", COMBOS)
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_real_gemm_matches_fake_quant_on_gpu(fmt: str, gran: str, wgran: str) -> None:
    op = "int8" if fmt == "int8" else "fp8_e4m3"
    if not gb.real_gemm_available(op, "cuda"):
        pytest.skip(f"this GPU has no {op} GEMM")
    # FP8 tensor cores accumulate with fewer than 24 bits between promotions: a looser forward tolerance
    tol = 1e-5 if fmt == "int8" else 2e-3
    _compare_real_to_fake(fmt, gran, wgran, "cuda", m=256, k=512, n=384, rel_tol=tol)
    _compare_real_to_fake(fmt, gran, wgran, "cuda", m=9, k=200, n=40, rel_tol=tol)  # padded shapes


@pytest.mark.gpu
def test_auto_backend_uses_the_real_gemm_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not gb.real_gemm_available("int8", "cuda"):
        pytest.skip("this GPU has no int8 GEMM")
    calls = []
    original = gb.gemm_codes
    monkeypatch.setattr(gb, "gemm_codes", lambda *a: calls.append(1) or original(*a))
    q = GemmInputQuantizer(QATConfig(fmt="int8", gemm_backend="auto"))
    q.linear(torch.randn(32, 64, device="cuda"), torch.randn(16, 64, device="cuda"))
    assert calls

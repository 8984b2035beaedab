"""QAT inside the GPT model: every quantized linear gets the weight-rms prediction it should (checked against
formulas and numerical integration written here), predictions cost nothing under other rules, and the
Transformer Engine path fails at start-up without TE / CUDA (GPU tests where TE is installed)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.models.gpt.config import GPTConfig
from megatron_cai.core.models.gpt.model import GPTModel
from megatron_cai.core.quantization import apply_qat
from megatron_cai.core.quantization import dynamic_clamp as dc
from megatron_cai.core.quantization import gemm_backends as gb
from megatron_cai.core.quantization.qat_linear import GemmInputQuantizer

ALPHA = 4.0


@pytest.fixture(autouse=True)
def _single_process_parallel_state():
    if ps.model_parallel_is_initialized():
        yield
        return
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()


def _gaussian_ms(fn, s: float) -> float:
    """E[fn(h)^2] for h ~ N(0, s^2), trapezoid rule on a fine grid over +-12 s (numpy, float64)."""
    h = np.linspace(-12 * s, 12 * s, 400_001)
    pdf = np.exp(-0.5 * (h / s) ** 2) / (s * math.sqrt(2 * math.pi))
    return float(np.trapezoid(fn(h) ** 2 * pdf, h))


def _np_gelu_tanh(h):
    return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))


def _np_gelu_erf(h):
    return 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))


def _np_silu(h):
    return h / (1 + np.exp(-h))


def _rms(t: torch.Tensor) -> float:
    return float(np.sqrt(np.mean(t.detach().double().numpy() ** 2)))


def _model(activation: str, normalization: str, bias: bool) -> GPTModel:
    cfg = GPTConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=64, seq_length=8,
                    hidden_dropout=0.0, attention_dropout=0.0, activation=activation, normalization=normalization,
                    add_bias_linear=bias, init_method_std=0.05)
    model = GPTModel(cfg)
    model.initialize(3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # norms far from their init, different per block of 128, so the checks bite
        for name, p in model.named_parameters():
            if "layernorm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=g) + torch.tensor([0.3] * 128 + [1.5] * 128))
            elif "layernorm" in name and name.endswith("bias"):
                p.normal_(0.0, 0.4, generator=g)
    return model


def _record(model) -> dict[str, dict]:
    """Wrap every quantizer's input_clamp: keep its activation, the clamp and the rule of the last call."""
    seen = {}
    for name, q in model.named_modules():
        if isinstance(q, GemmInputQuantizer):
            original = q.input_clamp

            def input_clamp(x, predicted_input_rms=None, name=name, original=original):
                c, rule = original(x, predicted_input_rms)
                seen[name.removesuffix(".gemm_quantizer")] = {"x": x.detach(), "c": c, "rule": rule}
                return c, rule

            q.input_clamp = input_clamp
    return seen


def _norm_prediction(norm, granularity: str) -> np.ndarray:
    g2 = norm.weight.detach().double().numpy() ** 2
    if getattr(norm, "bias", None) is not None:
        g2 = g2 + norm.bias.detach().double().numpy() ** 2
    if granularity == "block":
        return np.sqrt(g2.reshape(-1, 128).mean(axis=1, keepdims=True))
    return np.sqrt(np.array(g2.mean()))


@pytest.mark.parametrize("activation, normalization, bias, granularity", [
    ("relu2", "LayerNorm", True, "tensor"),
    ("relu2", "RMSNorm", True, "block"),
    ("gelu_tanh", "LayerNorm", True, "row"),
    ("gelu_erf", "RMSNorm", True, "tensor"),
    ("swiglu", "RMSNorm", False, "tensor"),
])
def test_weight_rms_predictions_reach_every_linear(activation, normalization, bias, granularity):
    model = _model(activation, normalization, bias)
    assert apply_qat(model, {"fmt": "int8", "clamp": "weight-rms", "alpha": ALPHA, "granularity": granularity}) == 10
    seen = _record(model)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    model(tokens, torch.arange(8).expand(2, 8))
    assert len(seen) == 10
    for i in range(2):
        layer = model.decoder.layers[str(i)]
        pre = f"decoder.layers.{i}."
        for lin, norm in (("self_attention.linear_q", layer.input_layernorm),
                          ("self_attention.linear_kv", layer.input_layernorm),
                          ("mlp.linear_fc1", layer.pre_mlp_layernorm)):
            got = seen[pre + lin]
            assert got["rule"] == "weight-rms"
            np.testing.assert_allclose(got["c"].double().numpy(), ALPHA * _norm_prediction(norm, granularity),
                                       rtol=1e-6)
        # fc2: from fc1's weights and the (per-tensor) prediction of the fc1 input.
        r_x = float(_norm_prediction(layer.pre_mlp_layernorm, "tensor"))
        fc1 = layer.mlp.linear_fc1
        d = fc1.weight.shape[1]

        def pre_rms(w, b, d=d, r_x=r_x):
            return math.sqrt(_rms(w) ** 2 * d * r_x ** 2 + (_rms(b) ** 2 if b is not None else 0.0))

        if activation == "relu2":  # E[relu(h)^4] = 3 s^4 / 2
            want = math.sqrt(1.5) * pre_rms(fc1.weight, fc1.bias) ** 2
        elif activation in ("gelu_tanh", "gelu_erf"):
            np_gelu = _np_gelu_tanh if activation == "gelu_tanh" else _np_gelu_erf
            want = math.sqrt(_gaussian_ms(np_gelu, pre_rms(fc1.weight, fc1.bias)))
        else:
            w_gate, w_up = fc1.weight.chunk(2)
            want = math.sqrt(_gaussian_ms(_np_silu, pre_rms(w_gate, None))) * pre_rms(w_up, None)
        got = seen[pre + "mlp.linear_fc2"]
        assert got["rule"] == "weight-rms"
        assert float(got["c"]) == pytest.approx(ALPHA * want, rel=1e-5)
        # linear_proj: no weight-only prediction of an attention output; measured RMS instead.
        got = seen[pre + "self_attention.linear_proj"]
        assert got["rule"] == "rms"
        x = got["x"].double().numpy()
        if granularity == "tensor":
            want = np.sqrt(np.mean(x ** 2))
        elif granularity == "row":
            want = np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True))
        else:
            want = np.sqrt(np.mean(x.reshape(*x.shape[:-1], -1, 128) ** 2, axis=-1, keepdims=True))
        np.testing.assert_allclose(got["c"].double().numpy(), ALPHA * want, rtol=1e-5)


@pytest.mark.parametrize("activation", ["relu2", "gelu_tanh", "gelu_erf", "swiglu"])
def test_ffn_prediction_tracks_the_activation_at_random_weights(activation):
    """The premise of weight-rms: with weights not aligned to the input, the fc2-input RMS is predictable."""
    g = torch.Generator().manual_seed(6)
    d, ffn = 512, 1024
    norm_w = torch.rand(d, generator=g) + 0.5
    x = torch.randn(2048, d, generator=g) * 3.0 + 1.0
    x = F.layer_norm(x, (d,), norm_w)
    rows = 2 * ffn if activation == "swiglu" else ffn
    w = torch.randn(rows, d, generator=g) * 0.03
    b = torch.randn(rows, generator=g) * 0.1
    h = F.linear(x, w, b)
    if activation == "relu2":
        act = F.relu(h).square()
    elif activation in ("gelu_tanh", "gelu_erf"):
        act = F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none")
    else:
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate) * up
    predicted = dc.predict_ffn_rms(w, dc.post_norm_rms(norm_w), b, activation=activation)
    assert float(predicted) == pytest.approx(_rms(act), rel=0.05)


@pytest.mark.parametrize("s", [0.05, 1.0, 7.0])
def test_gaussian_activation_rms_against_numerical_integration(s):
    assert float(dc.gaussian_activation_rms(lambda h: h, s)) == pytest.approx(s, rel=1e-6)
    for torch_fn, np_fn in ((F.silu, _np_silu), (lambda h: F.gelu(h, approximate="tanh"), _np_gelu_tanh),
                            (F.gelu, _np_gelu_erf)):
        want = math.sqrt(_gaussian_ms(np_fn, s))
        assert float(dc.gaussian_activation_rms(torch_fn, s)) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="activation"):
        dc.predict_ffn_rms(torch.ones(4, 4), 1.0, activation="tanh")


def test_other_rules_never_evaluate_predictions(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a weight-rms prediction was evaluated")

    monkeypatch.setattr(dc.NormOutputRMS, "__call__", boom)
    monkeypatch.setattr(dc.FFNHiddenRMS, "__call__", boom)
    model = _model("relu2", "LayerNorm", True)
    apply_qat(model, {"fmt": "fp8", "clamp": "rms"})
    seen = _record(model)
    model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None])
    assert {v["rule"] for v in seen.values()} == {"rms"} and len(seen) == 10
    with pytest.raises(AssertionError, match="prediction was evaluated"):
        apply_qat(model, {"fmt": "fp8", "clamp": "weight-rms"})  # re-attach: now they are used
        model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None])


# ------------------------------------------------------------------------------------------- Transformer Engine

def _argv(*extra: str) -> list[str]:
    return ["--mock-data", "--vocab-size", "64", "--train-iters", "1", "--num-layers", "2", *extra]


def test_transformer_engine_impl_runs_locally_with_one_line_where_te_cannot(capsys):
    """--transformer-impl transformer_engine (every recent Megatron-LM script sets it): Transformer Engine runs
    the FP8 GEMMs where it is installed (CUDA); otherwise, and in other precisions, the local implementation
    runs, with one start-up line saying so (it used to be refused)."""
    import pretrain_gpt
    from megatron_cai.training.arguments import parse_config

    bf16 = parse_config(_argv("--transformer-impl", "transformer_engine", "--bf16"), world_size=1)
    assert bf16.model.qat.fmt == "none" and bf16.flags["transformer_impl"] == "transformer_engine"
    assert bf16.logging.megatron_notes == [" > --transformer-impl transformer_engine: the local implementation runs "
                                           "(bf16: PyTorch's GEMMs, the same math; Transformer Engine is used here "
                                           "for FP8 GEMMs only)"]
    int8 = parse_config(_argv("--transformer-impl", "transformer_engine", "--qat", "int8"), world_size=1)
    assert int8.model.qat.gemm_backend == "fake" and len(int8.logging.megatron_notes) == 1
    fp8 = _argv("--transformer-impl", "transformer_engine", "--qat", "fp8", "--device", "cpu")
    cfg = parse_config(fp8, world_size=1)
    assert cfg.model.qat.gemm_backend == "fake"
    why = "runs on CUDA only" if gb.transformer_engine_available() else "is not installed"
    assert cfg.logging.megatron_notes == [f" > --transformer-impl transformer_engine: Transformer Engine {why}; "
                                          "FP8 training runs our fake-quantized FP8 QAT (--transformer-impl local)"]
    assert pretrain_gpt.main(fp8 + ["--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "8",
                                    "--max-position-embeddings", "8", "--micro-batch-size", "1", "--eval-iters",
                                    "0", "--num-workers", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith(" > --transformer-impl transformer_engine:") for line in lines) == 1
    assert parse_config(_argv("--qat", "fp8"), world_size=1).model.qat.gemm_backend == "fake"


@pytest.mark.gpu
def test_te_linear_is_an_fp8_gemm_with_gradients_to_our_weight():
    pytest.importorskip("transformer_engine")
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(64, 256, device="cuda", generator=g)
    w = torch.nn.Parameter(torch.randn(128, 256, device="cuda", generator=g) * 0.02)
    cache: dict = {}
    exact = F.linear(x, w)
    for _ in range(3):  # delayed scaling: the amax history fills during the first steps
        w.grad = None
        with gb.te_fp8_autocast(True, "hybrid"):
            y = gb.te_linear(x, w, cache)
        y.sum().backward()
    err = float((y.detach() - exact).norm() / exact.norm())
    assert 1e-4 < err < 0.05, f"FP8 GEMM relative error {err}"  # quantized, but not garbage
    assert cache["module"].weight is w  # TE's module computes with our parameter
    grad_exact = torch.ones_like(exact).T @ x
    assert w.grad is not None
    assert float((w.grad - grad_exact).norm() / grad_exact.norm()) < 0.05


@pytest.mark.gpu
def test_training_with_transformer_engine_fp8():
    pytest.importorskip("transformer_engine")
    from testlib.train import train

    argv = _argv("--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                 "--max-position-embeddings", "16", "--micro-batch-size", "4", "--make-vocab-size-divisible-by",
                 "16", "--qat", "fp8", "--transformer-impl", "transformer_engine", "--train-iters", "3",
                 "--eval-iters", "0", "--eval-interval", "0", "--device", "cuda", "--lr", "1e-3", "--bf16")
    modules = []

    def hook(trainer):
        modules.extend(q for q in trainer.model[0].module.modules() if isinstance(q, GemmInputQuantizer))

    out = train(argv, trainer_hook=hook)
    assert len(modules) == 10 and all("module" in q._te_cache for q in modules)
    assert all(q.last_input_rule == "transformer_engine" for q in modules)
    assert all(math.isfinite(h["lm loss"]) for h in out["history"])

"""Quantization-aware training: int8 / FP8 fake quantization with dynamic clamping.

- :mod:`.fake_quant`: ``fake_quant`` (formats, granularities, straight-through estimator).
- :mod:`.dynamic_clamp`: clamp rules (absmax, static, rms, weight-rms) and the weight-RMS predictions.
- :mod:`.qat_linear`: ``QATConfig``, ``GemmInputQuantizer`` (what the parallel linears call),
  ``quantize_output_grad``, ``attach_gemm_quantizers``.
- :mod:`.gemm_backends`: optional real int8 / FP8 GEMMs and the Transformer Engine helper.
"""
from .dynamic_clamp import (
    BLOCK_SIZE,
    CLAMP_RULES,
    DEFAULT_ALPHA,
    DEFAULT_EPS,
    GRANULARITIES,
    compute_clamp,
    default_alpha,
    group_absmax,
    group_rms,
    linear_output_rms,
    post_norm_rms,
    predict_relu2_ffn_rms,
    relu2_rms,
    relu_rms,
    weight_rms,
)
from .fake_quant import (
    FORMATS,
    expand_clamp,
    fake_quant,
    fake_quant_with_clamp,
    fmt_max,
    quantization_error_stats,
    quantize_codes,
)
from .qat_linear import GemmInputQuantizer, QATConfig, apply_qat, attach_gemm_quantizers, quantize_output_grad

__all__ = [
    "BLOCK_SIZE", "CLAMP_RULES", "DEFAULT_ALPHA", "DEFAULT_EPS", "FORMATS", "GRANULARITIES",
    "GemmInputQuantizer", "QATConfig", "apply_qat", "attach_gemm_quantizers", "compute_clamp", "default_alpha",
    "expand_clamp", "fake_quant", "fake_quant_with_clamp", "fmt_max", "group_absmax", "group_rms",
    "linear_output_rms", "post_norm_rms", "predict_relu2_ffn_rms", "quantization_error_stats",
    "quantize_codes", "quantize_output_grad", "relu2_rms", "relu_rms", "weight_rms",
]

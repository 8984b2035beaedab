"""QATConfig: the typed settings of quantization-aware training (no torch needed to build one).

Built by ``megatron_cai.training.arguments.build_config`` from ``--qat``, ``--qat-clamp``,
``--qat-clamp-alpha``, ``--qat-static-clamp``, ``--qat-granularity``, ``--fp8-format`` and
``--transformer-impl``; held by ``GPTConfig.qat``. Core code never sees the flags themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

from .dynamic_clamp import BLOCK_SIZE, CLAMP_RULES, DEFAULT_EPS, GRANULARITIES

QAT_FORMATS = ("none", "int8", "fp8")
FP8_FORMATS = ("e4m3", "hybrid")
GEMM_BACKENDS = ("fake", "real", "auto", "transformer_engine")


@dataclass
class QATConfig:
    """Quantization-aware training of the GEMM inputs (flags: --qat, --qat-clamp, --qat-clamp-alpha,
    --qat-static-clamp, --qat-granularity, --fp8-format, --transformer-impl).

    ``fmt``: "none" | "int8" | "fp8" (FP8 forward operands are E4M3).
    Activations (the GEMM's X): ``clamp`` rule, ``alpha`` (None: dynamic_clamp.default_alpha),
    ``static_value`` (for "static"; None: calibrate from the first batch's absmax), ``granularity``.
    Weights: ``weight_clamp`` ("absmax" | "rms" | "static"), ``weight_alpha``, ``weight_static_value``,
    ``weight_granularity`` (per output row by default).
    ``fp8_format``: "e4m3" or "hybrid" (E4M3 forward, E5M2 output gradient in backward, as in
    Transformer Engine). ``quantize_output_grad``: fake-quantize dL/dy before the backward GEMMs (per
    tensor absmax); None means on for fp8 hybrid only. The gradient format is E5M2, except E4M3 for
    fp8 with fp8_format "e4m3".
    ``gemm_backend``: "fake" (fake quant + high-precision GEMM, the reference), "real" (torch._int_mm /
    torch._scaled_mm on any device that runs them), "auto" (real on CUDA GPUs that have them, else fake),
    "transformer_engine" (fp8 only: the GEMM runs in a TE Linear under TE's FP8 autocast, with TE's
    delayed-scaling amax recipe instead of the clamp rules; see gemm_backends.te_linear).
    """

    fmt: str = "none"
    clamp: str = "rms"
    alpha: float | None = None
    static_value: float | None = None
    granularity: str = "tensor"
    weight_clamp: str = "absmax"
    weight_alpha: float | None = None
    weight_static_value: float | None = None
    weight_granularity: str = "row"
    fp8_format: str = "e4m3"
    quantize_output_grad: bool | None = None
    gemm_backend: str = "fake"
    block_size: int = BLOCK_SIZE
    eps: float = DEFAULT_EPS

    def __post_init__(self) -> None:
        def bad(flag: str, value, allowed) -> ValueError:
            return ValueError(f"QATConfig: {flag} {value!r} is not one of {', '.join(map(str, allowed))}")

        if self.fmt not in QAT_FORMATS:
            raise bad("--qat", self.fmt, QAT_FORMATS)
        if self.clamp not in CLAMP_RULES:
            raise bad("--qat-clamp", self.clamp, CLAMP_RULES)
        if self.weight_clamp not in ("absmax", "rms", "static"):
            raise bad("weight_clamp (weights use their own RMS: 'rms')", self.weight_clamp,
                      ("absmax", "rms", "static"))
        for name in ("granularity", "weight_granularity"):
            if getattr(self, name) not in GRANULARITIES:
                raise bad(name, getattr(self, name), GRANULARITIES)
        if self.fp8_format not in FP8_FORMATS:
            raise bad("--fp8-format", self.fp8_format, FP8_FORMATS)
        if self.gemm_backend not in GEMM_BACKENDS:
            raise bad("gemm_backend", self.gemm_backend, GEMM_BACKENDS)
        if self.gemm_backend == "transformer_engine" and self.fmt not in ("fp8", "none"):
            raise ValueError(f"QATConfig: --transformer-impl transformer_engine runs FP8 GEMMs; it needs --qat "
                             f"fp8, not {self.fmt!r}")
        for name in ("alpha", "weight_alpha", "static_value", "weight_static_value"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"QATConfig: {name} must be > 0, got {v}")
        if self.block_size < 1 or self.eps <= 0:
            raise ValueError(f"QATConfig: block_size ({self.block_size}) must be >= 1 and eps "
                             f"({self.eps}) > 0")

    @classmethod
    def from_dict(cls, d: dict | None) -> QATConfig:
        """From ``dataclasses.asdict`` output, or the settings dict of older checkpoints ({}: QAT off).

        Unknown keys are an error naming them (a checkpoint from a newer version, or a typo)."""
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"QATConfig: unknown settings {unknown}")
        return cls(**d)

    @property
    def enabled(self) -> bool:
        return self.fmt != "none"

    @property
    def operand_fmt(self) -> str:
        """The fake-quant format of the forward GEMM operands."""
        return "int8" if self.fmt == "int8" else "fp8_e4m3"

    @property
    def output_grad_enabled(self) -> bool:
        if self.quantize_output_grad is None:
            return self.fmt == "fp8" and self.fp8_format == "hybrid"
        return self.enabled and self.quantize_output_grad

    @property
    def grad_fmt(self) -> str:
        return "fp8_e4m3" if self.fmt == "fp8" and self.fp8_format == "e4m3" else "fp8_e5m2"

"""Fake quantization to int8 / FP8 with a straight-through estimator.

For a clamp range ``c`` (see :mod:`.dynamic_clamp`) and a format with largest magnitude ``fmt_max``
(127 for int8, 448 for FP8 E4M3, 57344 for FP8 E5M2), the dequantization scale is ``s = c / fmt_max``
and::

    codes = Q(clamp(x, -c, c) / s)          # Q: round-half-to-even for int8 (levels -127..127),
                                            #    a cast to torch.float8_e4m3fn / float8_e5m2 for FP8
    x_q   = codes * s

so int8 has the uniform step ``c / 127`` and FP8 rounds exactly as the float8 cast of the scaled value.
The math runs in fp32 whatever the input dtype; the result is cast back to the input dtype (for bf16
inputs that final cast may round ``x_q``). ``codes`` and ``s`` are what a real low-precision GEMM
consumes (:mod:`.gemm_backends`), so ``x_q`` is exactly its dequantized operand.

Backward is the straight-through estimator: the gradient passes unchanged where ``|x| <= c`` and is zero
where ``x`` was clipped; ``c`` itself receives no gradient.
"""
from __future__ import annotations

import torch

from .dynamic_clamp import BLOCK_SIZE, DEFAULT_EPS, compute_clamp, to_groups

FORMATS: dict[str, float] = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fmt_max(fmt: str) -> float:
    """Largest representable magnitude of a format's codes."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown quantization format {fmt!r}; expected one of "
                         f"{', '.join(FORMATS)}") from None


def quantize_codes(x: torch.Tensor, c: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, s)`` with ``codes`` the format's values as fp32 (integers for int8) and ``s = c / fmt_max``.

    ``x`` is fp32 (a grouped view, see :func:`.dynamic_clamp.to_groups`), ``c`` broadcastable to it.
    """
    m = fmt_max(fmt)
    s = c / m
    y = torch.clamp(x, min=-c, max=c) / s
    y = y.clamp(-m, m)  # c / (c / m) may exceed m by an ulp; never let it reach a cast's overflow path
    if fmt == "int8":
        return torch.round(y), s
    return y.to(FP8_DTYPES[fmt]).float(), s


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, c: torch.Tensor, fmt: str, clip_possible: bool) -> torch.Tensor:
        xf = x.float()
        codes, s = quantize_codes(xf, c, fmt)
        if clip_possible:
            ctx.save_for_backward(xf.abs() <= c)
        ctx.clip_possible = clip_possible
        return (codes * s).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.clip_possible:
            return grad, None, None, None
        (inside,) = ctx.saved_tensors
        return grad * inside.to(grad.dtype), None, None, None


def fake_quant_with_clamp(x: torch.Tensor, fmt: str, c: torch.Tensor, *, granularity: str = "tensor",
                          block_size: int = BLOCK_SIZE, clip_possible: bool = True) -> torch.Tensor:
    """Fake-quantize ``x`` with a precomputed clamp ``c`` (statistic shape of ``granularity``), STE backward.

    ``clip_possible=False`` (valid when ``c >= max|x|``, e.g. absmax with alpha >= 1) skips saving the
    STE mask.
    """
    fmt_max(fmt)
    xg, restore = to_groups(x, granularity, block_size)
    c = c.detach().to(device=x.device, dtype=torch.float32)
    return restore(_FakeQuant.apply(xg, c, fmt, clip_possible))


def fake_quant(x: torch.Tensor, fmt: str, *, clamp: str, alpha: float | None = None,
               static_value: float | torch.Tensor | None = None,
               predicted_rms: float | torch.Tensor | None = None, granularity: str = "tensor",
               block_size: int = BLOCK_SIZE, eps: float = DEFAULT_EPS, group=None) -> torch.Tensor:
    """Fake-quantize ``x`` to ``fmt`` ("int8", "fp8_e4m3", "fp8_e5m2") with a straight-through estimator.

    ``clamp``: "absmax" | "static" | "rms" | "weight-rms"; ``alpha`` multiplies the absmax/RMS statistic
    (None: 1 for absmax, ``dynamic_clamp.DEFAULT_ALPHA`` for rms and weight-rms); ``static_value`` is
    the fixed range for "static"; ``predicted_rms`` the caller's RMS prediction for "weight-rms".
    ``granularity``: "tensor", "row" (a slice along the last dim) or "block" (``block_size`` elements
    of the last dim). ``c`` is floored at ``eps`` and carries no gradient. ``group``: all-reduce the
    statistic over this process group (a TP-split tensor; see ``dynamic_clamp.needs_group_reduction``).
    """
    fmt_max(fmt)
    c = compute_clamp(x, clamp, granularity=granularity, alpha=alpha, static_value=static_value,
                      predicted_rms=predicted_rms, fmt=fmt, eps=eps, block_size=block_size, group=group)
    clip_possible = not (clamp == "absmax" and (alpha is None or alpha >= 1.0))
    return fake_quant_with_clamp(x, fmt, c, granularity=granularity, block_size=block_size,
                                 clip_possible=clip_possible)


def expand_clamp(c: torch.Tensor, x: torch.Tensor, granularity: str,
                 block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The clamp range ``c`` (statistic shape) broadcast back to ``x``'s shape, one value per element."""
    xg, restore = to_groups(x, granularity, block_size)
    return restore(c.to(x.device).float().expand_as(xg).contiguous())


@torch.no_grad()
def quantization_error_stats(x: torch.Tensor, x_q: torch.Tensor, c_full: torch.Tensor | None = None
                             ) -> dict[str, float]:
    """How much a quantization lost: ``zeroed`` (fraction of non-zero values that became 0), ``clipped``
    (fraction of all values with ``|x| > c``; needs ``c_full`` from :func:`expand_clamp`) and ``rel_rmse``
    (``||x_q - x|| / ||x||``)."""
    x, x_q = x.float(), x_q.float()
    nonzero = x != 0
    n_nonzero = int(nonzero.sum())
    zeroed = float((nonzero & (x_q == 0)).sum()) / n_nonzero if n_nonzero else 0.0
    norm = float(x.norm())
    out = {"zeroed": zeroed, "rel_rmse": float((x_q - x).norm()) / norm if norm > 0 else 0.0}
    if c_full is not None:
        out["clipped"] = float((x.abs() > c_full).float().mean())
    return out

"""Independent references for the quantization tests: float64 numpy loops over groups, written from the
spec (not from the library): clamp per group, int8 rounding, FP8 by direct torch float8 casts, and an
FP8 round-to-nearest-even on the enumerated grid of codes."""
from __future__ import annotations

import numpy as np
import torch

FMT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def ref_clamp(x: np.ndarray, rule: str, granularity: str, *, alpha: float = 1.0, static: float | None = None,
              predicted: float | None = None, block: int = 128, eps: float = 1e-30) -> np.ndarray:
    """The clamp range of every element of x (same shape), float64, by explicit loops over groups."""
    x = np.asarray(x, dtype=np.float64)
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty_like(rows)

    def stat(v: np.ndarray) -> float:
        if rule == "absmax":
            return alpha * float(np.max(np.abs(v)))
        if rule == "rms":
            return alpha * float(np.sqrt(np.mean(v * v)))
        if rule == "static":
            return float(static)
        return alpha * float(predicted)

    if granularity == "tensor":
        out[:] = max(stat(rows), eps)
    else:
        k = rows.shape[1]
        size = k if granularity == "row" else block
        for i in range(rows.shape[0]):
            for start in range(0, k, size):
                out[i, start:start + size] = max(stat(rows[i, start:start + size]), eps)
    return out.reshape(x.shape)


def ref_int8(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Symmetric int8: step c/127, np.round (half to even), levels -127..127."""
    step = c / 127.0
    return np.clip(np.round(np.clip(x, -c, c) / step), -127, 127) * step


def ref_fp8_cast(x: np.ndarray, c: np.ndarray, fmt: str) -> np.ndarray:
    """x_q = cast(clamp(x, -c, c) * fmt_max / c) * c / fmt_max with a direct torch float8 cast."""
    m = FMT_MAX[fmt]
    scaled = torch.from_numpy(np.clip(x, -c, c) * m / c).float()
    return scaled.to(FP8[fmt]).double().numpy() * c / m


def fp8_grid(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """All finite values of an FP8 format (sorted) and their 8-bit codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(FP8[fmt]).float().numpy().astype(np.float64)
    keep = np.isfinite(vals)
    order = np.argsort(vals[keep], kind="stable")
    return vals[keep][order], codes.numpy()[keep][order]


def rne_on_grid(v: np.ndarray, fmt: str) -> np.ndarray:
    """Round to the nearest grid value; exact ties go to the code with an even last bit (even mantissa)."""
    grid, codes = fp8_grid(fmt)
    out = np.empty_like(v, dtype=np.float64)
    for i, val in enumerate(v.reshape(-1)):
        d = np.abs(grid - val)
        best = np.flatnonzero(d == d.min())
        vals = np.unique(grid[best])
        if len(vals) == 1:
            out.reshape(-1)[i] = vals[0]
        else:
            even = [j for j in best if codes[j] % 2 == 0]
            out.reshape(-1)[i] = grid[even[0]]
    return out


def assert_quant_close(q: torch.Tensor, ref: np.ndarray, x: np.ndarray, c: np.ndarray, fmt: str) -> None:
    """q equals ref, allowing only rare one-level flips where the fp32 and float64 scaled values straddle
    a rounding tie (reference in float64, library in fp32)."""
    q = q.detach().double().numpy()
    tol = 1e-5 * c
    bad = np.abs(q - ref) > tol
    n_bad = int(bad.sum())
    assert n_bad <= max(1, int(1e-3 * q.size)), f"{n_bad} of {q.size} values differ from the reference"
    if n_bad:
        # every flip is one quantization level, at an (almost) exact tie of the reference rounding
        m = FMT_MAX[fmt]
        if fmt == "int8":
            level = c[bad] / 127.0
        else:
            level = np.maximum(np.abs(x[bad]) * 2.0 ** -2, c[bad] * 2.0 ** -16 / m)
        assert np.all(np.abs(q[bad] - ref[bad]) <= level * 1.01)

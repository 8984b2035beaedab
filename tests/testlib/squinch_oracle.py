"""Plain per-block Python implementation of docs/squinch-format.md (the test oracle).

Written from the spec text only (math + struct, loops over blocks); it shares no code with
megatron_cai.core.squinch. Non-finite blocks follow the package's documented convention:
q_max = 255, NaN elements q = 0, Inf elements q = 15.
"""
from __future__ import annotations

import math
import struct

import torch


def f32(v: float) -> float:
    """Round a float64 to float32 (round to nearest even; overflow -> +-inf)."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def bits32(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def from_bits32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


S = [f32(math.exp((q - 128) / 6)) for q in range(256)]
B = [None] + [f32(((k - 0.5) / 15) ** 2) for k in range(1, 16)]
L = [f32((q / 15) ** 2) for q in range(16)]


def values(x: torch.Tensor) -> list[float]:
    """Exact element values (row-major) as Python floats."""
    return x.detach().reshape(-1).to(torch.float64).tolist()


def encode_block(blk: list[float]) -> tuple[bytes, float, list[int]]:
    """Encode 8 fp32 values -> (6 bytes, M, q list), deterministic mode."""
    if all(math.isfinite(v) for v in blk):
        m = max(abs(v) for v in blk)
        q_max = 255
        for q in range(256):
            if S[q] > m:
                q_max = q
                break
    else:
        q_max = 255
    M = S[q_max]
    qs = []
    for v in blk:
        u = f32(abs(v) / M)  # float64 quotient rounded once more to float32 == IEEE fp32 division
        qs.append(sum(1 for k in range(1, 16) if u >= B[k]))
    signs = sum(1 << i for i, v in enumerate(blk) if v < 0)
    data = bytes([q_max, signs] + [qs[2 * k] | (qs[2 * k + 1] << 4) for k in range(4)])
    return data, M, qs


def blocks(vals: list[float]) -> list[list[float]]:
    out = []
    for i in range(0, len(vals), 8):
        blk = vals[i:i + 8]
        out.append(blk + [0.0] * (8 - len(blk)))
    return out


def encode(vals: list[float]) -> bytes:
    return b"".join(encode_block(b)[0] for b in blocks(vals))


def decode(payload: bytes, n: int) -> list[float]:
    out: list[float] = []
    for b in range(len(payload) // 6):
        p = payload[6 * b:6 * b + 6]
        M = S[p[0]]
        for i in range(8):
            q = (p[2 + i // 2] >> (4 * (i % 2))) & 15
            v = f32(M * L[q])
            out.append(-v if (p[1] >> i) & 1 else v)
    return out[:n]


def bf16_round(v: float) -> float:
    """fp32 -> bf16 round to nearest even (value as a float)."""
    if math.isnan(v):
        return v
    b = bits32(v)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return from_bits32(b << 16)


def encode_with_feedback(g: list[float], r: list[float] | None, bf16_residual: bool = False):
    """-> (payload, new residual list, nonfinite) following the spec's error-feedback recipe."""
    y = [f32(a + b) for a, b in zip(g, r)] if r is not None else list(g)
    payload = encode(y)
    dec = decode(payload, len(y))
    new_r = [f32(a - d) for a, d in zip(y, dec)]
    if bf16_residual:
        new_r = [bf16_round(v) for v in new_r]
    return payload, new_r, not all(math.isfinite(v) for v in y)


def decode_accumulate(payloads: list[bytes], n: int, out: list[float]) -> list[float]:
    s = decode(payloads[0], n)
    for p in payloads[1:]:
        s = [f32(a + b) for a, b in zip(s, decode(p, n))]
    return [f32(o + v) for o, v in zip(out, s)]


def as_tensor(vals: list[float]) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of fp32 tensors (-0.0 != 0.0); NaNs compare equal to NaNs."""
    a, b = a.reshape(-1).float(), b.reshape(-1).float()
    if a.shape != b.shape:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    return torch.equal(a[~na].view(torch.int32), b[~nb].view(torch.int32))


# ---- edge-case inputs (acceptance point 1) ---------------------------------------------------------
FLT_MAX = 3.4028234663852886e38


def _threshold_hits(gen: torch.Generator) -> list[float]:
    """Blocks where |x| / M lands exactly on B[k] and one fp32 ulp either side of it."""
    vals: list[float] = []
    for qm in (0, 1, 37, 128, 200, 254, 255):
        M = S[qm]
        for k in range(1, 16):
            tb = bits32(B[k])
            for target in (from_bits32(tb - 1), B[k], from_bits32(tb + 1)):
                x0 = bits32(f32(target * M))
                hits = [from_bits32(b) for b in range(x0 - 8, x0 + 9) if f32(from_bits32(b) / M) == target]
                if hits:
                    sign = -1.0 if torch.rand((), generator=gen) < 0.5 else 1.0
                    # the block max 0.9 * M keeps q_max = qm (S[qm - 1] < 0.9 * S[qm] < S[qm])
                    vals += [f32(0.9 * M), sign * hits[0], sign * hits[-1], 0.0, -f32(0.5 * M), 0.0, 0.0, 0.0]
    return vals


def _grid_hits(gen: torch.Generator) -> list[float]:
    """Blocks whose max is exactly S[q], and one ulp below/above it, for every q."""
    vals: list[float] = []
    for q in range(256):
        sb = bits32(S[q])
        for mb in (sb - 1, sb, sb + 1):
            m = from_bits32(mb)
            rest = (torch.rand(7, generator=gen, dtype=torch.float64) * 2 - 1) * m
            vals += [m if q % 2 else -m] + [f32(v) for v in rest.tolist()]
    return vals


def edge_cases(seed: int = 0) -> dict[str, torch.Tensor]:
    """Named inputs covering the acceptance list (fp32 unless the name says otherwise)."""
    g = torch.Generator().manual_seed(seed)
    c: dict[str, torch.Tensor] = {}
    scales = [10.0 ** e for e in range(-44, 38, 3)]
    f64 = torch.float64
    c["gauss_scales"] = torch.cat([torch.randn(27, generator=g, dtype=f64) * s for s in scales]).float()
    blockscale = torch.exp(torch.empty(300, dtype=torch.float64).uniform_(-60, 60, generator=g))
    c["per_block_scales"] = (torch.randn(300, 8, generator=g, dtype=f64) * blockscale[:, None]).float()
    lap_u = torch.rand(500, generator=g, dtype=torch.float64) - 0.5
    laplace = -torch.sign(lap_u) * torch.log1p(-2 * lap_u.abs())
    student = torch.randn(500, generator=g, dtype=torch.float64) / torch.sqrt(
        torch.randn(3, 500, generator=g, dtype=torch.float64).pow(2).sum(0) / 3)
    c["laplace_student"] = torch.cat([laplace, student]).float()
    z = torch.randn(45, generator=g)
    z[::3] = 0.0
    c["zeros"] = torch.cat([torch.zeros(19), z])
    sub = torch.randint(1, 0x7FFFFF, (96,), generator=g, dtype=torch.int32).view(torch.float32)
    sub = sub * torch.where(torch.rand(96, generator=g) < 0.5, -1.0, 1.0)
    tiny = torch.tensor([1e-45, -1e-45, 1.1754942e-38, 1.17549435e-38, 5.4e-10, -5.5e-10, 3e-40, 1e-30])
    c["subnormals"] = torch.cat([sub, tiny, sub[:8] + 1e-38])
    c["s_grid"] = as_tensor(_grid_hits(g))
    c["b_thresholds"] = as_tensor(_threshold_hits(g))
    # a dense sweep of u = |x| / M over [0, 0.9): 7 values per block, block max 0.9 * M (M = 1 and M = S[200])
    sweep = torch.cat([torch.linspace(0.0, 0.9, 8001)[:-1], torch.logspace(-9, -0.05, 2500)])
    sweep = sweep[torch.randperm(sweep.numel(), generator=g)][: 7 * (sweep.numel() // 7)].view(-1, 7)
    for name, M in (("dense_u_sweep", 1.0), ("dense_u_sweep_S200", S[200])):
        head = torch.full((sweep.shape[0], 1), f32(0.9 * M))
        c[name] = torch.cat([head, sweep * M * torch.where(torch.rand(sweep.shape, generator=g) < 0.5, -1.0, 1.0)],
                            dim=1).reshape(-1)
    big = [FLT_MAX, -FLT_MAX, from_bits32(0x7F7FFFFE), 1.0, -2.0, 0.0, 1e-3, 1e38]
    above = [1.6e9, -1.6e9, 1e10, 1e20, -1e30, 1.0, 1e9, 0.5, 1.5579968e9, 1.558e9, 1.0, 2.0, 3.0, 4.0, 5.0,
             6.0]
    c["largest_and_above_S255"] = as_tensor(big + above)
    ms = torch.randn(61, generator=g)
    ms[::4] = -0.0
    tail = torch.tensor([-1e-12, 1.0, -1e-9, -0.0])
    c["mixed_signs_negzero"] = torch.cat([torch.full((8,), -0.0), ms, tail])
    c["odd_len_1"] = torch.tensor([-0.75])
    c["odd_len_13"] = torch.randn(13, generator=g) * 1e-5
    c["bf16"] = torch.cat([
        torch.randn(200, generator=g) * 1e30,
        torch.randn(200, generator=g) * 1e-36,
        torch.randn(37, generator=g),
    ]).bfloat16()
    c["fp16"] = torch.cat([
        torch.randn(200, generator=g), torch.randn(100, generator=g) * 1e-6,
        torch.tensor([65504.0, -65504.0, 6e-8, -6e-8, 0.0, -0.0, 1e-7]),
    ]).half()
    c["noncontig_2d"] = (torch.randn(40, 30, generator=g) * 0.01)[:, ::3]
    c["noncontig_t"] = torch.randn(19, 23, generator=g).t()
    return c


def nonfinite_cases() -> dict[str, torch.Tensor]:
    """Inputs holding NaN/Inf (the encoder must flag them)."""
    base = torch.linspace(-1.0, 1.0, 37)
    out = {}
    for name, v in (("nan", math.nan), ("pinf", math.inf), ("ninf", -math.inf)):
        x = base.clone()
        x[10] = v
        out[name] = x
    x = base.clone()
    x[3], x[30] = math.nan, math.inf
    out["nan_and_inf"] = x
    x = torch.linspace(-3.0, 2.0, 403)  # long enough for the 16-block CPU path
    x[150], x[251], x[300] = math.nan, -math.inf, math.inf
    out["long_nan_inf"] = x
    return out


# ---- stochastic mode ----------------------------------------------------------------------------------
def monte_carlo(encode_fn, decode_fn, x: torch.Tensor, trials: int) -> dict:
    """Encode `trials` copies of x stochastically in one call and compare with the spec.

    Returns z-scores of (mean decode - x) / standard error per element with non-zero spread, the
    max abs gap where the spread is zero, and whether every draw is one of the two levels that
    bracket u = |x| / M (with q_max as in deterministic mode).
    """
    n = x.numel()
    assert n % 8 == 0
    payload = encode_fn(x.repeat(trials))
    dec = decode_fn(payload, n * trials).view(trials, n).double()
    mean, std = dec.mean(0), dec.std(0)
    xs = x.double()
    se = std / math.sqrt(trials)
    spread = std > 0
    z = (mean[spread] - xs[spread]) / se[spread]
    zero_spread_gap = (mean[~spread] - xs[~spread]).abs().max().item() if (~spread).any() else 0.0
    # bracketing: every draw's magnitude is M * L[a] or M * L[a + 1] with L[a] <= u < L[a + 1]
    vals = values(x)
    lo, hi = [], []
    for blk in blocks(vals):
        _, M, _ = encode_block(blk)
        for v in blk:
            u = f32(abs(v) / M)
            a = sum(1 for k in range(1, 16) if u >= L[k])
            lo.append(f32(M * L[a]))
            hi.append(f32(M * L[min(a + 1, 15)]))
    mag = dec.abs()
    lo_t, hi_t = torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64)
    bracketed = bool(((mag == lo_t) | (mag == hi_t)).all())
    qmax_same = bool((payload.view(trials, -1)[:, 0::6] == torch.tensor(list(encode(vals)[0::6]))).all())
    return {"z": z, "zero_spread_gap": zero_spread_gap, "bracketed": bracketed, "qmax_same": qmax_same,
            "n_spread": int(spread.sum())}


def stochastic_input(seed: int = 0) -> torch.Tensor:
    """64 values with varied in-block ratios (some exactly on levels, some tiny, some zero)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, generator=g) * torch.exp(torch.randn(64, generator=g) * 2)
    x[5], x[9], x[17], x[40] = 0.0, -x[8] * 0.5, 1e-6 * x[16], -0.0
    return x

"""Vectorized torch reference of the Squinch v1 codec (the ground truth for the fast kernels).

Readable first: every step maps to a line of docs/squinch-format.md. Works on any device.

Conventions shared by all backends (documented in the package docstring):
- A block holding NaN or +-Inf gets q_max = 255 (NaN counts as larger than every S); its NaN
  elements get q = 0 and its Inf elements q = 15. The payload is therefore defined byte for byte
  even then, but it is meaningless: callers must act on the `nonfinite` flag.
- Decode of a set sign bit negates the magnitude, so q = 0 with the sign set decodes to -0.0.
- decode_accumulate computes s = ((d_0 + d_1) + d_2) + ... + d_{W-1} in fp32, then out = out + s.
"""
from __future__ import annotations

import torch

from .format import BLOCK, BLOCK_BYTES, n_blocks, tables

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def check_float_input(x: torch.Tensor, name: str = "x") -> None:
    """Raise a clear error unless `x` is an fp32/bf16/fp16 tensor."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_INPUTS:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"squinch: {name} must be a float32/bfloat16/float16 tensor, got {got}")


def check_payload(payload: torch.Tensor, numel: int) -> None:
    """Raise a clear error unless `payload` is a uint8 tensor of 6 * ceil(numel / 8) bytes."""
    if payload.dtype != torch.uint8:
        raise TypeError(f"squinch: payload must be uint8, got {payload.dtype}")
    want = BLOCK_BYTES * n_blocks(numel)
    if payload.numel() != want:
        raise ValueError(f"squinch: payload has {payload.numel()} bytes, expected {want} for numel={numel}")


def to_blocks(x: torch.Tensor) -> torch.Tensor:
    """Flatten, convert exactly to fp32 and zero-pad to [n_blocks, 8]."""
    flat = x.reshape(-1).to(torch.float32)
    pad = n_blocks(flat.numel()) * BLOCK - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def _encode_blocks(y: torch.Tensor, stochastic: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Encode [nb, 8] fp32 blocks into a [nb, 6] uint8 payload, following the spec's steps."""
    S, B, L = tables(y.device)
    a = y.abs()
    finite = torch.isfinite(y).all(dim=1)
    # 1. m = max |x_i|;  2. q_max = smallest q with S[q] > m (= number of S[q] <= m), 255 if none.
    m = torch.where(finite, a.amax(dim=1), torch.zeros((), device=y.device))
    q_max = torch.searchsorted(S, m, right=True).clamp_(max=255)
    q_max = torch.where(finite, q_max, torch.full_like(q_max, 255))  # non-finite block: 255
    # 3. u_i = fp32(|x_i| / M) with IEEE division.
    M = S[q_max]
    u = a / M[:, None]
    nan = torch.isnan(u)
    u0 = torch.where(nan, torch.zeros((), device=y.device), u)
    if not stochastic:
        # 4. q_i = number of k in 1..15 with u_i >= B[k]  (searchsorted right = count of B[k] <= u).
        q = torch.searchsorted(B[1:].contiguous(), u0, right=True)
    else:
        # Stochastic: L[a] <= u < L[a+1]; pick a+1 with probability (u - L[a]) / (L[a+1] - L[a]).
        lo_idx = torch.searchsorted(L[1:].contiguous(), u0, right=True)
        hi_idx = (lo_idx + 1).clamp_(max=15)
        lo, hi = L[lo_idx], L[hi_idx]
        p = (u0 - lo) / (hi - lo)
        r = torch.rand(u0.shape, generator=generator, device=y.device, dtype=torch.float32)
        q = lo_idx + ((lo_idx < 15) & (r < p)).long()
    q = torch.where(nan, torch.zeros_like(q), q)  # NaN elements: q = 0
    signs = ((y < 0).to(torch.int64) << torch.arange(BLOCK, device=y.device)).sum(dim=1)
    nibbles = q[:, 0::2] | (q[:, 1::2] << 4)
    return torch.cat([q_max[:, None], signs[:, None], nibbles], dim=1).to(torch.uint8)


def _decode_blocks(payload: torch.Tensor) -> torch.Tensor:
    """Decode [nb, 6] uint8 blocks to [nb, 8] fp32: |x_i| = fp32(M * L[q_i]), negated where signed."""
    S, _, L = tables(payload.device)
    p = payload.view(-1, BLOCK_BYTES).to(torch.int64)
    M = S[p[:, 0]]
    sign = ((p[:, 1:2] >> torch.arange(BLOCK, device=p.device)) & 1).bool()
    nib = p[:, 2:]
    q = torch.stack([nib & 15, nib >> 4], dim=2).reshape(-1, BLOCK)
    v = M[:, None] * L[q]
    return torch.where(sign, -v, v)


def encode(
    x: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Reference encode: uint8 payload of 6 * ceil(numel / 8) bytes."""
    check_float_input(x)
    return _encode_blocks(to_blocks(x), stochastic, generator).reshape(-1)


def decode(
    payload: torch.Tensor, numel: int, *, out: torch.Tensor | None = None, accumulate: bool = False
) -> torch.Tensor:
    """Reference decode to a flat fp32 tensor of `numel` elements (or into / onto `out`)."""
    check_payload(payload, numel)
    vals = _decode_blocks(payload).reshape(-1)[:numel]
    if out is None:
        if accumulate:
            raise ValueError("squinch: decode(accumulate=True) needs out=")
        return vals
    flat = out.view(-1)
    if accumulate:
        flat.add_(vals)
    else:
        flat.copy_(vals)
    return out


def encode_with_feedback(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference fused encode: y = grad + residual; payload = encode(y); residual <- y - decode(payload).

    Returns (payload, nonfinite) with nonfinite a 0-dim bool tensor: whether y held NaN/Inf.
    With residual=None this is a plain encode that also reports non-finite input.
    """
    check_float_input(grad, "grad")
    y = to_blocks(grad)
    n = grad.numel()
    if residual is not None:
        y = y + to_blocks(residual)
    payload = _encode_blocks(y, stochastic, generator)
    nonfinite = ~torch.isfinite(y).all()
    if residual is not None:
        err = (y - _decode_blocks(payload)).reshape(-1)[:n]
        residual.view(-1).copy_(err)  # fp32 copy, or round-to-nearest-even into bf16
    return payload.reshape(-1), nonfinite


def decode_sum(payloads: torch.Tensor, out: torch.Tensor, *, accumulate: bool) -> torch.Tensor:
    """Reference decode-sum: s = ((d_0 + d_1) + ...) + d_{W-1} in fp32; out = s, or out += s."""
    numel = out.numel()
    if payloads.dim() != 2:
        raise ValueError(f"squinch: payloads must be [W, nbytes], got shape {tuple(payloads.shape)}")
    if payloads.shape[0] == 0:
        return out
    check_payload(payloads[0], numel)
    s = _decode_blocks(payloads[0])
    for w in range(1, payloads.shape[0]):
        s = s + _decode_blocks(payloads[w])
    s = s.reshape(-1)[:numel]
    if accumulate:
        out.view(-1).add_(s)
    else:
        out.view(-1).copy_(s)
    return out


def decode_accumulate(payloads: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Reference decode-accumulate: out += ((d_0 + d_1) + ...) + d_{W-1}, all in fp32."""
    return decode_sum(payloads, out, accumulate=True)

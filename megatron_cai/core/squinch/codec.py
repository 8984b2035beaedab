"""Public Squinch v1 codec API: argument checks and backend dispatch (torch / cpu / triton; the single-
payload cpu and triton kernels run as the custom ops of :mod:`.ops`, so compiled code traces through)."""
from __future__ import annotations

import functools
import logging
import os

import torch

from . import cpu_kernels, ops
from . import format as fmt
from . import reference as ref

BACKENDS = ("torch", "cpu", "triton")
log = logging.getLogger(__name__)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("squinch: triton is not installed; CUDA tensors use the (slower) torch reference codec")
        return False
    return True


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend that will run: None -> "triton" on CUDA, "cpu" (C kernel) or "torch" on CPU."""
    if backend is None:
        if device.type == "cuda":
            return "triton" if _triton_available() else "torch"
        if device.type == "cpu" and cpu_kernels.available():
            return "cpu"
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"squinch: backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"squinch: backend='cpu' needs CPU tensors, got device {device}")
        return "cpu" if cpu_kernels.available() else "torch"  # load() logged the one warning
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("squinch: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tests)")
    return backend


def _payload_out(out: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
    nbytes = fmt.payload_nbytes(numel)
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous() or out.device != device:
        raise ValueError(
            f"squinch: payload out= must be a contiguous uint8 tensor of {nbytes} bytes on {device}, "
            f"got {out.dtype} numel={out.numel()} contiguous={out.is_contiguous()} on {out.device}"
        )
    return out


def _seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    gen_dev = generator.device if generator is not None else torch.device("cpu")
    s = torch.randint(0, 2**62, (1,), generator=generator, device=gen_dev, dtype=torch.int64)
    return s.to(device)


def _check_residual(grad: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"squinch: residual must be float32 or bfloat16, got {residual.dtype}")
    if residual.numel() != grad.numel() or residual.device != grad.device:
        raise ValueError(
            f"squinch: residual must match grad (numel {grad.numel()} on {grad.device}), "
            f"got numel {residual.numel()} on {residual.device}"
        )
    if not residual.is_contiguous():
        raise ValueError("squinch: residual must be contiguous (it is updated in place)")


def encode_with_feedback(
    grad: torch.Tensor,
    residual: torch.Tensor | None,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused error-feedback encode, one pass over memory: y = grad + residual (fp32),
    payload = encode(y), residual <- y - decode(payload) (in place; bf16 residuals round to nearest even).

    Returns (payload, nonfinite): the uint8 payload (written into `out` if given) and a 0-dim bool
    tensor on grad's device, True iff y held NaN/Inf (not synchronised on CUDA). residual=None gives a
    plain encode that still reports non-finite input.

    When nonfinite is True the payload is still defined byte for byte (blocks holding NaN/Inf get
    q_max = 255, NaN elements q = 0, Inf elements q = 15) but meaningless, and the residual holds
    y - decode(payload), i.e. NaN/Inf exactly where y was non-finite (and y itself for the other
    elements of those blocks). Nothing becomes finite silently: the caller must skip the step on every
    rank and reset the residual (``residual.zero_()``), dropping that step's error feedback; a
    residual left non-finite keeps flagging every later step.
    """
    ref.check_float_input(grad, "grad")
    if residual is not None:
        _check_residual(grad, residual)
    bk = resolve_backend(backend, grad.device)
    payload = _payload_out(out, grad.numel(), grad.device)
    if bk == "torch":
        p, nonfinite = ref.encode_with_feedback(grad, residual, stochastic=stochastic, generator=generator)
        payload.copy_(p)
        return payload, nonfinite
    g = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
    seed = _seed(generator, grad.device) if stochastic else None
    return payload, ops.encode(g, residual, payload, stochastic, seed, bk)


def encode(
    x: torch.Tensor,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Encode x (fp32/bf16/fp16, any shape, contiguous or not) into a uint8 payload of
    6 * ceil(numel / 8) bytes (written into `out` if given). Deterministic mode is byte-exact per
    docs/squinch-format.md on every backend; stochastic payloads are reproducible with `generator`
    but not byte-specified across backends."""
    payload, _ = encode_with_feedback(x, None, stochastic=stochastic, generator=generator, backend=backend,
                                      out=out)
    return payload


def _check_out(out: torch.Tensor, numel: int, device: torch.device) -> None:
    if out.dtype != torch.float32 or out.numel() != numel or not out.is_contiguous() or out.device != device:
        raise ValueError(
            f"squinch: out must be a contiguous float32 tensor of {numel} elements on {device}, "
            f"got {out.dtype} numel={out.numel()} contiguous={out.is_contiguous()} on {out.device}"
        )


def decode(
    payload: torch.Tensor,
    numel: int,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode a payload to `numel` fp32 values: a new flat tensor, or written into `out`
    (out += decoded with accumulate=True), which is returned."""
    payload = payload.reshape(-1)
    ref.check_payload(payload, numel)
    if out is None:
        if accumulate:
            raise ValueError("squinch: decode(accumulate=True) needs out=")
        out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    _check_out(out, numel, payload.device)
    bk = resolve_backend(backend, payload.device)
    if bk == "torch":
        return ref.decode(payload, numel, out=out, accumulate=accumulate)
    ops.decode(payload.contiguous(), numel, out, accumulate, bk)
    return out


def decode_accumulate(
    payloads: torch.Tensor, out: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """out += s with s = ((d_0 + d_1) + d_2) + ... + d_{W-1}, d_w = decode(payloads[w]), all in fp32,
    in one pass (payloads: [W, nbytes] uint8, one row per sending rank). Returns out.

    The order is part of the contract: the reference reproduces it bit for bit with
    ``s = decode(p[0]); s = s + decode(p[1]); ...; out += s``.
    """
    return decode_sum(payloads, out, accumulate=True, backend=backend)


def _check_rows(payloads: torch.Tensor, numel: int, device: torch.device) -> None:
    if payloads.dim() != 2:
        raise ValueError(f"squinch: payloads must be [W, nbytes] uint8, got shape {tuple(payloads.shape)}")
    if payloads.dtype != torch.uint8 or payloads.shape[1] != fmt.payload_nbytes(numel):
        raise ValueError(
            f"squinch: payloads must be uint8 [W, {fmt.payload_nbytes(numel)}] for numel={numel}, "
            f"got {payloads.dtype} {tuple(payloads.shape)}"
        )
    if payloads.device != device:
        raise ValueError(f"squinch: payloads on {payloads.device}, out on {device}")


def _check_flags(flags: torch.Tensor | None, device: torch.device) -> None:
    if flags is not None and (flags.dtype != torch.uint8 or flags.dim() != 1 or flags.device != device):
        raise ValueError(f"squinch: flags must be a 1-D uint8 tensor on {device}, got {flags.dtype} "
                         f"{tuple(flags.shape)} on {flags.device}")


def decode_sum(
    payloads: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False, flags: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """out = s (or out += s) with s = ((d_0 + d_1) + ...) + d_{W-1} in fp32, d_w = decode(payloads[w]);
    payloads: uint8 [W, nbytes], any row stride. ``flags``: None or a 1-D uint8 tensor; when any entry is
    non-zero, every element of out becomes NaN (a sender reported non-finite gradients). One launch on
    the Triton backend. Returns out."""
    numel = out.numel()
    _check_out(out, numel, payloads.device)
    _check_rows(payloads, numel, out.device)
    _check_flags(flags, out.device)
    if payloads.shape[0] == 0:
        return out
    if payloads.stride(1) != 1:
        payloads = payloads.contiguous()
    bk = resolve_backend(backend, out.device)
    if bk == "triton":
        ops.triton_kernels().decode_into(payloads, numel, out, accumulate, flags)
        return out
    if bk == "torch":
        ref.decode_sum(payloads, out, accumulate=accumulate)
    else:
        ops.decode(payloads, numel, out, accumulate, bk)
    if flags is not None:
        out.masked_fill_(flags.ne(0).any(), float("nan"))
    return out


def decode_rows(
    payloads: torch.Tensor, out: torch.Tensor, *, flags: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor:
    """Row g of payloads (uint8 [G, nbytes], any row stride) decodes into chunk g of the flat fp32
    ``out`` (G equal chunks); ``flags`` as in :func:`decode_sum`. One launch on the Triton backend."""
    rows = payloads.shape[0]
    if out.numel() % max(rows, 1):
        raise ValueError(f"squinch: {out.numel()} elements do not split into {rows} equal chunks")
    chunk = out.numel() // max(rows, 1)
    _check_out(out, out.numel(), payloads.device)
    _check_rows(payloads, chunk, out.device)
    _check_flags(flags, out.device)
    if payloads.stride(1) != 1:
        payloads = payloads.contiguous()
    bk = resolve_backend(backend, out.device)
    if bk == "triton":
        ops.triton_kernels().decode_into(payloads.unsqueeze(1), chunk, out, False, flags)
        return out
    flat = out.view(-1)
    for g in range(rows):
        decode(payloads[g], chunk, out=flat[g * chunk:(g + 1) * chunk], backend=bk)
    if flags is not None:
        out.masked_fill_(flags.ne(0).any(), float("nan"))
    return out


def encode_rows(
    x: torch.Tensor,
    rows: int,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    *,
    flags: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Encode flat x as ``rows`` equal chunks, each on its own with error feedback from its chunk of
    ``residual`` (x's layout, updated in place, or None), into ``out`` (uint8 [rows, payload_nbytes(chunk)],
    unit byte stride, any row stride). ``flags``: None, or uint8 [rows, tail <= 16] (unit byte stride):
    its column 0 receives the non-finite flag (OR over every row), the other columns zeros.

    Returns the 0-dim bool non-finite flag (no host sync on CUDA). One launch on the Triton backend,
    whatever ``rows``; the other backends encode row by row (stochastic mode draws one seed per row there,
    one per call on Triton)."""
    ref.check_float_input(x, "x")
    if rows < 1 or x.numel() % rows:
        raise ValueError(f"squinch: {x.numel()} elements do not split into {rows} equal rows")
    c = x.numel() // rows
    if out.dim() != 2 or out.shape[0] != rows or out.device != x.device:
        raise ValueError(f"squinch: out must be [{rows}, {fmt.payload_nbytes(c)}] on {x.device}, got "
                         f"{tuple(out.shape)} on {out.device}")
    _check_rows(out, c, x.device)
    if out.stride(1) != 1:
        raise ValueError("squinch: out must have unit byte stride (rows are written in place)")
    if flags is not None and (flags.dtype != torch.uint8 or flags.dim() != 2 or flags.shape[0] != rows
                              or flags.stride(1) != 1 or flags.device != x.device):
        raise ValueError(f"squinch: flags must be uint8 [{rows}, tail] with unit byte stride on {x.device}")
    if residual is not None:
        _check_residual(x, residual)
    flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().view(-1)
    bk = resolve_backend(backend, x.device)
    if bk == "triton":
        seed_t = _seed(generator, x.device) if stochastic else None
        return ops.triton_kernels().encode_rows_into(flat, residual, out, stochastic, seed_t, flags)
    res_flat = residual.view(-1) if residual is not None else None
    nonfinite = []
    for r in range(rows):
        res = res_flat[r * c:(r + 1) * c] if res_flat is not None else None
        _, nf = encode_with_feedback(flat[r * c:(r + 1) * c], res, stochastic=stochastic, generator=generator,
                                     backend=bk, out=out[r])
        nonfinite.append(nf.to(x.device))
    flag = nonfinite[0] if rows == 1 else torch.stack(nonfinite).any()
    if flags is not None:
        flags.zero_()
        flags[:, 0] = flag.to(torch.uint8)
    return flag

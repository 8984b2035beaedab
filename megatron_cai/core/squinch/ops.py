"""The Squinch kernels (C on CPU, Triton on CUDA) as ``torch.library`` custom ops.

``megatron_cai::squinch_encode`` (fused error-feedback encode: writes the payload, updates the residual
in place, returns the 0-dim non-finite flag) and ``megatron_cai::squinch_decode`` (decode, or
decode-accumulate, into an fp32 tensor) carry fake implementations, so code that calls the codec can be
traced by ``torch.compile`` without a graph break around the kernels. :mod:`.codec` checks arguments and
dispatches; the "torch" reference backend is plain torch and needs no op.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_kernels


def triton_kernels():
    """The Triton kernels module (an error naming the missing package without triton)."""
    try:
        from . import triton_kernels as module
    except ImportError as e:  # pragma: no cover - triton is a test/gpu extra
        raise RuntimeError(f"squinch: backend='triton' needs the triton package ({e})") from e
    return module


@torch.library.custom_op("megatron_cai::squinch_encode", mutates_args=("residual", "payload"))
def encode(grad: Tensor, residual: Tensor | None, payload: Tensor, stochastic: bool, seed: Tensor | None,
           backend: str) -> Tensor:
    """Encode flat ``grad`` (+ ``residual``) into ``payload`` with the "cpu" or "triton" kernel; returns
    the 0-dim bool non-finite flag. ``seed``: a one-element int64 tensor (stochastic rounding only)."""
    if backend == "cpu":
        seed_int = int(seed.item()) if seed is not None else 0  # inside the op: the C kernel takes a number
        return torch.tensor(cpu_kernels.encode_into(grad, residual, payload, stochastic, seed_int))
    return triton_kernels().encode_into(grad, residual, payload, stochastic, seed)


@encode.register_fake
def _(grad, residual, payload, stochastic, seed, backend):
    return grad.new_empty((), dtype=torch.bool)


@torch.library.custom_op("megatron_cai::squinch_decode", mutates_args=("out",))
def decode(payloads: Tensor, numel: int, out: Tensor, accumulate: bool, backend: str) -> None:
    """``out = (out +) ((d_0 + d_1) + ... + d_{W-1})`` for [W, nbytes] (or [nbytes]) contiguous payloads."""
    if backend == "cpu":
        cpu_kernels.decode_into(payloads, numel, out, accumulate)
    else:
        triton_kernels().decode_into(payloads, numel, out, accumulate)


@decode.register_fake
def _(payloads, numel, out, accumulate, backend):
    return None

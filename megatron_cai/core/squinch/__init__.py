"""Squinch v1: 6-bit block compression for data-parallel gradients (shared/squinch-format.md).

API::

    payload = encode(x, stochastic=False, generator=None, backend=None, out=None)   # uint8[6*ceil(n/8)]
    y = decode(payload, numel, out=None, accumulate=False, backend=None)             # fp32, flat
    payload, nonfinite = encode_with_feedback(grad, residual, ...)   # residual <- y - decode(payload)
    decode_accumulate(payloads, out)   # payloads [W, nbytes]; out += ((d_0 + d_1) + ...) + d_{W-1}

Backends: "torch" (vectorized reference, any device), "cpu" (C kernel built with the system compiler
on first use; falls back to "torch" with one warning), "triton" (CUDA, or CPU under
TRITON_INTERPRET=1). None picks triton on CUDA tensors and cpu on CPU tensors. Deterministic
payloads and all decoded values are bit-identical across backends; stochastic payloads are
reproducible for a given generator per backend, not across backends.
"""
from .codec import BACKENDS, decode, decode_accumulate, encode, encode_with_feedback, resolve_backend
from .format import BLOCK, BLOCK_BYTES, VERSION, n_blocks, payload_nbytes

__all__ = [
    "BACKENDS",
    "BLOCK",
    "BLOCK_BYTES",
    "VERSION",
    "decode",
    "decode_accumulate",
    "encode",
    "encode_with_feedback",
    "n_blocks",
    "payload_nbytes",
    "resolve_backend",
]

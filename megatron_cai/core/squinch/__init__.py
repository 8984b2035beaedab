"""Squinch v1: 6-bit block compression for data-parallel gradients (docs/squinch-format.md).

API::

    payload = encode(x, stochastic=False, generator=None, backend=None, out=None)   # uint8[6*ceil(n/8)]
    y = decode(payload, numel, out=None, accumulate=False, backend=None)             # fp32, flat
    payload, nonfinite = encode_with_feedback(grad, residual, ...)   # residual <- y - decode(payload)
    decode_accumulate(payloads, out)   # payloads [W, nbytes]; out += ((d_0 + d_1) + ...) + d_{W-1}
    nonfinite = encode_rows(x, rows, residual, out, flags=None)   # rows equal chunks -> out [rows, nbytes]
    decode_sum(payloads, out, flags=None)   # out = ((d_0 + d_1) + ...); NaN if a flag is set
    decode_rows(payloads, out)              # row g -> chunk g of out

Backends: "torch" (vectorized reference, any device), "cpu" (C kernel built with the system compiler
on first use; falls back to "torch" with one warning), "triton" (CUDA, or CPU under
TRITON_INTERPRET=1). None picks triton on CUDA tensors and cpu on CPU tensors
(MEGATRON_CAI_SQUINCH_CPU=0 disables the C kernel). Deterministic payloads, residuals and all decoded
values are bit-identical across backends; stochastic payloads are reproducible for a given generator
per backend, not across backends.

Non-finite input: `nonfinite` is a 0-dim bool tensor (no host sync on CUDA). The payload stays defined
(blocks holding NaN/Inf get q_max = 255, NaN -> q 0, Inf -> q 15) but meaningless; the residual keeps
NaN/Inf where y had them. The caller skips the step on every rank and zeroes the residual.

The row functions take row-strided views and make ONE Triton launch whatever the row count (the data-
parallel size): the collectives' wire rows (core/distributed/squinch_collectives.py) use them.

Summation order of decode_accumulate: s = ((d_0 + d_1) + d_2) + ... + d_{W-1} in fp32, then
out = out + s; the torch reference reproduces it bit for bit.
"""
from .codec import (
    BACKENDS,
    decode,
    decode_accumulate,
    decode_rows,
    decode_sum,
    encode,
    encode_rows,
    encode_with_feedback,
    resolve_backend,
)
from .format import BLOCK, BLOCK_BYTES, VERSION, n_blocks, payload_nbytes

__all__ = [
    "BACKENDS",
    "BLOCK",
    "BLOCK_BYTES",
    "VERSION",
    "decode",
    "decode_accumulate",
    "decode_rows",
    "decode_sum",
    "encode",
    "encode_rows",
    "encode_with_feedback",
    "n_blocks",
    "payload_nbytes",
    "resolve_backend",
]

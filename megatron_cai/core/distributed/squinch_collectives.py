"""The Squinch compressed reduce-scatter, as functions over flat tensors (no buckets, no wrappers).

::

    send = encode_rows(x, rows, residual)            # [rows, 1 + nbytes]: nonfinite flag | 6-bit payload
    all_to_all_single(recv, send)                    # row r goes to rank r
    decode_sum_into(recv, shard)                     # shard = sum_w decode(row from w), rank order, fp32

``compressed_reduce_scatter`` strings the three together for a flat input of ``world * chunk``
elements. Chunks that are not a multiple of the Squinch block (8) are zero-padded per row, so every
row starts on a block boundary; the padding is sent and discarded. These are the same steps
``SquinchReducer`` (DDP buckets) runs in its ``_encode_rows`` / ``_decode_sum_into``; FSDP2's custom
reduce-scatter (``squinch_fsdp``) calls them here.
"""
from __future__ import annotations

import torch

from .. import device as device_mod
from ..squinch import BLOCK, decode_accumulate, encode_with_feedback


def encode_rows(x: torch.Tensor, rows: int, residual: torch.Tensor | None, *, stochastic: bool = False,
                generator: torch.Generator | None = None, backend: str | None = None) -> torch.Tensor:
    """Encode flat x (``rows`` equal, block-aligned chunks) with error feedback into a uint8
    ``[rows, 1 + nbytes]`` send buffer whose first column is the non-finite flag. A non-finite input
    zeroes the residual (the step is skipped everywhere, so its feedback is dropped)."""
    if x.numel() % rows or (x.numel() // rows) % BLOCK:
        raise ValueError(f"squinch: {x.numel()} elements do not split into {rows} rows of whole "
                         f"{BLOCK}-element blocks")
    payload, nonfinite = encode_with_feedback(x, residual, stochastic=stochastic, generator=generator,
                                              backend=backend)
    nb = payload.numel() // rows
    send = torch.empty(rows, 1 + nb, dtype=torch.uint8, device=x.device)
    send[:, 1:] = payload.view(rows, nb)
    send[:, 0] = nonfinite.to(torch.uint8)
    if residual is not None and bool(nonfinite):
        residual.zero_()
    return send


def decode_sum_into(recv: torch.Tensor, out: torch.Tensor, backend: str | None = None) -> None:
    """out = sum over rows of decode(row) (rank order, fp32), or NaN everywhere if any row is flagged."""
    target = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty(
        out.numel(), dtype=torch.float32, device=out.device)
    target.zero_()
    decode_accumulate(recv[:, 1:], target.view(-1), backend=backend)
    if bool(recv[:, 0].any()):
        target.fill_(float("nan"))
    if target is not out:
        out.copy_(target.view_as(out))


def padded_chunk(chunk: int) -> int:
    """Elements per row on the wire: the chunk rounded up to whole Squinch blocks."""
    return -(-chunk // BLOCK) * BLOCK


def compressed_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, world: int,
                              residual: torch.Tensor | None, *, stochastic: bool = False,
                              generator: torch.Generator | None = None,
                              backend: str | None = None) -> int:
    """Sum-reduce flat ``input`` (world * len(output)) over ``group`` through Squinch; this rank's chunk
    lands in ``output`` (fp32 sum of the decoded contributions). ``residual`` (world * padded_chunk
    elements, or None) carries error feedback between calls. Returns the bytes this rank sent."""
    chunk = output.numel()
    if input.numel() != world * chunk:
        raise ValueError(f"squinch reduce-scatter: input has {input.numel()} elements, expected "
                         f"{world} x {chunk}")
    row = padded_chunk(chunk)
    x = input.reshape(-1)
    if row != chunk:
        x = torch.nn.functional.pad(x.view(world, chunk), (0, row - chunk)).view(-1)
    send = encode_rows(x, world, residual, stochastic=stochastic, generator=generator, backend=backend)
    recv = torch.empty_like(send)
    device_mod.all_to_all_single(recv, send, group=group)
    if row == chunk:
        decode_sum_into(recv, output, backend)
    else:
        full = torch.empty(row, dtype=torch.float32, device=output.device)
        decode_sum_into(recv, full, backend)
        output.copy_(full[:chunk].view_as(output))
    return send.numel() * (world - 1) // world

"""The Squinch compressed collectives, as functions over flat tensors: one codec path for both callers.

::

    send = encode_rows(x, rows, residual)            # [rows, row_nbytes(chunk)]: payload | flag | padding
    all_to_all_single(recv, send)                    # row r goes to rank r
    decode_sum_into(recv, shard)                     # shard = sum_w decode(row from w), rank order, fp32

That is the compressed reduce-scatter. The all-reduce continues with an owner-side re-encode of the
reduced shard (``encode_rows(shard, 1, owner_residual)``, its own error feedback), an all-gather of the
payloads and ``decode_rows_into`` (every owner's row decoded into its chunk of the full tensor).

Wire rows (docs/squinch-format.md, "The collective"): the 6-bit payload of the row's chunk first, so it
starts 16-byte aligned, then one non-finite flag byte, then zero padding up to a multiple of 16 bytes
(``row_nbytes``). On the Triton backend each step is ONE kernel launch whatever the number of rows: the
encoder writes every row (payload, flag, padding) and the decoders read every row and flag.

Callers: ``SquinchReducer`` (DDP buckets; it stages these steps asynchronously, with phase timers and
persistent buffers passed as ``out=`` / ``scratch=``), and FSDP2's reduce-scatter hooks
(``squinch_fsdp``) through ``compressed_reduce_scatter`` / ``compressed_all_reduce``, which string the
steps together synchronously. FSDP2's chunks need not be a multiple of the Squinch block (8): they are
zero-padded per row (``padded_chunk``), so every row starts on a block boundary; the padding is sent and
discarded.

Non-finite values never make the host wait here: every row carries the device-side OR of the sender's
non-finite flags, and a receiver fills its result with NaN when any sender flagged (inside the decode
kernel on Triton). The caller skips the step on every rank (the global grad-norm check) and then zeroes
the residuals (``step_skipped``), which hold NaN/Inf after a flagged encode.
"""
from __future__ import annotations

import torch

from .. import device as device_mod
from ..squinch import BLOCK, decode_rows, decode_sum, payload_nbytes
from ..squinch import encode_rows as encode_payload_rows

ROW_ALIGN = 16  # bytes: every wire row (and so every payload) starts at a multiple of this


def padded_chunk(chunk: int) -> int:
    """Elements per row on the wire: the chunk rounded up to whole Squinch blocks."""
    return -(-chunk // BLOCK) * BLOCK


def row_nbytes(chunk: int) -> int:
    """Bytes of one wire row for ``chunk`` elements: payload, flag byte, zero padding to ROW_ALIGN."""
    return -(-(payload_nbytes(chunk) + 1) // ROW_ALIGN) * ROW_ALIGN


def encode_rows(x: torch.Tensor, rows: int, residual: torch.Tensor | None, *, out: torch.Tensor | None = None,
                stochastic: bool = False, generator: torch.Generator | None = None,
                backend: str | None = None) -> torch.Tensor:
    """Encode flat x (``rows`` equal chunks), each row on its own and with error feedback (``residual``:
    x's layout, updated in place, or None), into the uint8 ``[rows, row_nbytes(chunk)]`` send buffer
    (``out``, or a new one). Every row ends with the OR of all rows' non-finite flags."""
    if x.numel() % rows:
        raise ValueError(f"squinch: {x.numel()} elements do not split into {rows} equal rows")
    c = x.numel() // rows
    shape = (rows, row_nbytes(c))
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != torch.uint8:
        raise ValueError(f"squinch: send buffer must be uint8 {shape}, got {out.dtype} {tuple(out.shape)}")
    p = payload_nbytes(c)
    encode_payload_rows(x.reshape(-1), rows, residual, out[:, :p], flags=out[:, p:], stochastic=stochastic,
                        generator=generator, backend=backend)
    return out


def decode_sum_into(recv: torch.Tensor, out: torch.Tensor, *, scratch: torch.Tensor | None = None,
                    backend: str | None = None) -> None:
    """out = sum over rows of decode(row) (rank order, fp32), cut to out's length (rows may carry block
    padding); NaN everywhere if any row is flagged. ``scratch`` (fp32, out.numel()) is used when out is
    not a contiguous fp32 tensor."""
    direct = out.dtype == torch.float32 and out.is_contiguous()
    if direct:
        target = out.view(-1)
    else:
        target = scratch if scratch is not None else torch.empty(out.numel(), dtype=torch.float32,
                                                                   device=out.device)
    p = payload_nbytes(out.numel())
    decode_sum(recv[:, :p], target, flags=recv[:, p], backend=backend)
    if not direct:
        out.copy_(target.view_as(out))


def decode_rows_into(recv: torch.Tensor, full: torch.Tensor, *, backend: str | None = None) -> None:
    """The all-gather side: row r of ``recv`` (owner r's payload) decodes into chunk r of flat ``full``;
    NaN everywhere if any owner flagged."""
    chunk = full.numel() // recv.shape[0]
    p = payload_nbytes(chunk)
    fp32 = full.dtype == torch.float32 and full.is_contiguous()
    target = full.view(-1) if fp32 else torch.empty(full.numel(), dtype=torch.float32, device=full.device)
    decode_rows(recv[:, :p], target, flags=recv[:, p], backend=backend)
    if not fp32:
        full.copy_(target.view_as(full))


def _pad_rows(x: torch.Tensor, world: int, chunk: int) -> torch.Tensor:
    row = padded_chunk(chunk)
    x = x.reshape(-1)
    return x if row == chunk else torch.nn.functional.pad(x.view(world, chunk), (0, row - chunk)).view(-1)


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
    send = encode_rows(_pad_rows(input, world, chunk), world, residual, stochastic=stochastic,
                       generator=generator, backend=backend)
    recv = torch.empty_like(send)
    device_mod.all_to_all_single(recv, send, group=group)
    decode_sum_into(recv, output, backend=backend)
    return send.numel() * (world - 1) // world


def compressed_all_reduce(x: torch.Tensor, group, world: int, residual: torch.Tensor | None,
                          owner_residual: torch.Tensor | None, *, stochastic: bool = False,
                          generator: torch.Generator | None = None, backend: str | None = None) -> int:
    """Sum-all-reduce flat ``x`` in place over ``group`` through Squinch, as ``SquinchReducer`` does for
    a DDP bucket: the compressed reduce-scatter into this rank's chunk, the owner's re-encode of its
    chunk (``owner_residual``: padded_chunk elements), an all-gather of the payloads and the decode of
    every owner's chunk. Every rank ends with identical values. ``residual``: world * padded_chunk
    elements. Returns the bytes this rank sent."""
    n = x.numel()
    chunk = -(-n // world)
    flat = x.reshape(-1)
    padded = flat if chunk * world == n else torch.nn.functional.pad(flat, (0, chunk * world - n))
    shard = torch.empty(padded_chunk(chunk), dtype=torch.float32, device=x.device)
    sent = compressed_reduce_scatter(shard[:chunk], padded, group, world, residual, stochastic=stochastic,
                                     generator=generator, backend=backend)
    shard[chunk:] = 0
    send = encode_rows(shard, 1, owner_residual, stochastic=stochastic, generator=generator, backend=backend)
    recv = torch.empty(world, send.numel(), dtype=torch.uint8, device=x.device)
    device_mod.all_gather_into_tensor(recv.view(-1), send.view(-1), group=group)
    full = torch.empty(world * shard.numel(), dtype=torch.float32, device=x.device)
    decode_rows_into(recv, full, backend=backend)
    flat.copy_(full.view(world, -1)[:, :chunk].reshape(-1)[:n].to(flat.dtype))
    return sent + send.numel() * (world - 1)

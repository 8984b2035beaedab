"""The outer all-reduce: the islands' pseudo-gradients averaged over the ``outer`` group, in 32, 16 or 6 bits.

- 32 bits: an fp32 all-reduce (sum), divided by the number of islands.
- 16 bits: bf16 on the wire with error feedback. A reduce-scatter as an all-to-all of bf16 rows, the fp32 sum
  of the rows at their owner (in island order), the owner's bf16 re-encode (its own residual) and an
  all-gather: ``2 (N - 1) / N`` x 2 bytes per element sent by each rank, as a ring all-reduce.
- 6 bits: Squinch v1 (docs/squinch-format.md) through the same steps: the project's compressed all-reduce
  (``core/distributed/squinch_collectives.compressed_all_reduce``) with its error feedback; with one island
  the pseudo-gradient is encoded and decoded once (``encode_with_feedback``), so the outer step sees what
  the wire would carry.

Error feedback lives in a :class:`~megatron_cai.core.distributed.squinch_feedback.SquinchFeedback` (the one
class the DDP, FSDP2 and HSDP reducers use), one residual per fragment and stage, carried across outer steps
and saved with the checkpoint. Every function returns the bytes this rank sent.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import squinch
from ..distributed.squinch_collectives import compressed_all_reduce, padded_chunk
from ..distributed.squinch_feedback import SquinchFeedback


class OuterReduce:
    """Averages a flat fp32 pseudo-gradient in place over ``islands`` ranks of ``group`` (None: one island)."""

    def __init__(self, bits: int, group, islands: int, feedback: SquinchFeedback) -> None:
        self.bits, self.group, self.islands, self.feedback = bits, group, islands, feedback

    def average(self, x: torch.Tensor, key: str) -> int:
        """``x`` <- the mean over islands of (the ``bits``-bit form of) ``x``; ``key`` names its residuals."""
        if self.bits == 32:
            sent = self._fp32(x)
        elif self.bits == 16:
            sent = self._bf16(x, key)
        else:
            sent = self._squinch(x, key)
        if self.islands > 1:
            x.div_(self.islands)
        return sent

    def _fp32(self, x: torch.Tensor) -> int:
        if self.islands == 1:
            return 0
        dist.all_reduce(x, group=self.group)
        return 2 * (self.islands - 1) * x.numel() * 4 // self.islands  # a ring all-reduce's bytes per rank

    def _squinch(self, x: torch.Tensor, key: str) -> int:
        n, world = x.numel(), self.islands
        if world == 1:
            payload, _ = squinch.encode_with_feedback(x, self.feedback.residual(key, n, x.device))
            squinch.decode(payload, n, out=x)
            return 0
        chunk = -(-n // world)
        residual = self.feedback.residual(key, world * padded_chunk(chunk), x.device)
        owner = self.feedback.residual(f"{key}.owner", padded_chunk(chunk), x.device)
        return compressed_all_reduce(x, self.group, world, residual, owner)

    def _bf16(self, x: torch.Tensor, key: str) -> int:
        n, world = x.numel(), self.islands
        chunk = -(-n // world)
        rows = torch.nn.functional.pad(x, (0, chunk * world - n))
        send = _to_bf16(rows, self.feedback.residual(key, rows.numel(), x.device))
        if world == 1:
            x.copy_(send.float())
            return 0
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        shard = recv.view(world, chunk)[0].float()
        for row in recv.view(world, chunk)[1:]:
            shard = shard + row.float()
        mine = _to_bf16(shard, self.feedback.residual(f"{key}.owner", chunk, x.device))
        full = torch.empty(world * chunk, dtype=torch.bfloat16, device=x.device)
        dist.all_gather_into_tensor(full, mine, group=self.group)
        x.copy_(full[:n].float())
        return 2 * (world - 1) * chunk * 2


def _to_bf16(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """bf16(y + residual) (round to nearest even); the residual keeps what the rounding cut off."""
    if residual is None:
        return y.to(torch.bfloat16)
    total = y + residual
    out = total.to(torch.bfloat16)
    residual.copy_(total - out.float())
    return out

"""Every island starts from island 0's weights, and sends them over the slow link only where they differ.

A fresh run initialises every island from the same ``--seed``, so its weights are already equal bit for bit;
broadcasting them would put a whole model copy per outer rank on the slow link (more than the outer steps of a
short run). :func:`start_from_island_0` compares a fingerprint of each buffer's bits over the outer group (two
int64 per buffer) and broadcasts only the buffers that differ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHT_PERIOD = 65521  # a prime: the position weights repeat after it


def bit_fingerprint(buffer: torch.Tensor) -> torch.Tensor:
    """Two int64: the sum of the elements' bit patterns and their sum weighted by position (mod a prime, + 1).

    Equal buffers give equal fingerprints; a changed or moved element changes them (short of an exact collision
    of both sums)."""
    bits = buffer.detach().reshape(-1).view(_INT_OF_SIZE[buffer.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % _WEIGHT_PERIOD + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def start_from_island_0(buffers: list[torch.Tensor], outer_group, island_0_rank: int) -> list[int]:
    """Make every island's ``buffers`` equal island 0's (collective over ``outer_group``). Returns the indices of
    the buffers that differed somewhere and were broadcast."""
    if not buffers:
        return []
    prints = torch.stack([bit_fingerprint(b) for b in buffers])  # [buffers, 2]
    both = torch.cat([prints, -prints], dim=1)  # one MAX gives the largest and the smallest fingerprint
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=outer_group)
    differ = [i for i in range(len(buffers)) if not torch.equal(both[i, :2], -both[i, 2:])]
    for i in differ:
        dist.broadcast(buffers[i], src=island_0_rank, group=outer_group)
    return differ

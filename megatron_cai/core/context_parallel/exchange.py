"""Point-to-point transfers between the CP ranks of one group, with exact byte counts.

One exchange step sends one packed tensor to one peer and receives one from another (``isend`` /
``irecv`` on the CP process group), so that the next key set arrives while the current one is being
computed. Sizes are known on both sides from the plan: an empty transfer is skipped by both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CommStats", "Peers", "Transfer", "start_transfer"]


@dataclass
class CommStats:
    """Bytes this rank put on the wire for attention (forward K/V, backward K/V again and dK/dV)."""

    forward_bytes: int = 0
    backward_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


@dataclass(frozen=True)
class Peers:
    """The CP group: its process group and the global rank of each CP rank."""

    group: object
    global_ranks: tuple[int, ...]


class Transfer:
    """An exchange in flight: ``wait()`` returns the received tensor (None when nothing was due)."""

    def __init__(self, works: list, recv: torch.Tensor | None, send: torch.Tensor | None) -> None:
        self.works, self.recv, self.send = works, recv, send  # the send buffer lives until wait()

    def wait(self) -> torch.Tensor | None:
        for w in self.works:
            w.wait()
        self.works, self.send = [], None
        return self.recv


def start_transfer(peers: Peers, send: torch.Tensor | None, send_to: int, recv_shape: tuple[int, ...] | None,
                   recv_from: int, *, dtype: torch.dtype, device: torch.device, tag: int) -> Transfer:
    """Post ``send`` to CP rank ``send_to`` and a receive of ``recv_shape`` from ``recv_from`` (either may be
    None, or empty: skipped)."""
    works = []
    recv = None
    if recv_shape is not None and all(n > 0 for n in recv_shape):
        recv = torch.empty(recv_shape, dtype=dtype, device=device)
        works.append(dist.irecv(recv, src=peers.global_ranks[recv_from], group=peers.group, tag=tag))
    if send is not None and send.numel() > 0:
        send = send.contiguous()
        works.append(dist.isend(send, dst=peers.global_ranks[send_to], group=peers.group, tag=tag))
    return Transfer(works, recv, send)

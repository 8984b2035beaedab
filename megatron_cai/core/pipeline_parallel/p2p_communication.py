"""Point-to-point exchange of activations and gradients between pipeline stages.

Every exchange is one ``batch_isend_irecv`` call. Within a call, forward-direction messages
(activations: send to next / receive from previous) are ordered before backward-direction ones
(gradients: send to previous / receive from next), and the two directions use different tags, so that
sends and receives pair up correctly even when the next and previous rank are the same process
(two stages, or the ring of interleaved schedules).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import parallel_state as ps

_FWD_TAG, _BWD_TAG = 1, 2


class P2P:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 requires_grad: bool = True) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.requires_grad = requires_grad

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def communicate(self, send_next: torch.Tensor | None = None, send_prev: torch.Tensor | None = None,
                    recv_prev: bool = False, recv_next: bool = False):
        """Send/receive in one batch; returns (tensor from previous stage, gradient from next stage)."""
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return None, None
        group = ps.get_pipeline_model_parallel_group()
        nxt, prv = ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank()
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        ops = []
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._ready(send_next), nxt, group, _FWD_TAG))
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev, prv, group, _FWD_TAG))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._ready(send_prev), prv, group, _BWD_TAG))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, nxt, group, _BWD_TAG))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        if from_prev is not None and self.requires_grad:
            from_prev.requires_grad_()
        return from_prev, from_next

    def _ready(self, t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) != tuple(self.shape):
            raise RuntimeError(f"pipeline p2p: tensor of shape {tuple(t.shape)} where {self.shape} was expected")
        return t.detach().to(self.dtype).contiguous()

    # Megatron-style names.
    def recv_forward(self) -> torch.Tensor | None:
        return self.communicate(recv_prev=True)[0]

    def recv_backward(self) -> torch.Tensor | None:
        return self.communicate(recv_next=True)[1]

    def send_forward(self, t: torch.Tensor | None) -> None:
        self.communicate(send_next=t)

    def send_backward(self, t: torch.Tensor | None) -> None:
        self.communicate(send_prev=t)

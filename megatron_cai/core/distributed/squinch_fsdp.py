"""Reduce-scatter communication hooks for FSDP2 (``FSDPModule.set_custom_reduce_scatter``).

FSDP2 hands each hook the flat, padded gradients of one parameter group (one ``fully_shard`` unit):
``input`` holds DP equal chunks, ``output`` receives this rank's chunk. We force sum reductions
(``set_force_sum_reduction_for_comms``), so the hook sums and FSDP divides by DP afterwards.

- ``CountingReduceScatter``: the plain reduce-scatter (gloo: all-to-all + rank-order fp32 sum), with
  the bytes this rank sent counted for the ``grad comm bytes`` log column.
- ``SquinchReduceScatter``: encode (error feedback) into DP rows, one ``all_to_all_single`` of uint8
  payloads, decode-accumulate into the shard (``squinch_collectives.compressed_reduce_scatter``).
  Each instance serves one FSDP parameter group and owns that group's residual.
- ``SquinchReduceScatter(inter_group=...)`` (``--squinch-hierarchical``, HSDP): FSDP2 shards over the
  DP ranks of one node; this is the uncompressed intra-node reduce-scatter (counted as intra-node
  bytes) and, as the unit's ``set_all_reduce_hook``, the Squinch all-reduce of the reduced shard across nodes, among the
  ranks with the same local index (``squinch_collectives.compressed_all_reduce``: error feedback on the
  all-to-all rows and on the owner's re-encode). FSDP2's native HSDP (a 2-D mesh) cannot be used: it
  always runs its own ``dist.all_reduce`` over the replicate dimension and calls an all-reduce hook
  only after it, so a compressed cross-node reduction has to be the hook of a 1-D (intra-node) mesh.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .. import device as device_mod
from .contracts import StatelessReducer
from .squinch_collectives import compressed_all_reduce, compressed_reduce_scatter, padded_chunk
from .squinch_feedback import ROWS, FeedbackReducer, SquinchFeedback

OWNER = "owner"  # HSDP: the residual of the owner's re-encode of its cross-node shard


def _check_sum(op) -> None:
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"FSDP2 reduce-scatter hook: expected a SUM reduction (force_sum_reduction_for_comms), "
                         f"got {op}")


class _Done:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class CountingReduceScatter(StatelessReducer, ReduceScatter):
    """Uncompressed sum reduce-scatter that counts bytes sent ((n-1)/n of the input)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.inter_node_bytes_sent = 0  # without nodes (flat DP) every byte counts as inter-node

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        _check_sum(op)
        n = group.size()
        nbytes = (n - 1) * input_tensor.numel() * input_tensor.element_size() // n
        self.bytes_sent += nbytes
        self.inter_node_bytes_sent += nbytes
        return device_mod.reduce_scatter_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class SquinchReduceScatter(FeedbackReducer, CountingReduceScatter):
    """Squinch 6-bit reduce-scatter with per-parameter-group error feedback.

    With ``inter_group`` (HSDP, ``--squinch-hierarchical``) it is instead the uncompressed reduce-scatter
    over the node's DP ranks, and :meth:`all_reduce_hook` (installed with ``set_all_reduce_hook``) sums
    the reduced shard across nodes, over ``inter_group`` (one rank per node), with the Squinch
    all-reduce: error feedback on its all-to-all rows (``residuals["rows"]``) and on the owner's
    re-encode (``residuals["owner"]``). FSDP2 then divides by the whole DP size. The residuals and the
    stochastic-rounding generator are its ``feedback`` (``squinch_feedback.SquinchFeedback``)."""

    def __init__(self, *, error_feedback: bool = True, stochastic: bool = False, seed: int = 0,
                 backend: str | None = None, inter_group=None) -> None:
        super().__init__()
        self.backend = backend
        self.feedback = SquinchFeedback(error_feedback=error_feedback, stochastic=stochastic, seed=seed)
        self.hierarchical = inter_group is not None
        self.inter_group = inter_group
        self.nodes = dist.get_world_size(inter_group) if inter_group is not None else 1

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        _check_sum(op)
        world = group.size()
        if self.hierarchical:  # inside the node: uncompressed, not inter-node traffic
            self.bytes_sent += (world - 1) * input_tensor.numel() * input_tensor.element_size() // world
            return device_mod.reduce_scatter_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        fb, dev = self.feedback, input_tensor.device
        nbytes = compressed_reduce_scatter(output_tensor, input_tensor, group, world,
                                           fb.residual(ROWS, world * padded_chunk(output_tensor.numel()), dev),
                                           stochastic=fb.stochastic, generator=fb.generator(dev),
                                           backend=self.backend)
        self.bytes_sent += nbytes
        self.inter_node_bytes_sent += nbytes
        return _Done() if async_op else None

    def all_reduce_hook(self, reduce_output: torch.Tensor) -> None:
        """HSDP: sum ``reduce_output`` (this rank's intra-node-reduced shard) over the nodes, in place."""
        if self.nodes == 1:
            return
        m, dev, fb = self.nodes, reduce_output.device, self.feedback
        row = padded_chunk(-(-reduce_output.numel() // m))
        nbytes = compressed_all_reduce(reduce_output, self.inter_group, m, fb.residual(ROWS, m * row, dev),
                                       fb.residual(OWNER, row, dev), stochastic=fb.stochastic,
                                       generator=fb.generator(dev), backend=self.backend)
        self.bytes_sent += nbytes
        self.inter_node_bytes_sent += nbytes

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
from .squinch_collectives import compressed_all_reduce, compressed_reduce_scatter, padded_chunk


def _check_sum(op) -> None:
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"FSDP2 reduce-scatter hook: expected a SUM reduction (force_sum_reduction_for_comms), "
                         f"got {op}")


class _Done:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class CountingReduceScatter(ReduceScatter):
    """Uncompressed sum reduce-scatter that counts bytes sent ((n-1)/n of the input)."""

    holds_squinch_state = False  # Squinch error-feedback residuals that checkpoints carry

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

    def step_skipped(self) -> None:
        return None

    def rescale_feedback(self, factor: float) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


class SquinchReduceScatter(CountingReduceScatter):
    """Squinch 6-bit reduce-scatter with per-parameter-group error feedback.

    With ``inter_group`` (HSDP, ``--squinch-hierarchical``) it is instead the uncompressed reduce-scatter
    over the node's DP ranks, and :meth:`all_reduce_hook` (installed with ``set_all_reduce_hook``) sums
    the reduced shard across nodes, over ``inter_group`` (one rank per node), with the Squinch
    all-reduce: error feedback on its all-to-all rows (``residuals["rows"]``) and on the owner's
    re-encode (``residuals["owner"]``). FSDP2 then divides by the whole DP size."""

    holds_squinch_state = True

    def __init__(self, *, error_feedback: bool = True, stochastic: bool = False, seed: int = 0,
                 backend: str | None = None, inter_group=None) -> None:
        super().__init__()
        self.error_feedback, self.stochastic, self.backend = error_feedback, stochastic, backend
        self.residual: torch.Tensor | None = None        # flat FSDP2: the reduce-scatter rows
        self.residuals: dict[str, torch.Tensor] = {}     # HSDP: the cross-node all-reduce's
        self.generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None  # restored before the gradients' device was known
        self._seed = seed
        self.hierarchical = inter_group is not None
        self.inter_group = inter_group
        self.nodes = dist.get_world_size(inter_group) if inter_group is not None else 1

    def _residual(self, numel: int, device: torch.device) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        if self.residual is None or self.residual.numel() != numel:
            self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        elif self.residual.device != device:  # restored from a checkpoint on the CPU
            self.residual = self.residual.to(device)
        return self.residual

    def _cross_node_residual(self, key: str, numel: int, device: torch.device) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        r = self.residuals.get(key)
        if r is None or r.numel() != numel:
            r = self.residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif r.device != device:  # restored from a checkpoint on the CPU
            r = self.residuals[key] = r.to(device)
        return r

    def _gen(self, device: torch.device) -> torch.Generator | None:
        """The stochastic-rounding generator, created on the gradients' device at first use (with the
        restored state, if any), as ``SquinchReducer`` does."""
        if not self.stochastic:
            return None
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self._seed)
            if self._generator_state is not None:
                self.generator.set_state(self._generator_state)
                self._generator_state = None
        return self.generator

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        _check_sum(op)
        world = group.size()
        if self.hierarchical:  # inside the node: uncompressed, not inter-node traffic
            self.bytes_sent += (world - 1) * input_tensor.numel() * input_tensor.element_size() // world
            return device_mod.reduce_scatter_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        residual = self._residual(world * padded_chunk(output_tensor.numel()), input_tensor.device)
        nbytes = compressed_reduce_scatter(output_tensor, input_tensor, group, world, residual,
                                           stochastic=self.stochastic, generator=self._gen(input_tensor.device),
                                           backend=self.backend)
        self.bytes_sent += nbytes
        self.inter_node_bytes_sent += nbytes
        return _Done() if async_op else None

    def all_reduce_hook(self, reduce_output: torch.Tensor) -> None:
        """HSDP: sum ``reduce_output`` (this rank's intra-node-reduced shard) over the nodes, in place."""
        if self.nodes == 1:
            return
        m, dev = self.nodes, reduce_output.device
        row = padded_chunk(-(-reduce_output.numel() // m))
        nbytes = compressed_all_reduce(reduce_output, self.inter_group, m,
                                       self._cross_node_residual("rows", m * row, dev),
                                       self._cross_node_residual("owner", row, dev), stochastic=self.stochastic,
                                       generator=self._gen(dev), backend=self.backend)
        self.bytes_sent += nbytes
        self.inter_node_bytes_sent += nbytes

    def _all_residuals(self) -> list[torch.Tensor]:
        return ([self.residual] if self.residual is not None else []) + list(self.residuals.values())

    def step_skipped(self) -> None:
        """A skipped step discards its gradients, including what error feedback carried."""
        for r in self._all_residuals():
            r.zero_()

    def rescale_feedback(self, factor: float) -> None:
        """Residuals follow a loss-scale change (they are in loss-scaled units), as in SquinchReducer."""
        for r in self._all_residuals():
            r.mul_(factor)

    def state_dict(self) -> dict:
        state = {"residual": None if self.residual is None else self.residual.detach().cpu().clone()}
        if self.residuals:
            state["residuals"] = {k: v.detach().cpu().clone() for k, v in self.residuals.items()}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        elif self._generator_state is not None:  # restored and not used yet
            state["generator"] = self._generator_state.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        r = state.get("residual")
        self.residual = None if r is None else r.clone()
        self.residuals = {k: v.clone() for k, v in state.get("residuals", {}).items()}
        if "generator" in state:  # placed on the gradients' device at first use, like the residuals
            self._generator_state, self.generator = state["generator"].clone(), None

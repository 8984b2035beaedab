"""Reduce-scatter communication hooks for FSDP2 (``FSDPModule.set_custom_reduce_scatter``).

FSDP2 hands each hook the flat, padded gradients of one parameter group (one ``fully_shard`` unit):
``input`` holds DP equal chunks, ``output`` receives this rank's chunk. We force sum reductions
(``set_force_sum_reduction_for_comms``), so the hook sums and FSDP divides by DP afterwards.

- ``CountingReduceScatter``: the plain reduce-scatter (gloo: all-to-all + rank-order fp32 sum), with
  the bytes this rank sent counted for the ``grad comm bytes`` log column.
- ``SquinchReduceScatter``: encode (error feedback) into DP rows, one ``all_to_all_single`` of uint8
  payloads, decode-accumulate into the shard (``squinch_collectives.compressed_reduce_scatter``).
  Each instance serves one FSDP parameter group and owns that group's residual.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .. import device as device_mod
from .squinch_collectives import compressed_reduce_scatter, padded_chunk


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

    def __init__(self) -> None:
        self.bytes_sent = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        _check_sum(op)
        n = group.size()
        self.bytes_sent += (n - 1) * input_tensor.numel() * input_tensor.element_size() // n
        return device_mod.reduce_scatter_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    def step_skipped(self) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


class SquinchReduceScatter(CountingReduceScatter):
    """Squinch 6-bit reduce-scatter with per-parameter-group error feedback."""

    def __init__(self, *, error_feedback: bool = True, stochastic: bool = False, seed: int = 0,
                 backend: str | None = None) -> None:
        super().__init__()
        self.error_feedback, self.stochastic, self.backend = error_feedback, stochastic, backend
        self.residual: torch.Tensor | None = None
        self.generator: torch.Generator | None = None
        self._seed = seed

    def _residual(self, numel: int, device: torch.device) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        if self.residual is None or self.residual.numel() != numel:
            self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        elif self.residual.device != device:  # restored from a checkpoint on the CPU
            self.residual = self.residual.to(device)
        return self.residual

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        _check_sum(op)
        world = group.size()
        residual = self._residual(world * padded_chunk(output_tensor.numel()), input_tensor.device)
        if self.stochastic and self.generator is None:
            self.generator = torch.Generator(device=input_tensor.device).manual_seed(self._seed)
        self.bytes_sent += compressed_reduce_scatter(output_tensor, input_tensor, group, world, residual,
                                                     stochastic=self.stochastic, generator=self.generator,
                                                     backend=self.backend)
        return _Done() if async_op else None

    def step_skipped(self) -> None:
        """A skipped step discards its gradients, including what error feedback carried."""
        if self.residual is not None:
            self.residual.zero_()

    def state_dict(self) -> dict:
        state = {"residual": None if self.residual is None else self.residual.detach().cpu().clone()}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        r = state.get("residual")
        self.residual = None if r is None else r.clone()
        if "generator" in state:
            self.generator = torch.Generator().manual_seed(self._seed)
            self.generator.set_state(state["generator"])

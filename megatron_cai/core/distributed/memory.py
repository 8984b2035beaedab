"""Per-rank memory report: bytes of parameters, gradients and optimizer state, and peak memory.

Works for the DDP wrapper (flat buffers; Adam state for the owned ranges, all of them or this rank's
shards with the distributed optimizer) and for FSDP2 chunks (DTensor shards). Gradients and Adam state
that FSDP2 / torch.optim allocate lazily (before the first backward / step) are counted at the size
they will take, so the start-up report already shows the steady state. Peak: CUDA's peak allocated
bytes on GPU, the process high-water mark (``ru_maxrss``) on CPU.
"""
from __future__ import annotations

import resource
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .. import device as device_mod
from .. import parallel_state as ps
from .contracts import ModelChunk

MiB = 1 << 20


@dataclass
class MemoryReport:
    params: int
    grads: int
    optimizer: int
    peak: int
    peak_kind: str  # "cuda peak allocated" or "process high-water mark"

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict:
        return asdict(self)

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        """``[params, grads, optimizer, peak]`` (fp64) on ``device``, for a max over ranks."""
        return torch.tensor([self.params, self.grads, self.optimizer, self.peak], dtype=torch.float64,
                            device=device)

    def from_values(self, values: list[float]) -> MemoryReport:
        """A report of ``values`` (the four figures of :meth:`as_tensor`) with this one's peak kind."""
        return MemoryReport(*(int(v) for v in values), self.peak_kind)

    def line(self, what: str = "per rank") -> str:
        return (f" memory ({what}): params {self.params / MiB:.2f} MiB | grads {self.grads / MiB:.2f} MiB | "
                f"optimizer state {self.optimizer / MiB:.2f} MiB | total {self.model_state / MiB:.2f} MiB | "
                f"peak ({self.peak_kind}) {self.peak / MiB:.1f} MiB")


def _nbytes(t: torch.Tensor) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return device_mod.max_memory_allocated(device), "cuda peak allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process high-water mark"


def memory_report(model_chunks: list[ModelChunk], optimizer, device: torch.device) -> MemoryReport:
    """This rank's bytes of parameters, gradients and optimizer state (see the module docstring)."""
    if model_chunks[0].data_parallel_kind == "fsdp2":  # FullyShardedAdamW: DTensor shards
        params = [p for c in model_chunks for p in c.module.parameters()]
        p_bytes = sum(_nbytes(p) for p in params)
        g_bytes = sum(_nbytes(p.grad) if p.grad is not None else _nbytes(p) for p in params)
        o_bytes = sum(sum(_nbytes(v) for v in optimizer.optimizer.state[p].values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0)
                      if p in optimizer.optimizer.state else 2 * _nbytes(p) for p in params)
    else:  # DistributedDataParallel + DistributedAdamW: flat buffers
        p_bytes = sum(_nbytes(m.buffer.param_data) for m in model_chunks)
        g_bytes = sum(_nbytes(m.buffer.grad_data) for m in model_chunks)
        o_bytes = sum(_nbytes(c.exp_avg) + _nbytes(c.exp_avg_sq) for chunk_list in optimizer.chunks
                      for c in chunk_list)
    peak, kind = peak_memory(device)
    return MemoryReport(p_bytes, g_bytes, o_bytes, peak, kind)


def max_over_ranks(report: MemoryReport, device: torch.device) -> MemoryReport:
    """Each figure's maximum over all ranks (collective)."""
    if ps.get_world_size() == 1:
        return report
    vec = report.as_tensor(device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    return report.from_values(vec.tolist())

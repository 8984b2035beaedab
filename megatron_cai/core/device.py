"""Device and collective-backend resolution: one code path for CPU (gloo) and CUDA (NCCL).

Nothing else in the project calls ``torch.cuda.*`` directly; it asks this module. Collectives that a
backend lacks get their fallback here, never at call sites.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def resolve_device(name: str | None = None, local_rank: int = 0) -> torch.device:
    """`cpu`, `cuda` or None (cuda when available). On CUDA, selects the local GPU of this process."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but torch.cuda.is_available() is False")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if name != "cpu":
        raise ValueError(f"unknown device {name!r}: expected 'cpu' or 'cuda'")
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for a device type: nccl on CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def autocast(device: torch.device, enabled: bool, dtype: torch.dtype = torch.bfloat16):
    """bf16 autocast on CPU and CUDA alike (a no-op context when disabled)."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (for timing); no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_memory_allocated(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def memory_stats(device: torch.device) -> dict[str, int]:
    """Megatron-LM's --log-memory-to-tensorboard figures: CUDA's caching-allocator statistics (reserved,
    allocated and peak allocated bytes, live allocations); on CPU the process's resident bytes for the first
    two, its high-water mark for the peak, and 0 allocations (CPU has no allocator counters)."""
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        return {"reserved": s.get("reserved_bytes.all.current", 0),
                "allocated": s.get("allocated_bytes.all.current", 0),
                "peak": s.get("allocated_bytes.all.peak", 0), "count": s.get("allocation.all.current", 0)}
    import resource

    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"reserved": rss, "allocated": rss, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "count": 0}


def cuda_available() -> bool:
    """Whether a CUDA device can be used by this process."""
    return torch.cuda.is_available()


def empty_cache(device: torch.device) -> None:
    """Release the CUDA caching allocator's unused blocks (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def default_device_name() -> str:
    """"cuda" when a GPU is available, else "cpu" (the default of --device flags)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_capability(device: torch.device) -> int:
    """Compute capability as major * 10 + minor (0 for non-CUDA devices)."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def device_name(device: torch.device) -> str:
    """Human-readable device name (the GPU model on CUDA)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def kernel_limits(device: torch.device) -> tuple[int, int]:
    """(compute capability, per-block opt-in shared memory in bytes; 0 where this torch does not report it)
    of a CUDA device, for kernel launchers (core/kernel_configs.py falls back to its table)."""
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", 0)
    return props.major * 10 + props.minor, int(smem or 0)


def new_timing_event(device: torch.device):
    """A CUDA timing event (None on CPU, where callers use wall-clock time)."""
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None


# ----------------------------------------------------------------------------------------------- RNG
def get_rng_state() -> dict[str, Any]:
    """All generator states of this process (python, numpy, torch CPU and the current CUDA device)."""
    state = {
        "random": random.getstate(),
        "numpy": _numpy_state_as_data(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _numpy_state_as_data(state: tuple) -> tuple:
    """NumPy's legacy generator state with its key array as a tensor: plain data for a weights-only load."""
    name, keys, pos, has_gauss, cached = state
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    name, keys, *rest = state["numpy"]  # keys: a tensor (plain data), or an ndarray in older checkpoints
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def device_rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator that dropout uses on `device`."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_device_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def seed_device(device: torch.device, seed: int) -> None:
    """Seed only the generator that dropout uses on `device` (the current CUDA device, or the CPU one)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def manual_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)  # also seeds every CUDA device


# ------------------------------------------------------------------------------------- collectives
def _backend(group) -> str:
    return dist.get_backend(group)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Sum-reduce `input` (world * len(output) elements) and keep this rank's chunk in `output`.

    On gloo, whose reduce-scatter runs a full all-reduce (twice the bytes), this is an all-to-all
    followed by a local sum in fp32 in rank order: (n-1)/n of the buffer on the wire, as on NCCL.
    """
    if _backend(group) == "gloo":
        return _a2a_reduce_scatter(output, input, group, async_op)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        return fn(output, input, group=group, async_op=async_op)
    except (RuntimeError, NotImplementedError):
        # Fallback for backends without reduce_scatter: all-reduce a copy, keep our slice.
        buf = input.clone()
        dist.all_reduce(buf, group=group)
        rank = dist.get_rank(group)
        output.copy_(buf.view(-1, output.numel())[rank].view_as(output))
        return _DoneWork() if async_op else None


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's `input` into consecutive chunks of `output`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        return fn(output, input, group=group, async_op=async_op)
    except (RuntimeError, NotImplementedError):
        chunks = list(output.view(-1, input.numel()).unbind(0))
        dist.all_gather(chunks, input.reshape(-1), group=group)
        return _DoneWork() if async_op else None


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Equal-split all-to-all: chunk i of `input` goes to rank i; chunk i of `output` comes from rank i."""
    return dist.all_to_all_single(output, input, group=group, async_op=async_op)


def _sum_chunks_into(recv: torch.Tensor, output: torch.Tensor) -> None:
    """output = recv[0] + recv[1] + ... in fp32, in rank order."""
    acc = recv[0].float()
    for chunk in recv[1:]:
        acc = acc + chunk.float()
    output.copy_(acc.view_as(output))


class _SumOnWait:
    def __init__(self, work, recv: torch.Tensor, output: torch.Tensor) -> None:
        self.work, self.recv, self.output = work, recv, output

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            _sum_chunks_into(self.recv, self.output)
        return True

    def is_completed(self) -> bool:
        return self.work is None


def _a2a_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    world = dist.get_world_size(group)
    send = input.reshape(world, output.numel()).contiguous()
    recv = torch.empty_like(send)
    if async_op:
        return _SumOnWait(dist.all_to_all_single(recv, send, group=group, async_op=True), recv, output)
    dist.all_to_all_single(recv, send, group=group)  # synchronous: traceable under torch.compile
    _sum_chunks_into(recv, output)
    return None


class _DoneWork:
    """A finished work handle, for fallbacks that ran synchronously."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

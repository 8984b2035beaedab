"""Gradient reducers: how one bucket's gradients are averaged over the data-parallel group.

The interface (``contracts.BucketReducer``) is deliberately small::

    handle = reducer.reduce(bucket)   # starts the reduction (asynchronously where possible)
    handle.wait()                     # afterwards the bucket holds the DP-mean gradient: the whole
                                      # bucket (all-reduce) or this rank's shard (reduce-scatter)

``reducer.bytes_sent`` counts the bytes this rank put on the wire for gradients (the algorithmic
volume of the collective: a ring all-reduce sends 2(n-1)/n of the buffer, a reduce-scatter (n-1)/n).
``reducer.shards`` says whether only the shard is valid afterwards (distributed optimizer).
``build_reducer`` picks one of the two plain reducers here or ``squinch_reducer.SquinchReducer``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import device as device_mod
from .config import DDPConfig
from .contracts import BucketReducer, StatelessReducer
from .grad_buffer import Bucket
from .squinch_reducer import SquinchReducer

__all__ = ["AllReduceReducer", "ReduceScatterReducer", "build_reducer"]


class CompletedHandle:
    def wait(self) -> None:
        return None


class WorkHandle:
    def __init__(self, work) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class _PlainReducer(StatelessReducer):
    """Uncompressed, flat DP: no state between steps, every byte counted as inter-node."""

    shards = False

    def __init__(self, dp_group, dp_size: int) -> None:
        self.group, self.dp_size = dp_group, dp_size
        self.bytes_sent = 0

    @property
    def inter_node_bytes_sent(self) -> int:
        return self.bytes_sent


class AllReduceReducer(_PlainReducer):
    """Plain DP: pre-scale by 1/DP and all-reduce (sum) the whole bucket."""

    def reduce(self, bucket: Bucket):
        if self.dp_size == 1:
            return CompletedHandle()
        bucket.grad_data.mul_(1.0 / self.dp_size)
        n = self.dp_size
        self.bytes_sent += 2 * (n - 1) * bucket.grad_data.numel() * bucket.grad_data.element_size() // n
        return WorkHandle(dist.all_reduce(bucket.grad_data, group=self.group, async_op=True))


class ReduceScatterReducer(_PlainReducer):
    """Distributed optimizer: pre-scale by 1/DP and reduce-scatter; each rank keeps its shard's sum."""

    shards = True

    def reduce(self, bucket: Bucket):
        if self.dp_size == 1:
            return CompletedHandle()
        bucket.grad_data.mul_(1.0 / self.dp_size)
        n = self.dp_size
        self.bytes_sent += (n - 1) * bucket.grad_data.numel() * bucket.grad_data.element_size() // n
        shard = bucket.shard(bucket.grad_data)
        # reduce_scatter_tensor may not write into a view of its own input on every backend: use a temp.
        out = torch.empty_like(shard)
        work = device_mod.reduce_scatter_tensor(out, bucket.grad_data, group=self.group, async_op=True)
        return _CopyBack(work, out, shard)


class _CopyBack:
    def __init__(self, work, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.work, self.src, self.dst = work, src, dst

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.dst.copy_(self.src)
            self.work = None


def build_reducer(config: DDPConfig, dp_group, dp_size: int, *, seed: int = 0,
                  timing_level: int = 0) -> BucketReducer:
    """The reducer ``config.reducer`` names: `allreduce`, `reducescatter`, or `squinch` (see
    core.distributed.squinch_reducer; ``seed`` seeds its stochastic rounding, ``timing_level`` > 0 records
    its per-phase timers, as --timing-log-level)."""
    if config.reducer == "allreduce":
        return AllReduceReducer(dp_group, dp_size)
    if config.reducer == "reducescatter":
        return ReduceScatterReducer(dp_group, dp_size)
    if config.reducer == "squinch":
        sq = config.squinch
        return SquinchReducer(dp_group, dp_size, error_feedback=sq.error_feedback, stochastic=sq.stochastic_rounding,
                              hierarchical=sq.hierarchical, shard_only=config.use_distributed_optimizer, seed=seed,
                              timing_level=timing_level)
    raise ValueError(f"unknown gradient reducer {config.reducer!r}")

"""Typed configuration of data-parallel gradient reduction: DDPConfig and its SquinchConfig.

Built from the flags by ``megatron_cai.training.arguments.build_config``; taken by
:class:`~megatron_cai.core.distributed.ddp.DistributedDataParallel` and
:func:`~megatron_cai.core.distributed.reducers.build_reducer`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

REDUCERS = ("allreduce", "reducescatter", "squinch")


@dataclass
class SquinchConfig:
    """6-bit Squinch compression of DP gradients (flags --squinch-*; see docs/squinch-format.md)."""

    error_feedback: bool = True        # --[no-]squinch-error-feedback
    stochastic_rounding: bool = False  # --squinch-stochastic-rounding
    hierarchical: bool = False         # --squinch-hierarchical: uncompressed inside a node


@dataclass
class DDPConfig:
    """How gradients are bucketed and averaged over the data-parallel group.

    ``reducer``: "allreduce" (plain DP), "reducescatter" (with the distributed optimizer) or "squinch"
    (compressed; reduce-scatter semantics when ``use_distributed_optimizer``).
    ``bucket_size``: elements per bucket with ``overlap_grad_reduce`` (None: Megatron's max(40M, 1M x DP);
    hierarchical Squinch: max(40M, 1M x nodes), see ``bucket_elements``).
    """

    reducer: str = "allreduce"
    grad_reduce_in_bf16: bool = False
    bucket_size: int | None = None
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    use_torch_fsdp2: bool = False      # --use-torch-fsdp2: FSDP2 shards params, grads, Adam state (fsdp.py)
    squinch: SquinchConfig = field(default_factory=SquinchConfig)

    def __post_init__(self) -> None:
        if self.reducer not in REDUCERS:
            raise ValueError(f"DDPConfig: reducer {self.reducer!r} is not one of {', '.join(REDUCERS)}")
        if isinstance(self.squinch, dict):
            self.squinch = SquinchConfig(**self.squinch)
        if self.use_torch_fsdp2 and self.use_distributed_optimizer:
            raise ValueError("--use-torch-fsdp2 already shards the optimizer state: drop --use-distributed-optimizer")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1, got {self.bucket_size}")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype of the gradient buffers that are reduced (--grad-reduce-in-bf16)."""
        return torch.bfloat16 if self.grad_reduce_in_bf16 else torch.float32

    def bucket_elements(self, dp_size: int, nodes: int | None = None) -> int:
        """Elements per gradient bucket: ``--ddp-bucket-size``, else Megatron's max(40M, 1M x DP).

        Hierarchical Squinch (``nodes``: the data-parallel group's nodes) counts nodes instead of ranks:
        its compressed collectives run among one rank per node, and Megatron's rule makes its buckets
        8x too large at 8 ranks per node, which exposes the last bucket's whole pipeline after backward.
        The step-time model (docs/squinch-performance.md) puts max(40M, 1M x nodes) within 2% of the best
        bucket size for GPT 1.3B-70B on 64-4,096 GPUs, where 1M x DP is up to 13% slower."""
        if self.bucket_size:
            return self.bucket_size
        if self.reducer == "squinch" and self.squinch.hierarchical and nodes is not None:
            return max(40_000_000, 1_000_000 * nodes)
        return max(40_000_000, 1_000_000 * dp_size)

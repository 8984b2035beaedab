"""Megatron-style data parallelism over contiguous gradient buckets.

Backward hooks add each parameter's gradient into its ``main_grad`` view of the bucket buffer. On the
last micro-batch of an iteration, a bucket whose parameters are all ready is handed to the reducer
at once (``overlap_grad_reduce``), so communication overlaps the rest of backward;
``finish_grad_sync`` launches whatever is left and waits. Earlier micro-batches only accumulate.

Gradients that are partial per rank in another dimension are summed there too: the tied word
embeddings of the first and last pipeline stage over the embedding group (before their own, deferred,
bucket is reduced, because the two stages lay out their buffers differently), and TP-partial gradients
(sequence-parallel norms/biases, replicated KV projections) over the TP group.

MoE expert parameters (``is_expert``) sit in buckets of their own; given an ``expert_reducer`` (over the
expert-data-parallel group), ``reducer`` becomes ``expert_reducer.DenseAndExpertReducer`` of the two.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import parallel_state as ps
from .comm_timing import StepTimeline
from .config import DDPConfig
from .contracts import BucketReducer
from .expert_reducer import DenseAndExpertReducer
from .grad_buffer import ParamAndGradBuffer


class DistributedDataParallel(nn.Module):
    """One model chunk over contiguous gradient buckets and a reducer (a ``contracts.ModelChunk``)."""

    data_parallel_kind = "ddp"

    def __init__(self, module: nn.Module, reducer: BucketReducer, config: DDPConfig, *, device: torch.device,
                 timeline: StepTimeline | None = None, expert_reducer: BucketReducer | None = None) -> None:
        super().__init__()
        self.module = module
        self.timeline = timeline  # --timing-log-level 2: when buckets are handed over (comm_timing)
        self.config = config
        self.overlap_grad_reduce = overlap_grad_reduce = config.overlap_grad_reduce
        dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)  # gradients reduce over DP x CP
        bucket_size = config.bucket_elements(dp_size, nodes=ps.get_data_parallel_inter_node_world_size())
        params = [p for p in module.parameters() if p.requires_grad]
        shared = {id(p) for p in params if getattr(p, "shared_embedding", False)}
        self.shared_params = [p for p in params if id(p) in shared]
        self.tp_partial_params = [p for p in params if getattr(p, "allreduce_over_tp", False)]
        self.buffer = ParamAndGradBuffer(
            params, grad_dtype=config.grad_dtype, bucket_size=bucket_size if overlap_grad_reduce else None,
            dp_size=dp_size, dp_rank=ps.get_data_parallel_rank(with_context_parallel=True), device=device,
            separate=shared, expert={id(p) for p in params if getattr(p, "is_expert", False)},
            expert_dp=(ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank()))
        if expert_reducer is not None:
            reducer = DenseAndExpertReducer(reducer, expert_reducer, ps.get_expert_data_parallel_world_size() / dp_size)
        self.reducer = reducer
        reducer.attach(device)  # reducer state (e.g. Squinch residuals) lives on the buckets' device
        self.is_last_microbatch = True
        self._handles: dict[int, object] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self.zero_grad_buffer()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None
        if self.overlap_grad_reduce and self.is_last_microbatch:
            bucket = self.buffer.bucket_of[id(param)]
            bucket.pending.discard(id(param))
            if not bucket.pending and not bucket.deferred and bucket.index not in self._handles:
                self._hand_over(bucket)

    def _hand_over(self, bucket) -> None:
        if self.timeline is None:
            self._handles[bucket.index] = self.reducer.reduce(bucket)
            return
        self.timeline.bucket_ready(bucket.index, bucket.numel)
        with self.timeline.in_reducer():
            self._handles[bucket.index] = self.reducer.reduce(bucket)

    def zero_grad_buffer(self) -> None:
        self.buffer.zero_grad()
        for bucket in self.buffer.buckets:
            bucket.pending = {id(p) for p in bucket.params}
        self._handles = {}

    def set_is_last_microbatch(self, last: bool) -> None:
        """Only the last micro-batch's backward hands buckets to the reducer (grad accumulation)."""
        self.is_last_microbatch = last

    def finish_grad_sync(self) -> None:
        """Complete the DP reduction of every bucket and the cross-stage / cross-TP gradient sums."""
        embd_group = ps.get_embedding_group()
        if self.shared_params and embd_group is not None and len(ps.get_embedding_global_ranks()) > 1:
            for p in self.shared_params:
                dist.all_reduce(p.main_grad, group=embd_group)
        for bucket in self.buffer.buckets:
            if bucket.index not in self._handles:
                self._hand_over(bucket)
        for bucket in self.buffer.buckets:
            self._handles[bucket.index].wait()
        if self.tp_partial_params and ps.get_tensor_model_parallel_world_size() > 1:
            grads = [p.main_grad for p in self.tp_partial_params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
            for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    @property
    def grad_comm_bytes(self) -> int:
        return self.reducer.bytes_sent

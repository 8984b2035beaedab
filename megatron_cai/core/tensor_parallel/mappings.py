"""Autograd-aware communication between tensor-parallel ranks.

Activations are laid out ``[batch, seq, hidden]``. The "tensor-parallel region" ops work on the last
dimension; the "sequence-parallel region" ops split/gather the sequence dimension (dim 1).
With a TP group of one rank every op is the identity. ``gather_rows`` / ``reduce_scatter_rows`` (and their
autograd forms ``GatherRows`` / ``ReduceScatterRows``) do the same along dim 0 over any group: the
sequence-parallel ops over TP, and the MoE allgather dispatcher over TP x EP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import device as device_mod
from .. import parallel_state as ps


def _tp():
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    group, world = _tp()
    if world == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor) -> torch.Tensor:
    group, world = _tp()
    if world == 1:
        return x
    return x.chunk(world, dim=-1)[ps.get_tensor_model_parallel_rank()].contiguous()


def _gather_last(x: torch.Tensor) -> torch.Tensor:
    group, world = _tp()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _split_seq(x: torch.Tensor) -> torch.Tensor:
    group, world = _tp()
    if world == 1:
        return x
    if x.shape[1] % world != 0:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by tensor-model-parallel size {world} "
                         "(required by --sequence-parallel)")
    return x.chunk(world, dim=1)[ps.get_tensor_model_parallel_rank()].contiguous()


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 over ``group``, in rank order."""
    out = torch.empty((x.shape[0] * _world(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    device_mod.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's equal share of dim 0."""
    out = torch.empty((x.shape[0] // _world(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    device_mod.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _gather_seq(x: torch.Tensor) -> torch.Tensor:
    group, world = _tp()
    if world == 1:
        return x
    return gather_rows(x.transpose(0, 1), group).transpose(0, 1)  # [s, b, h]: chunks along s are contiguous


def _reduce_scatter_seq(x: torch.Tensor) -> torch.Tensor:
    group, world = _tp()
    if world == 1:
        return x
    if x.shape[1] % world != 0:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by tensor-model-parallel size {world}")
    return reduce_scatter_rows(x.transpose(0, 1), group).transpose(0, 1)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone()) if _tp()[1] > 1 else x

    @staticmethod
    def backward(ctx, g):
        return g


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last(x)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g)


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_seq(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_seq(g)


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence; backward reduce-scatters (the consumer is TP-partial)."""

    @staticmethod
    def forward(ctx, x, reduce_grad: bool):
        ctx.reduce_grad = reduce_grad
        return _gather_seq(x)

    @staticmethod
    def backward(ctx, g):
        return (_reduce_scatter_seq(g) if ctx.reduce_grad else _split_seq(g)), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_seq(x)

    @staticmethod
    def backward(ctx, g):
        return _gather_seq(g)


class GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward reduce-scatters (``GatherRows.apply(x, group)``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_rows(x, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_rows(g, ctx.group), None


class ReduceScatterRows(torch.autograd.Function):
    """Reduce-scatter along dim 0 over a group; backward all-gathers (``ReduceScatterRows.apply(x, group)``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_rows(g, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over TP in backward."""
    return _Copy.apply(x) if _tp()[1] > 1 else x


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-reduce over TP in forward; identity backward."""
    return _Reduce.apply(x) if _tp()[1] > 1 else x


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return _Scatter.apply(x) if _tp()[1] > 1 else x


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return _Gather.apply(x) if _tp()[1] > 1 else x


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return _ScatterSeq.apply(x) if _tp()[1] > 1 else x


def gather_from_sequence_parallel_region(x: torch.Tensor, reduce_grad: bool = True) -> torch.Tensor:
    return _GatherSeq.apply(x, reduce_grad) if _tp()[1] > 1 else x


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return _ReduceScatterSeq.apply(x) if _tp()[1] > 1 else x

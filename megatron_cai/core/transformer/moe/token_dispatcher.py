"""Token dispatchers: move each token to the ranks that hold its experts and back (megatron-core's layout).

Both take the router's ``probs`` and ``routing_map`` (``[tokens, experts]``) and hand the experts their tokens
grouped by local expert, with ``tokens_per_expert`` (host ints) and each row's routing probability:

- ``allgather``: all-gather tokens, probabilities and map over the TP x EP group, keep the rows routed to local
  experts; the combine is a reduce-scatter over the same group (it also sums the expert-TP partial outputs).
- ``alltoall``: sort the local tokens by expert, exchange them over the EP group with one all-to-all, regroup
  the received chunks from (source rank, expert) to (expert, source rank); the combine reverses each step.

The permutation is Megatron's: rows of ``routing_map.T`` (expert-major, token order within an expert) picked by a
stable argsort; the combine scatter-adds each row back to its token.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...tensor_parallel.mappings import GatherRows, ReduceScatterRows, gather_rows


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with row splits; backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, output_splits: list[int], input_splits: list[int]):
        ctx.group, ctx.splits = group, (input_splits, output_splits)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        input_splits, output_splits = ctx.splits
        out = g.new_empty((sum(input_splits), *g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), input_splits, output_splits, group=ctx.group)
        return out, None, None, None


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """Rows of ``tokens`` grouped by expert (token order within each), their probabilities, and the source row
    of each (for :func:`unpermute`)."""
    num_tokens = tokens.shape[0]
    map_t = routing_map.bool().T.contiguous()
    flat = map_t.reshape(-1).argsort(descending=True, stable=True)[: int(map_t.sum())]
    return tokens.index_select(0, flat % num_tokens), probs.T.contiguous().reshape(-1)[flat], flat % num_tokens


def unpermute(rows: torch.Tensor, source: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum each row into its source token (the inverse of :func:`permute`, adding a token's experts)."""
    out = torch.zeros((num_tokens, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    return out.scatter_add(0, source.unsqueeze(1).expand(-1, rows.shape[1]), rows)


class AllGatherDispatcher:
    """Megatron's ``MoEAllGatherTokenDispatcher`` (tokens gathered over the TP x EP group)."""

    def __init__(self, num_experts: int, local_experts: range, tp_ep_group=None) -> None:
        self.num_experts, self.local_experts, self.group = num_experts, local_experts, tp_ep_group

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        if _world(self.group) > 1:
            routing_map = gather_rows(routing_map, self.group)
            probs = GatherRows.apply(probs, self.group)
            tokens = GatherRows.apply(tokens, self.group)
        lo, hi = self.local_experts.start, self.local_experts.stop
        local_map = routing_map[:, lo:hi].contiguous()
        self.num_tokens = tokens.shape[0]
        rows, row_probs, self.source = permute(tokens, local_map, probs[:, lo:hi])
        return rows, local_map.sum(dim=0).tolist(), row_probs

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        out = unpermute(rows, self.source, self.num_tokens)
        return ReduceScatterRows.apply(out, self.group) if _world(self.group) > 1 else out


class AllToAllDispatcher:
    """Megatron's ``MoEAlltoAllTokenDispatcher`` over the EP group (expert TP of one)."""

    def __init__(self, num_experts: int, local_experts: range, ep_group=None) -> None:
        self.num_experts, self.local_experts, self.group = num_experts, local_experts, ep_group
        self.ep = _world(ep_group)

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        self.num_tokens = tokens.shape[0]
        rows, row_probs, self.source = permute(tokens, routing_map, probs)
        per_expert = routing_map.sum(dim=0)
        if self.ep == 1:
            return rows, per_expert.tolist(), row_probs
        everyone = gather_rows(per_expert.unsqueeze(0), self.group)  # [ep, experts]: rank r's counts
        local_e = len(self.local_experts)
        lo, hi = self.local_experts.start, self.local_experts.stop
        self.input_splits = per_expert.view(self.ep, local_e).sum(dim=1).tolist()
        received = everyone[:, lo:hi]  # [source rank, local expert]
        self.output_splits = received.sum(dim=1).tolist()
        self.chunks = received.reshape(-1).tolist()  # received order: (source rank, local expert)
        rows = _AllToAll.apply(rows, self.group, self.output_splits, self.input_splits)
        row_probs = _AllToAll.apply(row_probs, self.group, self.output_splits, self.input_splits)
        order = [r * local_e + e for e in range(local_e) for r in range(self.ep)]  # -> (local expert, rank)
        self.inverse = [order.index(i) for i in range(len(order))]
        return (self._sort_chunks(rows, self.chunks, order), received.sum(dim=0).tolist(),
                self._sort_chunks(row_probs, self.chunks, order))

    @staticmethod
    def _sort_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
        parts = torch.split(x, sizes, dim=0)
        return torch.cat([parts[i] for i in order], dim=0)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        if self.ep > 1:
            local_e = len(self.local_experts)
            sorted_sizes = [self.chunks[r * local_e + e] for e in range(local_e) for r in range(self.ep)]
            rows = self._sort_chunks(rows, sorted_sizes, self.inverse)
            rows = _AllToAll.apply(rows, self.group, self.input_splits, self.output_splits)
        return unpermute(rows, self.source, self.num_tokens)

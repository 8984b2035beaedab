"""Contiguous parameter and gradient buffers, cut into buckets in backward order (Megatron-style).

Every parameter's ``.data`` becomes a view into one flat fp32 ``param_data`` buffer and its
``.main_grad`` a view into ``grad_data`` (fp32, or bf16 with --grad-reduce-in-bf16). Parameters are
laid out in reverse registration order (about the order backward produces their gradients) and cut
into buckets of at least ``bucket_size`` elements. Each bucket is padded so that it splits into DP
equal shards whose size is a multiple of 8 (the Squinch block), and 128-element aligned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    index: int
    start: int
    end: int                      # padded end (exclusive), in buffer coordinates
    params: list[nn.Parameter]
    grad_data: torch.Tensor       # view of the bucket's gradients
    param_data: torch.Tensor      # view of the bucket's parameters
    dp_size: int
    dp_rank: int
    deferred: bool = False        # reduced only in finish_grad_sync (e.g. tied embeddings)
    expert: bool = False          # MoE expert parameters only: reduced over the expert-data-parallel group
    pending: set = field(default_factory=set)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def shard_size(self) -> int:
        return self.numel // self.dp_size

    def shard(self, data: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """The slice of a bucket-sized view owned by DP rank `rank` (default: this rank)."""
        r = self.dp_rank if rank is None else rank
        return data[r * self.shard_size:(r + 1) * self.shard_size]

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        r = self.dp_rank if rank is None else rank
        return self.start + r * self.shard_size, self.start + (r + 1) * self.shard_size


def bucket_padding(dp_size: int) -> int:
    """Buckets are padded to a multiple of lcm(8 * DP, 128) elements."""
    return math.lcm(8 * dp_size, 128)


class ParamAndGradBuffer:
    def __init__(self, params: list[nn.Parameter], *, grad_dtype: torch.dtype, bucket_size: int | None,
                 dp_size: int, dp_rank: int, device: torch.device,
                 separate: set[int] | None = None, expert: set[int] | None = None,
                 expert_dp: tuple[int, int] = (1, 0)) -> None:
        """``expert``: the MoE expert parameters, bucketed apart and split over the expert-DP group
        (``expert_dp``: its size and this rank's place in it) instead of DP."""
        self.params = params
        self.dp_size, self.dp_rank = dp_size, dp_rank
        pads = {False: bucket_padding(dp_size), True: bucket_padding(expert_dp[0])}
        separate, expert = separate or set(), expert or set()
        self.offsets: dict[int, tuple[int, int]] = {}
        layout: list[tuple[int, int, list[nn.Parameter], bool]] = []  # (start, end, params, deferred)
        cur_start, cur, cur_params = 0, 0, []

        def close(deferred: bool = False) -> None:
            nonlocal cur_start, cur, cur_params
            if cur_params:
                pad = pads[id(cur_params[0]) in expert]
                end = cur_start + math.ceil((cur - cur_start) / pad) * pad
                layout.append((cur_start, end, cur_params, deferred))
                cur_start = cur = end
                cur_params = []

        for p in reversed(params):
            alone = id(p) in separate
            if alone or (cur_params and (id(p) in expert) != (id(cur_params[0]) in expert)):
                close()  # a bucket holds expert parameters only, or none
            self.offsets[id(p)] = (cur, cur + p.numel())
            cur += p.numel()
            cur_params.append(p)
            if alone:
                close(deferred=True)
            elif bucket_size is not None and cur - cur_start >= bucket_size:
                close()
        close()
        self.numel = cur_start
        self.param_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        for p in params:
            s, e = self.offsets[id(p)]
            view = self.param_data[s:e].view_as(p)
            view.copy_(p.data)
            p.data = view
            p.main_grad = self.grad_data[s:e].view_as(p)
        self.buckets = [Bucket(i, s, e, ps, self.grad_data[s:e], self.param_data[s:e],
                               *(expert_dp if id(ps[0]) in expert else (dp_size, dp_rank)), deferred,
                               expert=id(ps[0]) in expert)
                        for i, (s, e, ps, deferred) in enumerate(layout)]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def owned_ranges(self, distributed: bool) -> list[tuple[int, int]]:
        """Buffer ranges this rank's optimizer updates: its shard of every bucket, or everything."""
        if not distributed:
            return [(b.start, b.end) for b in self.buckets]
        return [b.shard_range() for b in self.buckets]

    def segments(self, flag) -> list[tuple[int, int]]:
        """Merged buffer ranges of the parameters for which ``flag(param)`` is true."""
        spans = sorted(self.offsets[id(p)] for p in self.params if flag(p))
        merged: list[list[int]] = []
        for s, e in spans:
            if merged and merged[-1][1] == s:
                merged[-1][1] = e
            else:
                merged.append([s, e])
        return [tuple(m) for m in merged]

    def zero_grad(self) -> None:
        self.grad_data.zero_()

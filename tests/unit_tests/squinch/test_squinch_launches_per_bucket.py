"""One kernel launch per bucket and phase, not one per data-parallel rank.

A bucket's Squinch all-reduce (what ``SquinchReducer`` does, collectives aside) is: encode DP rows,
decode-sum the received rows, the owner's re-encode, decode the gathered rows. On CUDA every kernel
launch costs microseconds, so the count must not grow with DP (at DP = 512 a per-row loop was over
1,500 launches per bucket per phase). Here the tensors live on the ``meta`` device (a stand-in for CUDA:
every torch op is dispatched but nothing runs), Triton's launch entry point is patched to count instead
of compiling, and a dispatch mode counts every other kernel (torch ops that are not views or
allocations).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton")

from megatron_cai.core.distributed import squinch_collectives as sc  # noqa: E402

_ALLOCATIONS = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach", "alias"}


class _TorchKernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _ALLOCATIONS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _bucket_launches(monkeypatch, dp: int, shard: int) -> tuple[list[str], list[str]]:
    """(Triton launches, torch kernels) of one bucket's compressed all-reduce at data-parallel size dp."""
    launched: list[str] = []

    def count(self, *args, grid, warmup, **kwargs):
        launched.append(self.fn.__name__)

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", count)
    meta = torch.device("meta")
    bucket = torch.empty(dp * shard, device=meta)
    residual, owner_residual = torch.empty_like(bucket), torch.empty(shard, device=meta)

    def one_bucket():
        send = sc.encode_rows(bucket, dp, residual, backend="triton")
        recv = torch.empty_like(send)  # the all-to-all's receive buffer
        sc.decode_sum_into(recv, bucket[:shard], backend="triton")
        owner_send = sc.encode_rows(bucket[:shard], 1, owner_residual, backend="triton")
        gathered = torch.empty(dp, owner_send.shape[1], dtype=torch.uint8, device=meta)  # the all-gather's
        sc.decode_rows_into(gathered, bucket, backend="triton")

    one_bucket()  # first use: the codec's lookup tables and scratch are created once per device
    launched.clear()
    with _TorchKernels() as torch_kernels:
        one_bucket()
    return launched, torch_kernels.ops


def test_launches_per_bucket_do_not_grow_with_data_parallel_size(monkeypatch) -> None:
    at2 = _bucket_launches(monkeypatch, 2, 4096)
    at8 = _bucket_launches(monkeypatch, 8, 4096)
    assert at8 == at2
    triton_launches, torch_kernels = at8
    assert triton_launches == ["_encode_kernel", "_decode_kernel", "_encode_kernel", "_decode_kernel"]
    assert torch_kernels == []  # flags, NaN fill and padding happen inside those kernels

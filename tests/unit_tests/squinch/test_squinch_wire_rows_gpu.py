"""The collectives' wire rows on CUDA (compiled Triton kernels): one launch per bucket and phase gives the
bytes, residuals and sums of the torch reference, row by row; a non-finite value flags every row and
NaN-fills every decode; the next clean call is clean (the flag scratch was reset)."""
from __future__ import annotations

import pytest
import torch

from megatron_cai.core.distributed import squinch_collectives as sc
from megatron_cai.core.squinch import payload_nbytes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows,chunk", [(8, 1 << 20), (64, 4104), (3, 8)])
def test_wire_rows_equal_the_reference(rows, chunk):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows * chunk, generator=g) * torch.logspace(-5, 1, rows * chunk)
    r0 = torch.randn(rows * chunk, generator=g) * 1e-3
    r_gpu, r_cpu = r0.cuda(), r0.clone()
    wire = sc.encode_rows(x.cuda(), rows, r_gpu, backend="triton")
    ref = sc.encode_rows(x, rows, r_cpu, backend="torch")
    assert torch.equal(wire.cpu(), ref) and torch.equal(r_gpu.cpu().view(torch.int32), r_cpu.view(torch.int32))
    shard_gpu, shard_cpu = torch.empty(chunk, device="cuda"), torch.empty(chunk)
    sc.decode_sum_into(wire, shard_gpu, backend="triton")
    sc.decode_sum_into(ref, shard_cpu, backend="torch")
    assert torch.equal(shard_gpu.cpu().view(torch.int32), shard_cpu.view(torch.int32))
    full_gpu, full_cpu = torch.empty(rows * chunk, device="cuda"), torch.empty(rows * chunk)
    sc.decode_rows_into(wire, full_gpu, backend="triton")
    sc.decode_rows_into(ref, full_cpu, backend="torch")
    assert torch.equal(full_gpu.cpu().view(torch.int32), full_cpu.view(torch.int32))


def test_nonfinite_flags_every_row_and_the_scratch_resets():
    rows, chunk = 16, 65536
    x = torch.randn(rows * chunk, device="cuda")
    x[5 * chunk + 7] = float("inf")
    wire = sc.encode_rows(x, rows, None, backend="triton")
    p = payload_nbytes(chunk)  # the flag byte follows the payload
    assert wire[:, p].eq(1).all() and wire[:, p + 1:].eq(0).all()
    shard = torch.empty(chunk, device="cuda")
    sc.decode_sum_into(wire, shard, backend="triton")
    assert shard.isnan().all()
    clean = sc.encode_rows(torch.nan_to_num(x, posinf=0.0), rows, None, backend="triton")
    assert clean[:, p].eq(0).all()
    sc.decode_sum_into(clean, shard, backend="triton")
    assert not shard.isnan().any()

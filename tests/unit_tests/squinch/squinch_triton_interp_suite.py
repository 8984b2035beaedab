"""Squinch Triton kernels under TRITON_INTERPRET=1 vs the spec oracle and the torch reference.

Not collected by the main test run (no test_ prefix): test_squinch_triton.py runs this file in a
subprocess with TRITON_INTERPRET=1 set before triton is imported (triton 3.9 decides interpretation
when its own library functions are decorated, so the variable cannot be set later in-process).
"""
from __future__ import annotations

import os

import pytest
import torch
from testlib import squinch_oracle as oracle

from megatron_cai.core import squinch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by test_squinch_triton.py with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

CASES = oracle.edge_cases(seed=1)


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_encode_decode_byte_exact(name):
    x = CASES[name]
    vals = oracle.values(x)
    want = oracle.encode(vals)
    payload = squinch.encode(x, backend="triton")
    assert bytes(payload.tolist()) == want
    assert torch.equal(payload, squinch.encode(x, backend="torch"))
    dec = squinch.decode(payload, x.numel(), backend="triton")
    assert oracle.same_bits(dec, oracle.as_tensor(oracle.decode(want, x.numel())))
    assert oracle.same_bits(dec, squinch.decode(payload, x.numel(), backend="torch"))


def test_triton_decode_out_accumulate():
    x = torch.randn(3, 7)
    payload = squinch.encode(x, backend="torch")
    base = torch.randn(3, 7)
    o1, o2 = base.clone(), base.clone()
    squinch.decode(payload, 21, out=o1, accumulate=True, backend="triton")
    squinch.decode(payload, 21, out=o2, accumulate=True, backend="torch")
    assert oracle.same_bits(o1, o2)


@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_feedback_matches_reference(res_dtype, grad_dtype):
    g = torch.Generator().manual_seed(4)
    buf = (torch.randn(4000, generator=g) * 1e-2).to(grad_dtype)
    grad = buf[517:517 + 2001]
    r0 = (torch.randn(2001, generator=g) * 1e-3).to(res_dtype)
    r1, r2 = r0.clone(), r0.clone()
    want_p, want_r, _ = oracle.encode_with_feedback(oracle.values(grad), oracle.values(r0),
                                                    bf16_residual=res_dtype == torch.bfloat16)
    p1, nf1 = squinch.encode_with_feedback(grad, r1, backend="triton")
    p2, nf2 = squinch.encode_with_feedback(grad, r2, backend="torch")
    assert bytes(p1.tolist()) == want_p and torch.equal(p1, p2)
    assert oracle.same_bits(r1, oracle.as_tensor(want_r)) and oracle.same_bits(r1, r2)
    assert not bool(nf1) and not bool(nf2)


@pytest.mark.parametrize("name", sorted(oracle.nonfinite_cases()))
def test_triton_reports_nonfinite(name):
    x = oracle.nonfinite_cases()[name]
    r1, r2 = torch.zeros_like(x), torch.zeros_like(x)
    p1, nf1 = squinch.encode_with_feedback(x, r1, backend="triton")
    p2, nf2 = squinch.encode_with_feedback(x, r2, backend="torch")
    assert bool(nf1) and bool(nf2)
    assert torch.equal(p1, p2) and oracle.same_bits(r1, r2)
    _, nf_clean = squinch.encode_with_feedback(torch.nan_to_num(x), None, backend="triton")
    assert not bool(nf_clean)


@pytest.mark.parametrize("n", [5, 1000, 2053])
def test_triton_decode_accumulate(n):
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(n, generator=g) * 10.0**w for w in range(-2, 3)]
    P = torch.stack([squinch.encode(x, backend="torch") for x in xs])
    out = torch.randn(n, generator=g)
    out[::3] = -0.0
    o1, o2 = out.clone(), out.clone()
    squinch.decode_accumulate(P, o1, backend="triton")
    squinch.decode_accumulate(P, o2, backend="torch")
    want = oracle.decode_accumulate([bytes(p.tolist()) for p in P], n, oracle.values(out))
    assert oracle.same_bits(o1, o2) and oracle.same_bits(o1, oracle.as_tensor(want))


def test_triton_stochastic_unbiased_and_reproducible():
    x = oracle.stochastic_input(seed=3)
    gen = torch.Generator().manual_seed(5)
    r = oracle.monte_carlo(
        lambda v: squinch.encode(v, stochastic=True, generator=gen, backend="triton"),
        lambda p, n: squinch.decode(p, n, backend="triton"),
        x,
        trials=400,
    )
    assert r["bracketed"] and r["qmax_same"] and r["n_spread"] >= 50
    assert r["z"].abs().max() < 5.0 and 0.5 < (r["z"] ** 2).mean() < 1.6
    y = torch.randn(999)
    p1 = squinch.encode(y, stochastic=True, generator=torch.Generator().manual_seed(1), backend="triton")
    p2 = squinch.encode(y, stochastic=True, generator=torch.Generator().manual_seed(1), backend="triton")
    assert torch.equal(p1, p2)




def test_triton_empty():
    p, nf = squinch.encode_with_feedback(torch.zeros(0), torch.zeros(0), backend="triton")
    assert p.numel() == 0 and not bool(nf)
    assert squinch.decode(p, 0, backend="triton").numel() == 0


# ---- the collectives' wire rows: one launch for every row -----------------------------------------------
def _wire(rows: int, chunk: int) -> torch.Tensor:
    from megatron_cai.core.distributed.squinch_collectives import row_nbytes

    return torch.full((rows, row_nbytes(chunk)), 0xAB, dtype=torch.uint8)  # garbage the encoder must overwrite


@pytest.mark.parametrize("rows,chunk", [(3, 2056), (2, 8), (5, 1024)])  # full programs + a masked tail; tiny
def test_triton_encode_rows_equals_row_by_row_reference(rows, chunk):
    from megatron_cai.core.distributed.squinch_collectives import encode_rows

    g = torch.Generator().manual_seed(rows * chunk)
    x = torch.randn(rows * chunk, generator=g) * torch.logspace(-4, 2, rows * chunk)
    r0 = torch.randn(rows * chunk, generator=g) * 1e-3
    r_tri, r_ref = r0.clone(), r0.clone()
    tri = encode_rows(x, rows, r_tri, out=_wire(rows, chunk), backend="triton")
    ref = encode_rows(x, rows, r_ref, out=_wire(rows, chunk), backend="torch")
    assert torch.equal(tri, ref) and oracle.same_bits(r_tri, r_ref)
    p = squinch.payload_nbytes(chunk)
    for r in range(rows):  # payload first (16-byte aligned row), then flag 0, then zero padding
        assert bytes(tri[r, :p].tolist()) == oracle.encode(oracle.values(x[r * chunk:(r + 1) * chunk]
                                                                          + r0[r * chunk:(r + 1) * chunk]))
    assert tri[:, p:].eq(0).all() and tri.shape[1] % 16 == 0


def test_triton_row_flags_and_scratch_reset():
    """A NaN in one row flags every row (and the next, finite, call is clean: the scratch was reset)."""
    from megatron_cai.core.distributed.squinch_collectives import decode_rows_into, decode_sum_into, encode_rows

    rows, chunk = 4, 1032
    x = torch.randn(rows * chunk)
    x[2 * chunk + 1030] = float("nan")
    send = encode_rows(x, rows, None, backend="triton")
    p = squinch.payload_nbytes(chunk)
    assert send[:, p].tolist() == [1] * rows and send[:, p + 1:].eq(0).all()
    out = torch.zeros(chunk)
    decode_sum_into(send, out, backend="triton")
    assert out.isnan().all()
    full = torch.zeros(rows * chunk)
    decode_rows_into(send, full, backend="triton")
    assert full.isnan().all()
    clean = encode_rows(torch.nan_to_num(x), rows, None, backend="triton")
    assert clean[:, p].tolist() == [0] * rows
    decode_sum_into(clean, out, backend="triton")
    want = torch.zeros(chunk)
    decode_sum_into(clean, want, backend="torch")
    assert oracle.same_bits(out, want) and not out.isnan().any()
    decode_rows_into(clean, full, backend="triton")
    ref_full = torch.zeros(rows * chunk)
    decode_rows_into(clean, ref_full, backend="torch")
    assert oracle.same_bits(full, ref_full)

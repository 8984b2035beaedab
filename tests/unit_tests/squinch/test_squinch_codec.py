"""Squinch v1 codec vs a plain per-block Python implementation of the spec (torch + CPU backends)."""
from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from testlib import squinch_oracle as oracle

from megatron_cai.core import squinch
from megatron_cai.core.squinch import cpu_kernels
from megatron_cai.core.squinch import format as fmt

BACKENDS = ["torch", "cpu"]
CASES = oracle.edge_cases()


@cache
def _expected(name: str) -> tuple[bytes, list[float]]:
    vals = oracle.values(CASES[name])
    payload = oracle.encode(vals)
    return payload, oracle.decode(payload, len(vals))


def test_tables_match_spec():
    assert fmt.S == tuple(oracle.S) and fmt.L == tuple(oracle.L) and fmt.B[1:] == tuple(oracle.B[1:])
    assert fmt.S[128] == 1.0 and fmt.L[15] == 1.0 and fmt.L[0] == 0.0
    assert all(a < b for a, b in zip(fmt.S, fmt.S[1:]))


def test_qmax_bucket_table_equals_definition():
    """q_max via the bucket table == smallest q with S[q] > m, for every grid point and neighbour."""
    probes = [0, 1, 0x7FFFFF, 0x7F7FFFFF, 0x7F800000, 0x7FC00000]
    for sb in fmt.S_BITS:
        probes += [sb - 1, sb, sb + 1]
    probes += list(range(0, 0x7F800000, 0x7F800000 // 5000))
    for mb in probes:
        m = oracle.from_bits32(mb)
        want = 255 if not math.isfinite(m) else next((q for q in range(256) if oracle.S[q] > m), 255)
        q = fmt.QMAX_BUCKET[mb >> fmt.QMAX_SHIFT]
        q = min(255, q + (fmt.S_BITS_EXT[q] <= mb))
        assert q == want, hex(mb)


def test_edge_cases_are_meaningful():
    # the threshold case really hits B[k] (and its neighbours) for most k, on several scales
    assert CASES["b_thresholds"].numel() >= 200 * 8
    assert torch.isinf(torch.tensor([oracle.FLT_MAX]) * 2).all()
    assert (CASES["subnormals"].abs() < 1.1754944e-38).sum() > 90
    assert CASES["noncontig_2d"].is_contiguous() is False and CASES["noncontig_t"].is_contiguous() is False


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_encode_decode_byte_exact(name, backend):
    x = CASES[name]
    want_payload, want_dec = _expected(name)
    payload = squinch.encode(x, backend=backend)
    assert payload.dtype == torch.uint8 and payload.numel() == 6 * math.ceil(x.numel() / 8)
    assert bytes(payload.tolist()) == want_payload
    dec = squinch.decode(payload, x.numel(), backend=backend)
    assert dec.dtype == torch.float32 and dec.shape == (x.numel(),)
    assert oracle.same_bits(dec, oracle.as_tensor(want_dec))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_into_out_and_accumulate(backend):
    x = CASES["laplace_student"][:21]
    payload = squinch.encode(x, backend=backend)
    dec = oracle.as_tensor(oracle.decode(oracle.encode(oracle.values(x)), 21))
    out = torch.full((3, 7), 2.5)
    assert squinch.decode(payload, 21, out=out, backend=backend) is out
    assert oracle.same_bits(out, dec)
    base = torch.randn(3, 7)
    out = base.clone()
    squinch.decode(payload, 21, out=out, accumulate=True, backend=backend)
    want = [oracle.f32(a + b) for a, b in zip(oracle.values(base), dec.tolist())]
    assert oracle.same_bits(out, oracle.as_tensor(want))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_encode_with_feedback_matches_spec(backend, res_dtype, grad_dtype):
    g = torch.Generator().manual_seed(3)
    buf = (torch.randn(5000, generator=g) * 1e-3).to(grad_dtype)
    buf_before = buf.clone()
    grad = buf[1234:1234 + 2003]  # a 1-D slice of a larger flat buffer, as the gradient buckets pass it
    residual = (torch.randn(2003, generator=g) * 1e-4).to(res_dtype)
    want_p, want_r, want_nf = oracle.encode_with_feedback(
        oracle.values(grad), oracle.values(residual), bf16_residual=res_dtype == torch.bfloat16
    )
    payload, nonfinite = squinch.encode_with_feedback(grad, residual, backend=backend)
    assert bytes(payload.tolist()) == want_p
    assert isinstance(nonfinite, torch.Tensor) and nonfinite.dtype == torch.bool and not bool(nonfinite)
    assert not want_nf
    assert residual.dtype == res_dtype and oracle.same_bits(residual, oracle.as_tensor(want_r))
    assert torch.equal(buf, buf_before)  # grad and its neighbours untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_feedback_residual_carries_the_error(backend):
    """Error feedback over steps: sum of decoded payloads + final residual == sum of gradients."""
    g = torch.Generator().manual_seed(5)
    residual = torch.zeros(999)
    total_in, total_out = torch.zeros(999, dtype=torch.float64), torch.zeros(999, dtype=torch.float64)
    for _ in range(4):
        grad = torch.randn(999, generator=g)
        payload, _ = squinch.encode_with_feedback(grad, residual, backend=backend)
        total_in += grad.double()
        total_out += squinch.decode(payload, 999, backend=backend).double()
    assert torch.allclose(total_out + residual.double(), total_in, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(oracle.nonfinite_cases()))
def test_nonfinite_is_reported_never_hidden(backend, name):
    x = oracle.nonfinite_cases()[name]
    residual = torch.zeros_like(x)
    want_p, want_r, want_nf = oracle.encode_with_feedback(oracle.values(x), oracle.values(residual))
    payload, nonfinite = squinch.encode_with_feedback(x, residual, backend=backend)
    assert want_nf and bool(nonfinite)
    assert bytes(payload.tolist()) == want_p  # the documented convention: q_max = 255 for such blocks
    assert oracle.same_bits(residual, oracle.as_tensor(want_r))
    assert not torch.isfinite(residual[~torch.isfinite(x)]).any()  # residual keeps the NaN/Inf
    _, nf_plain = squinch.encode_with_feedback(x, None, backend=backend)
    assert bool(nf_plain)
    _, nf_clean = squinch.encode_with_feedback(torch.nan_to_num(x), None, backend=backend)
    assert not bool(nf_clean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_in_grad_plus_residual_is_flagged(backend):
    grad = torch.tensor([3e38, 1.0, -2.0])
    residual = torch.tensor([3e38, 0.0, 0.0])
    payload, nonfinite = squinch.encode_with_feedback(grad, residual, backend=backend)
    assert bool(nonfinite) and math.isinf(residual[0].item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 8, 13, 1001])
def test_decode_accumulate_order(backend, n):
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(n, generator=g) * 10.0 ** (3 * w - 3) for w in range(4)]
    xs[1][: n // 2] = -0.0
    payloads = torch.stack([torch.tensor(list(oracle.encode(oracle.values(x))), dtype=torch.uint8)
                            for x in xs])
    out = torch.randn(n, generator=g)
    out[0] = -0.0
    want = oracle.decode_accumulate([bytes(p.tolist()) for p in payloads], n, oracle.values(out))
    got = squinch.decode_accumulate(payloads, out, backend=backend)
    assert got is out and oracle.same_bits(out, oracle.as_tensor(want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_payload_out_argument_and_errors(backend):
    x = torch.randn(20)
    buf = torch.zeros(2, 18, dtype=torch.uint8)
    squinch.encode(x, backend=backend, out=buf[1])
    assert bytes(buf[1].tolist()) == oracle.encode(oracle.values(x)) and not buf[0].any()
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        squinch.encode(torch.arange(8), backend=backend)
    with pytest.raises(ValueError, match="bytes"):
        squinch.decode(torch.zeros(7, dtype=torch.uint8), 8, backend=backend)
    with pytest.raises(ValueError, match="residual"):
        squinch.encode_with_feedback(x, torch.zeros(19), backend=backend)
    with pytest.raises(ValueError, match="backend"):
        squinch.encode(x, backend="cuda")


def test_empty_tensor():
    for backend in BACKENDS:
        p = squinch.encode(torch.zeros(0), backend=backend)
        assert p.numel() == 0 and squinch.decode(p, 0, backend=backend).numel() == 0


def test_default_backend_on_cpu_is_the_c_kernel():
    want = "cpu" if cpu_kernels.available() else "torch"
    assert squinch.resolve_backend(None, torch.device("cpu")) == want


def test_cpu_fast_path_is_byte_identical_on_large_tensors():
    """Multi-threaded chunking of the C kernel (large n) gives the reference bytes and values."""
    if not cpu_kernels.available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(600_003, generator=g) * torch.exp(torch.randn(600_003, generator=g) * 4)
    r1 = torch.randn(600_003, generator=g) * 1e-2
    r2 = r1.clone()
    p1, _ = squinch.encode_with_feedback(x, r1, backend="torch")
    p2, _ = squinch.encode_with_feedback(x, r2, backend="cpu")
    assert torch.equal(p1, p2) and oracle.same_bits(r1, r2)
    P = torch.stack([p1, p2, squinch.encode(x.flip(0), backend="torch")])
    o1, o2 = torch.ones(600_003), torch.ones(600_003)
    squinch.decode_accumulate(P, o1, backend="torch")
    squinch.decode_accumulate(P, o2, backend="cpu")
    assert oracle.same_bits(o1, o2)


def test_cpu_fallback_without_compiler(monkeypatch, tmp_path, caplog):
    """No compiler -> one warning, and every call still works through the torch path."""
    saved = dict(cpu_kernels._state)
    cpu_kernels._state.clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
            assert cpu_kernels.load() is None
            x = CASES["laplace_student"]
            assert squinch.resolve_backend(None, x.device) == "torch"
            assert bytes(squinch.encode(x).tolist()) == _expected("laplace_student")[0]
            assert bytes(squinch.encode(x, backend="cpu").tolist()) == _expected("laplace_student")[0]
        warnings = [r for r in caplog.records if "CPU fast path unavailable" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        cpu_kernels._state.clear()
        cpu_kernels._state.update(saved)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("res_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_generic_and_native_paths_agree(grad_dtype, res_dtype, stochastic):
    """The portable C path and the AVX-512 path (where built) give the same bytes, residuals, decodes."""
    if cpu_kernels.load("generic") is None or cpu_kernels.load("native") is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(21)
    n = 4147  # 32 groups of 16 blocks, 3 block pairs, 1 full block, a 3-element tail
    spread = 1.5 if grad_dtype == torch.float16 else 5.0
    x = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread)).to(grad_dtype)
    x[17], x[300] = -0.0, 0.0
    r0 = None if res_dtype is None else (torch.randn(n, generator=g) * 0.1).to(res_dtype)
    outs = {}
    for variant in ("generic", "native"):
        r = None if r0 is None else r0.clone()
        p = torch.empty(squinch.payload_nbytes(n), dtype=torch.uint8)
        nf = cpu_kernels.encode_into(x, r, p, stochastic, 12345, variant=variant)
        d = torch.full((n,), 0.5)
        cpu_kernels.decode_into(torch.stack([p, p.roll(12)]), n, d, True, variant=variant)
        outs[variant] = (p, r, d, nf)
    (p1, r1, d1, nf1), (p2, r2, d2, nf2) = outs["generic"], outs["native"]
    assert torch.equal(p1, p2) and oracle.same_bits(d1, d2)
    assert nf1 is False and nf2 is False
    if r0 is not None:
        assert oracle.same_bits(r1, r2)
    if not stochastic:
        y = oracle.values(x) if r0 is None else [oracle.f32(a + b) for a, b in zip(oracle.values(x),
                                                                                   oracle.values(r0))]
        assert bytes(p2.tolist()) == oracle.encode(y)

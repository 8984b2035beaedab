"""Squinch Triton kernels: CPU interpreter suite (in a subprocess) and compiled kernels on a GPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from testlib import ROOT
from testlib import squinch_oracle as oracle

from megatron_cai.core import squinch

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = oracle.edge_cases(seed=1)


def test_triton_kernels_under_interpreter():
    """Every Triton kernel, byte/bit-identical to the spec oracle and the torch reference (interpreted)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    suite = os.path.join(HERE, "squinch_triton_interp_suite.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", suite]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]


# ---- compiled kernels on a GPU ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_triton_matches_reference(name):
    x = CASES[name]
    payload = squinch.encode(x.cuda())
    assert torch.equal(payload.cpu(), squinch.encode(x, backend="torch"))
    dec = squinch.decode(payload, x.numel())
    assert oracle.same_bits(dec.cpu(), squinch.decode(payload.cpu(), x.numel(), backend="torch"))


@pytest.mark.gpu
@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_fused_ops_match_reference(res_dtype):
    g = torch.Generator().manual_seed(0)
    n = 3_000_017
    grad = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    r_cpu = (torch.randn(n, generator=g) * 0.01).to(res_dtype)
    r_gpu = r_cpu.cuda()
    p_cpu, nf_cpu = squinch.encode_with_feedback(grad, r_cpu, backend="torch")
    p_gpu, nf_gpu = squinch.encode_with_feedback(grad.cuda(), r_gpu)
    assert torch.equal(p_gpu.cpu(), p_cpu) and oracle.same_bits(r_gpu.cpu(), r_cpu)
    assert bool(nf_gpu) == bool(nf_cpu) is False
    P = torch.stack([p_cpu, squinch.encode(grad.flip(0), backend="torch"), p_cpu.roll(6)])
    o_cpu = torch.randn(n, generator=g)
    o_gpu = o_cpu.cuda()
    squinch.decode_accumulate(P, o_cpu, backend="torch")
    squinch.decode_accumulate(P.cuda(), o_gpu)
    assert oracle.same_bits(o_gpu.cpu(), o_cpu)
    x = grad.clone()
    x[12345] = float("nan")
    _, nf = squinch.encode_with_feedback(x.cuda(), None)
    assert bool(nf)

"""Triton attention past the int32 and grid limits, under the interpreter (TRITON_INTERPRET=1).

B·H = 65,600 (batch, head) pairs exceed CUDA's 65,535 limit on grid axis 1, and B·H·T·D = 2,149,580,800
elements exceed 2^31, so int32 offsets of the last heads wrap. The tensors are allocated but never
touched outside the one (batch, head) pair that is checked (untouched pages cost no memory), and only the
programs of that pair run: the interpreter's kernel functions are wrapped so every other program returns
at once. The checked pair is the last one, whose offsets lie past 2^31 and whose grid index lies past
65,535; its output, lse and gradients are compared with an fp64 reference computed on that pair alone,
and every launch's grid is checked against the CUDA limits.

Runs as a subprocess (this file as a script): the interpreter must be on before triton is imported.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
from testlib.interpreted import run_interpreted

B, H, T, D = 2, 32_800, 256, 128
KERNELS = ("_fwd_kernel", "_bwd_delta_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel")


def test_last_head_past_int32_offsets_and_grid_axis_limit() -> None:
    pytest.importorskip("triton")
    res = run_interpreted(__file__, timeout=900)
    assert B * H > 65_535 and B * H * T * D > 2**31
    assert sorted({name for name, _ in res["grids"]}) == sorted(KERNELS)
    for name, grid in res["grids"]:  # every axis past the first within CUDA's limit, pairs folded
        assert all(g <= 65_535 for g in grid[1:]), (name, grid)
        assert grid[1] * grid[2] >= B * H > grid[1], (name, grid)
    assert res["ran"] == {k: T // 16 for k in KERNELS}  # only the checked pair's programs ran
    for name, err in res["errors"].items():
        assert err < 2e-4, (name, err)


@pytest.mark.gpu
def test_gpu_launch_past_int32_offsets_and_grid_axis_limit() -> None:
    """The same shapes compiled and launched on CUDA (34 GB of bf16 tensors): CUDA accepts the folded grid
    and the last pair's output and gradients match the reference."""
    import torch

    from megatron_cai.core.transformer.triton_attention import triton_attention

    b, h = divmod(B * H - 1, H)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    j = torch.arange(T, device="cuda")
    start, limit = j.expand(B, T), torch.where(j < 100, 100, T).expand(B, T)
    out, _ = triton_attention(q, k, v, start, limit)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_outputs=do)
    qr, kr, vr = (t[b, h].detach().double().requires_grad_() for t in (q, k, v))
    visible = (start[b][None, :] <= j[:, None]) & (j[:, None] < limit[b][None, :])
    ref = torch.softmax((qr @ kr.T / D**0.5).masked_fill(~visible, float("-inf")), -1) @ vr
    ref.backward(do[b, h].double())
    for got, want in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got[b, h].double(), want.detach(), atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------------------------------------
# Worker side (TRITON_INTERPRET=1, fresh interpreter).
def _selective(fn, keep, ran):
    """``fn`` (an interpreted kernel) with the same signature, running only the programs `keep` accepts."""
    import inspect

    params = list(inspect.signature(fn).parameters)
    src = (f"def {fn.__name__}({', '.join(params)}):\n    if not _keep():\n        return\n"
           f"    _ran()\n    return _orig({', '.join(f'{p}={p}' for p in params)})\n")
    scope = dict(fn.__globals__, _keep=keep, _orig=fn, _ran=lambda: ran.__setitem__(fn.__name__,
                                                                                         ran.get(fn.__name__, 0) + 1))
    exec(src, scope)
    wrapper = scope[fn.__name__]
    wrapper.__annotations__ = dict(fn.__annotations__)
    return wrapper


def _worker() -> dict:
    import math

    import torch
    from triton.runtime import interpreter

    from megatron_cai.core.transformer.triton_attention import triton_attention

    target = B * H - 1  # the last (batch, head) pair: offsets past 2^31, grid index past 65,535
    b, h = divmod(target, H)
    builder = interpreter.interpreter_builder

    def keep() -> bool:
        _, y, z = builder.grid_idx
        return z * builder.grid_dim[1] + y == target

    grids, ran = [], {}
    original_rewrite, original_run = interpreter.InterpretedFunction.rewrite, interpreter.InterpretedFunction.run

    def rewrite(self):
        fn = original_rewrite(self)
        return _selective(fn, keep, ran) if self.fn.__name__ in KERNELS else fn

    def run(self, *args, grid, warmup, **kwargs):
        grids.append((self.fn.__name__, list(grid) + [1] * (3 - len(grid))))
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.rewrite = rewrite
    interpreter.InterpretedFunction.run = run

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.empty(B, H, T, D) for _ in range(4))  # 4.3 GB each, never touched elsewhere
    for t in (q, k, v, do):
        t[b, h] = torch.randn(T, D, generator=g)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    j = torch.arange(T)
    start = j.expand(B, T)
    limit = torch.where(j < 100, 100, T).expand(B, T)  # two packed documents
    out, lse = triton_attention(q, k, v, start, limit)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_outputs=do)

    qr, kr, vr = (t[b, h].detach().double().requires_grad_() for t in (q, k, v))
    s = qr @ kr.T / math.sqrt(D)
    visible = (start[b][None, :] <= j[:, None]) & (j[:, None] < limit[b][None, :])
    s = s.masked_fill(~visible, float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref_out = torch.softmax(s, -1) @ vr
    ref_out.backward(do[b, h].double())
    got = {"out": out[b, h], "lse": lse[b, h], "dq": dq[b, h], "dk": dk[b, h], "dv": dv[b, h]}
    want = {"out": ref_out, "lse": ref_lse, "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    errors = {name: (got[name].double() - want[name].detach()).abs().max().item() for name in got}
    return {"grids": grids, "ran": ran, "errors": errors}


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    print("RESULT " + json.dumps(_worker()), flush=True)

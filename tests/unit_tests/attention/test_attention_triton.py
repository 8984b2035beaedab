"""Triton attention kernels under the interpreter (TRITON_INTERPRET=1), against fp64 references.

The interpreter must be switched on before the kernels are decorated, and the env var would leak
into every other module of the pytest process, so the checks run in one subprocess (this file run
as a script) that reports per-check results as JSON. Sizes stay small (seq <= 64, head_dim 16).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

CHECKS = ["tree_branches", "packed_docs", "gqa_mqa", "window", "zreg", "zero_coeff", "masked_rows",
          "odd_head_dim", "decode", "strided_inputs_opcheck"]


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, f"worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("check", CHECKS)
def test_triton_interpreted(results, check):
    assert results.get(check) == "ok", results.get(check, "check did not run")


# ----------------------------------------------------------------------------------------------
# Worker side (runs with TRITON_INTERPRET=1 in a fresh interpreter).


def _worker() -> dict[str, str]:
    import random
    import warnings

    import torch
    from testlib.attention import explicit_loss, interval_mask, random_forest, ref_attention, rope

    from megatron_cai.core.transformer import visibility as V
    from megatron_cai.core.transformer.attention import attend

    warnings.filterwarnings("ignore")
    tol = 2e-5

    def close(a, b, atol=tol):
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=0)

    def forest_rows(seed, n_rows, seq, n_trees=2, **kw):
        rng = random.Random(seed)
        rows, info = [], []
        for _ in range(n_rows):
            trees = [random_forest(rng, **kw) for _ in range(n_trees)]
            lay = V.concat_layouts([V.from_tree(*t) for t in trees])
            rows.append((lay.start, lay.limit, lay.position_ids))
            info.append((lay, [f for t in trees for f in t[2]]))
        return info, V.batch(rows, seq)

    def tree_branches():
        torch.manual_seed(0)
        seq = 48
        info, (s, lim, pos) = forest_rows(3, 2, seq, max_nodes=5, max_len=4, p_bidir=0.3)
        q_raw, k_raw, v = torch.randn(2, 4, seq, 16), torch.randn(2, 2, seq, 16), torch.randn(2, 2, seq, 16)
        q, k = rope(q_raw, pos[:, None]), rope(k_raw, pos[:, None])
        out = attend(q, k, v, s, lim, backend="triton")
        for b, (lay, bidir) in enumerate(info):
            for leaf in lay.leaves.tolist():
                idx = lay.branch_tokens(leaf)
                nodes = lay.node_of_token[idx].tolist()
                n = len(nodes)
                mask = torch.tensor([[j <= i or (nodes[i] == nodes[j] and bidir[nodes[i]]) for j in range(n)]
                                     for i in range(n)])
                ar = torch.arange(n)
                ref, _ = ref_attention(rope(q_raw[b:b + 1, :, idx], ar), rope(k_raw[b:b + 1, :, idx], ar),
                                       v[b:b + 1, :, idx], mask)
                close(out[b:b + 1, :, idx], ref)

    def packed_docs():
        torch.manual_seed(1)
        lens = [13, 20, 9]
        s, lim = V.batch([V.from_document_lengths(lens, [False, True, False])], 50)
        q, k, v = torch.randn(1, 2, 50, 16), torch.randn(1, 1, 50, 16), torch.randn(1, 1, 50, 16)
        out = attend(q, k, v, s, lim, backend="triton")
        a = 0
        for n, bd in zip(lens, [False, True, False]):
            sl = slice(a, a + n)
            m = torch.ones(n, n, dtype=torch.bool)
            ref, _ = ref_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], m if bd else m.tril())
            close(out[:, :, sl], ref)
            a += n
        close(out[0, :, a:], v[0, 0, a:].expand(2, -1, -1))  # padding sees itself only

    def gqa_mqa():
        torch.manual_seed(2)
        info, (s, lim, pos) = forest_rows(4, 1, 40, max_nodes=5, max_len=5, p_bidir=0.3)
        for kv_heads in (1, 2):
            q = torch.randn(1, 4, 40, 16, requires_grad=True)
            k, v = (torch.randn(1, kv_heads, 40, 16, requires_grad=True) for _ in range(2))
            dout = torch.randn(1, 4, 40, 16)
            out = attend(q, k, v, s, lim, backend="triton")
            got = torch.autograd.grad((out * dout).sum(), [q, k, v])
            ref = attend(q, k, v, s, lim, backend="eager")
            exp = torch.autograd.grad((ref * dout).sum(), [q, k, v])
            close(out, ref)
            for a, b in zip(got, exp):
                close(a, b, 1e-4)

    def window():
        torch.manual_seed(3)
        info, (s, lim, pos) = forest_rows(5, 2, 56, max_nodes=6, max_len=5, p_bidir=0.3)
        q = torch.randn(2, 2, 56, 16, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(2, 2, 56, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
        dout = torch.randn(2, 2, 56, 16, dtype=torch.float64)
        mask = interval_mask(s, lim, 4, pos)
        out, lse = attend(q, k, v, s, lim, window=4, position_ids=pos, backend="triton", return_lse=True)
        ref, ref_lse = ref_attention(q, k, v, mask)
        close(out, ref)
        close(lse, ref_lse)
        got = torch.autograd.grad((out * dout).sum(), [q, k, v])
        exp = torch.autograd.grad((ref * dout).sum(), [q, k, v])
        for a, b in zip(got, exp):
            close(a, b, 1e-4)

    def zreg_case(broken=None):
        torch.manual_seed(4)
        info, (s, lim, pos) = forest_rows(6, 2, 64, n_trees=3, max_nodes=6, max_len=5, p_bidir=0.3)
        if broken is not None:
            b, j = broken
            s[b] = torch.where((s[b] <= j) & (j < lim[b]), torch.full_like(s[b], j + 1), s[b])
        qkv = [torch.randn(2, h, 64, 16, dtype=torch.float64) * 2 for h in (4, 2, 2)]
        return s, lim, qkv, torch.randn(2, 4, 64, 16, dtype=torch.float64)

    def zreg(broken=None):
        s, lim, qkv, dout = zreg_case(broken)
        q, k, v = (x.clone().requires_grad_() for x in qkv)
        out, lse = attend(q, k, v, s, lim, zreg_coeff=0.3, backend="triton", return_lse=True)
        got = torch.autograd.grad((out * dout).sum(), [q, k, v])
        q2, k2, v2 = (x.clone().requires_grad_() for x in qkv)
        mask = interval_mask(s, lim)
        exp = torch.autograd.grad(explicit_loss(q2, k2, v2, mask, dout, 0.3), [q2, k2, v2])
        for a, b in zip(got, exp):
            assert torch.isfinite(a).all()
            close(a, b, 2e-4)
        return out, lse, mask

    def zero_coeff():
        s, lim, qkv, dout = zreg_case()
        q, k, v = (x.float().requires_grad_() for x in qkv)
        o0 = attend(q, k, v, s, lim, backend="triton")
        g0 = torch.autograd.grad((o0 * dout.float()).sum(), [q, k, v])
        o1 = attend(q, k, v, s, lim, backend="triton", zreg_coeff=0.0)
        g1 = torch.autograd.grad((o1 * dout.float()).sum(), [q, k, v])
        o2 = attend(q, k, v, s, lim, backend="triton", zreg_coeff=0.5)
        assert torch.equal(o0, o1) and torch.equal(o0, o2)
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))

    def masked_rows():
        out, lse, mask = zreg(broken=(1, 21))
        dead = ~mask.any(-1)
        assert dead[1, 21]
        assert torch.isfinite(out).all()
        assert torch.all(out.permute(0, 2, 1, 3)[dead] == 0)
        assert torch.all(lse.permute(0, 2, 1)[dead] == float("-inf"))

    def odd_head_dim():
        torch.manual_seed(5)
        s, lim = V.batch([V.from_document_lengths([20, 17], [True, False])], 37)
        q, k, v = (torch.randn(1, 2, 37, 24, requires_grad=True) for _ in range(3))
        out = attend(q, k, v, s, lim, backend="triton")
        ref = attend(q, k, v, s, lim, backend="eager")
        close(out, ref)
        for a, b in zip(torch.autograd.grad(out.sum(), [q, k, v]), torch.autograd.grad(ref.sum(), [q, k, v])):
            close(a, b, 1e-4)

    def decode():
        """q = the last seq_q positions (KV cache), limits past the end: the full call's last rows."""
        torch.manual_seed(6)
        info, (s, lim, pos) = forest_rows(7, 1, 50, max_nodes=5, max_len=5, p_bidir=0.3)
        lim = lim.long()
        lim = torch.where(lim == lim.amax(), torch.full_like(lim, torch.iinfo(torch.int64).max), lim)
        q = torch.randn(1, 2, 50, 16)
        k, v = torch.randn(1, 1, 50, 16, requires_grad=True), torch.randn(1, 1, 50, 16, requires_grad=True)
        for window in (None, 5):
            for seq_q in (1, 19):
                qp = q[:, :, -seq_q:].clone().requires_grad_()
                out = attend(qp, k, v, s, lim, window=window, position_ids=pos, backend="triton")
                ref = attend(qp, k, v, s, lim, window=window, position_ids=pos, backend="eager")
                close(out, ref)
                got = torch.autograd.grad(out.sum(), [qp, k, v])
                exp = torch.autograd.grad(ref.sum(), [qp, k, v])
                for a, b in zip(got, exp):
                    close(a, b, 1e-4)

    def strided_inputs_opcheck():
        """The custom ops with q, k, v as [b, h, t, d] views of [b, t, h, d] (as the layers pass them):
        torch.library.opcheck compares the fake outputs' strides with the real ones (the kernels work on
        contiguous copies: a fake that copied the views' strides failed --compile's backward)."""
        from megatron_cai.core.transformer.triton_attention import _OP

        gen = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, 12, 2, 16, generator=gen).transpose(1, 2) for _ in range(3))
        start = torch.tensor([[0] * 5 + [5] * 7])
        limit = torch.tensor([[5] * 5 + [12] * 7])
        args = (q, k, v, start, limit, None, None, 0.0, 0, 0)
        torch.library.opcheck(_OP.forward_op, args, test_utils=("test_schema", "test_faketensor"))
        out, lse = _OP.forward_op(*args)
        grads = (torch.randn(out.shape, generator=gen).transpose(2, 3).contiguous().transpose(2, 3),
                 torch.randn(lse.shape, generator=gen))
        torch.library.opcheck(_OP.backward_op, (*grads, q, k, v, out, lse, start, limit, None, None, 0.0, 0, 0),
                              test_utils=("test_schema", "test_faketensor"))

    fns = dict(tree_branches=tree_branches, packed_docs=packed_docs, gqa_mqa=gqa_mqa, window=window,
               zreg=zreg, zero_coeff=zero_coeff, masked_rows=masked_rows, odd_head_dim=odd_head_dim,
               decode=decode, strided_inputs_opcheck=strided_inputs_opcheck)
    out = {}
    for name in CHECKS:
        try:
            fns[name]()
            out[name] = "ok"
        except Exception:  # reported per check in the parent test
            out[name] = traceback.format_exc()[-2000:]
    return out


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path[:0] = [tests, os.path.dirname(tests)]  # testlib, megatron_cai
    print("RESULTS " + json.dumps(_worker()), flush=True)

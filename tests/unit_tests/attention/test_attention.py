"""attend(): every CPU backend against independent fp64 references (trees, packed docs, GQA, window).

The Triton kernels get the same checks under the interpreter in test_attention_triton.py; Z-Reg
gradients are checked in test_zreg.py.
"""
from __future__ import annotations

import random
import warnings

import pytest
import torch
from testlib.attention import interval_mask, random_forest, ref_attention, rope

from megatron_cai.core.transformer import visibility as V
from megatron_cai.core.transformer.attention import attend, default_backend, flex_block_mask

GRAD_BACKENDS = ["eager", "blocked"]
ALL_CPU_BACKENDS = ["eager", "blocked", "flex"]  # flex: forward only on CPU


def _run(backend, q, k, v, s, lim, **kw):
    if backend == "flex":
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return attend(q.float(), k.float(), v.float(), s, lim, backend="flex", **kw)
    return attend(q, k, v, s, lim, backend=backend, **kw)


def _tol(backend):
    return 2e-5 if backend == "flex" else 1e-10


def _forest_batch(rng, n_rows, trees_per_row, seq, **kw):
    """Rows of packed random forests; returns ([(layout, bidirectional flags by node)], (s, lim, pos))."""
    rows, layouts = [], []
    for _ in range(n_rows):
        trees = [random_forest(rng, **kw) for _ in range(trees_per_row)]
        lay = V.concat_layouts([V.from_tree(*t) for t in trees])
        assert lay.num_tokens <= seq
        rows.append((lay.start, lay.limit, lay.position_ids))
        layouts.append((lay, [f for t in trees for f in t[2]]))
    return layouts, V.batch(rows, seq)


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_tree_tokens_equal_their_branch_alone(backend, bidirectional):
    """Acceptance 2 at the attention level: packed tree outputs == each root-to-leaf branch alone."""
    rng = random.Random(5 + bidirectional)
    torch.manual_seed(0)
    heads, kv_heads, dim, seq = 4, 2, 16, 160
    p_bidir = 0.3 if bidirectional else 0.0
    layouts, (s, lim, pos) = _forest_batch(rng, 2, 4, seq, max_nodes=7, max_len=5, p_bidir=p_bidir)
    q_raw = torch.randn(2, heads, seq, dim, dtype=torch.float64)
    k_raw = torch.randn(2, kv_heads, seq, dim, dtype=torch.float64)
    v = torch.randn(2, kv_heads, seq, dim, dtype=torch.float64)
    q, k = rope(q_raw, pos[:, None]), rope(k_raw, pos[:, None])
    out = _run(backend, q, k, v, s, lim, position_ids=pos)
    checked = 0
    for b, (lay, bidir_of) in enumerate(layouts):
        for leaf in lay.leaves.tolist():
            idx = lay.branch_tokens(leaf)
            n = idx.numel()
            nodes = lay.node_of_token[idx].tolist()
            # The branch alone: an ordinary causal sequence at positions 0..n-1 (plus bidirectional spans).
            branch_mask = torch.tensor(
                [[j <= i or (nodes[i] == nodes[j] and bidir_of[nodes[i]]) for j in range(n)]
                 for i in range(n)]
            )
            ar = torch.arange(n)
            qb = rope(q_raw[b:b + 1, :, idx], ar)
            kb = rope(k_raw[b:b + 1, :, idx], ar)
            ref, _ = ref_attention(qb, kb, v[b:b + 1, :, idx], branch_mask)
            torch.testing.assert_close(out[b:b + 1, :, idx].double(), ref, atol=_tol(backend), rtol=0)
            checked += n
    assert checked > 100


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_packed_documents_equal_each_document_alone(backend):
    torch.manual_seed(1)
    seq, heads, dim = 300, 2, 16
    rows = [([120, 37, 90, 41], [False, True, False, False]), ([7, 250, 20], [True, False, False])]
    s, lim = V.batch([V.from_document_lengths(lens, bid) for lens, bid in rows], seq)
    q = torch.randn(2, heads, seq, dim, dtype=torch.float64)
    k = torch.randn(2, 1, seq, dim, dtype=torch.float64)
    v = torch.randn(2, 1, seq, dim, dtype=torch.float64)
    out = _run(backend, q, k, v, s, lim)
    for b, (lens, bid) in enumerate(rows):
        a = 0
        for n, bd in zip(lens, bid):
            sl = slice(a, a + n)
            mask = torch.ones(n, n, dtype=torch.bool) if bd else torch.ones(n, n, dtype=torch.bool).tril()
            ref, _ = ref_attention(q[b:b + 1, :, sl], k[b:b + 1, :, sl], v[b:b + 1, :, sl], mask)
            torch.testing.assert_close(out[b:b + 1, :, sl].double(), ref, atol=_tol(backend), rtol=0)
            a += n
        # padding tokens attend only to themselves: output = their own value
        torch.testing.assert_close(out[b, :, a:].double(), v[b, 0, a:].double().expand(heads, -1, -1),
                                   atol=_tol(backend), rtol=0)


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_gqa_mqa_equals_expanded_heads(backend, kv_heads):
    torch.manual_seed(2)
    heads, seq, dim = 6, 200, 16
    s, lim = V.batch([V.from_document_lengths([50, 150], [False, True])], seq)
    q = torch.randn(1, heads, seq, dim, dtype=torch.float64, requires_grad=backend != "flex")
    k = torch.randn(1, kv_heads, seq, dim, dtype=torch.float64, requires_grad=backend != "flex")
    v = torch.randn(1, kv_heads, seq, dim, dtype=torch.float64, requires_grad=backend != "flex")
    g = heads // kv_heads
    out = _run(backend, q, k, v, s, lim)
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    ref = _run(backend, q, ke, ve, s, lim)
    torch.testing.assert_close(out, ref, atol=_tol(backend), rtol=0)
    ref64, _ = ref_attention(q.detach(), k.detach(), v.detach(), interval_mask(s, lim))
    torch.testing.assert_close(out.detach().double(), ref64, atol=_tol(backend), rtol=0)
    if backend == "flex":
        return
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v])
    grads_e = torch.autograd.grad((ref * dout).sum(), [q, ke, ve])
    torch.testing.assert_close(grads[0], grads_e[0], atol=1e-10, rtol=0)
    for got, exp in zip(grads[1:], grads_e[1:]):  # expanded heads' grads summed back per kv head
        torch.testing.assert_close(got, exp.view(1, kv_heads, g, seq, dim).sum(2), atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_sliding_window_brute_force(backend):
    rng = random.Random(9)
    torch.manual_seed(3)
    seq = 150
    _, (s, lim, pos) = _forest_batch(rng, 2, 3, seq, max_nodes=8, max_len=6, p_bidir=0.3)
    q = torch.randn(2, 2, seq, 16, dtype=torch.float64)
    k = torch.randn(2, 2, seq, 16, dtype=torch.float64)
    v = torch.randn(2, 2, seq, 16, dtype=torch.float64)
    for window in (1, 4, 11):
        out, lse = _run(backend, q, k, v, s, lim, window=window, position_ids=pos, return_lse=True)
        ref, ref_lse = ref_attention(q, k, v, interval_mask(s, lim, window, pos))
        torch.testing.assert_close(out.double(), ref, atol=_tol(backend), rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)
    # Plain causal document with a window, positions defaulting to 0..T-1.
    s1, l1 = V.batch([V.from_document_lengths([seq])])
    out = _run(backend, q[:1], k[:1], v[:1], s1, l1, window=8)
    i = torch.arange(seq)
    mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 8)
    torch.testing.assert_close(out.double(), ref_attention(q[:1], k[:1], v[:1], mask)[0],
                               atol=_tol(backend), rtol=0)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_gradients_match_reference_on_tree(backend):
    rng = random.Random(21)
    torch.manual_seed(4)
    seq = 140
    _, (s, lim, pos) = _forest_batch(rng, 2, 3, seq, max_nodes=8, max_len=6, p_bidir=0.3)
    shapes = [(2, 4, seq, 16), (2, 2, seq, 16), (2, 2, seq, 16)]
    q, k, v = (torch.randn(*sh, dtype=torch.float64, requires_grad=True) for sh in shapes)
    dout = torch.randn(2, 4, seq, 16, dtype=torch.float64)
    out = attend(q, k, v, s, lim, backend=backend)
    got = torch.autograd.grad((out * dout).sum(), [q, k, v])
    ref, _ = ref_attention(q, k, v, interval_mask(s, lim))
    exp = torch.autograd.grad((ref * dout).sum(), [q, k, v])
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", GRAD_BACKENDS)
def test_low_precision_inputs(backend):
    torch.manual_seed(5)
    s, lim = V.batch([V.from_document_lengths([40, 60])])
    q, k, v = (torch.randn(1, 2, 100, 16) for _ in range(3))
    out = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), s, lim, backend=backend)
    assert out.dtype == torch.bfloat16
    ref, _ = ref_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), interval_mask(s, lim))
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_fully_masked_rows_give_zero_and_no_nan(backend):
    torch.manual_seed(6)
    seq = 40
    s, lim = V.batch([V.from_document_lengths([seq])])
    s[0, 0], s[0, 17] = 1, 18  # rows 0 and 17 see nothing (invalid intervals, on purpose)
    s[0, 1:17] = 1  # ... key 0 stays invisible to row 0; keys 1..16 bidirectional from 1
    grad = backend != "flex"
    q, k, v = (torch.randn(1, 2, seq, 16, dtype=torch.float64, requires_grad=grad) for _ in range(3))
    mask = interval_mask(s, lim)
    dead = ~mask.any(-1)[0]
    assert dead.tolist().count(True) >= 1
    out, lse = _run(backend, q, k, v, s, lim, return_lse=True, zreg_coeff=0.1 if grad else 0.0)
    assert torch.isfinite(out).all()
    assert torch.all(out[0, :, dead] == 0)
    assert torch.all(lse[0, :, dead] == float("-inf"))
    ref, _ = ref_attention(q.detach(), k.detach(), v.detach(), mask)
    torch.testing.assert_close(out.detach().double(), ref, atol=_tol(backend), rtol=0)
    if grad:
        finite = torch.isfinite(lse)
        loss = out.sum() + lse[finite].sum()
        for g in torch.autograd.grad(loss, [q, k, v]):
            assert torch.isfinite(g).all()


def test_blocked_never_builds_a_dense_mask(monkeypatch):
    """The block-skipping path works from block summaries only (dense_mask is the T x T builder)."""
    def boom(*a, **k):
        raise AssertionError("dense_mask called on the fast path")

    monkeypatch.setattr(V, "dense_mask", boom)
    s, lim = V.batch([V.from_document_lengths([100, 300, 112])])
    q, k, v = (torch.randn(1, 2, 512, 16, requires_grad=True) for _ in range(3))
    out = attend(q, k, v, s, lim, backend="blocked", zreg_coeff=0.01)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_flex_block_mask_matches_tiles():
    rng = random.Random(13)
    layouts, (s, lim, pos) = _forest_batch(rng, 2, 12, 700, max_nodes=8, max_len=12, p_bidir=0.2)
    for window in (None, 20):
        bm = flex_block_mask(s, lim, window=window, position_ids=pos)
        dense = bm.to_dense()[:, 0].bool()  # [B, nq, nk]: partial or full tiles
        mask = V.dense_mask(s, lim, window, pos)
        nq = -(-700 // 128)
        for b in range(2):
            for qb in range(nq):
                for kb in range(nq):
                    tile = mask[b, qb * 128:(qb + 1) * 128, kb * 128:(kb + 1) * 128]
                    if tile.any():
                        assert dense[b, qb, kb]
        full_num = bm.full_kv_num_blocks[:, 0]
        for b in range(2):
            for qb in range(nq):
                for t in range(int(full_num[b, qb])):
                    kb = int(bm.full_kv_indices[b, 0, qb, t])
                    assert mask[b, qb * 128:(qb + 1) * 128, kb * 128:(kb + 1) * 128].all()
    # Sparsity really is exploited on packed trees.
    assert dense.sum() < dense.numel()


def test_tree_fuzz_attention_blocked_vs_reference():
    """Many random packed forests, small blocks so partial/full/skipped tiles all occur."""
    from megatron_cai.core.transformer.blocked_attention import blocked_attention

    rng = random.Random(99)
    torch.manual_seed(7)
    for _ in range(25):
        _, (s, lim, pos) = _forest_batch(rng, 1, 4, 90, max_nodes=6, max_len=5, p_bidir=0.3)
        q, k, v = (torch.randn(1, 2, 90, 8, dtype=torch.float64) for _ in range(3))
        out, lse = blocked_attention(q, k, v, s, lim, block_q=rng.choice([4, 16]), block_k=rng.choice([4, 8]))
        ref, ref_lse = ref_attention(q, k, v, interval_mask(s, lim))
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_queries_past_a_cache_equal_the_full_rows(backend):
    """q holding only the last seq_q positions (decoding with a KV cache) == those rows of the full call."""
    rng = random.Random(17)
    torch.manual_seed(9)
    seq = 130
    _, (s, lim, pos) = _forest_batch(rng, 2, 3, seq, max_nodes=7, max_len=6, p_bidir=0.3)
    lim = lim.long()
    lim = torch.where(lim == lim.amax(), torch.full_like(lim, torch.iinfo(torch.int64).max), lim)
    q = torch.randn(2, 4, seq, 16, dtype=torch.float64)
    k, v = (torch.randn(2, 2, seq, 16, dtype=torch.float64) for _ in range(2))
    for window in (None, 6):
        full, full_lse = _run(backend, q, k, v, s, lim, window=window, position_ids=pos, return_lse=True)
        for seq_q in (1, 37, seq):
            part, lse = _run(backend, q[:, :, -seq_q:], k, v, s, lim, window=window, position_ids=pos,
                             return_lse=True)
            torch.testing.assert_close(part, full[:, :, -seq_q:], atol=_tol(backend), rtol=0)
            torch.testing.assert_close(lse, full_lse[:, :, -seq_q:], atol=1e-6, rtol=0)
    if backend == "flex":
        return
    qp = q[:, :, -37:].clone().requires_grad_()
    kk, vv = k.clone().requires_grad_(), v.clone().requires_grad_()
    dout = torch.randn(2, 4, 37, 16, dtype=torch.float64)
    got = torch.autograd.grad((attend(qp, kk, vv, s, lim, backend=backend, zreg_coeff=0.1) * dout).sum(),
                              [qp, kk, vv])
    exp = torch.autograd.grad((attend(qp, kk, vv, s, lim, backend="eager", zreg_coeff=0.1) * dout).sum(),
                              [qp, kk, vv])
    for a, b in zip(got, exp):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_dispatch_and_shape_errors():
    assert default_backend(torch.device("cpu")) == "blocked"
    with pytest.raises(ValueError, match="last seq_q"):
        attend(torch.randn(1, 2, 9, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16),
               *V.batch([V.from_document_lengths([8])]))
    s, lim = V.batch([V.from_document_lengths([8])])
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 3, 8, 16)
    with pytest.raises(ValueError, match="divide"):
        attend(q, k, k, s, lim)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attend(q, q, q, s, lim, backend="nope")
    with pytest.raises(ValueError, match=r"visibility_start must be \[batch, seq\]"):
        attend(q, q, q, s[:, :4], lim)
    with pytest.raises(ValueError, match="integer"):
        attend(q, q, q, s.float(), lim)
    out = attend(q, q, q, s, lim)  # backend=None on CPU
    ref, _ = ref_attention(q, q, q, interval_mask(s, lim))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "triton", "blocked"])
def test_cuda_backends_vs_reference(backend):
    rng = random.Random(31)
    torch.manual_seed(8)
    seq = 700
    _, (s, lim, pos) = _forest_batch(rng, 2, 10, seq, max_nodes=8, max_len=12, p_bidir=0.2)
    q = torch.randn(2, 4, seq, 64)
    k, v = torch.randn(2, 2, seq, 64), torch.randn(2, 2, seq, 64)
    dout = torch.randn_like(q)
    ref, ref_lse = ref_attention(q, k, v, interval_mask(s, lim, 50, pos))
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):
        qc, kc, vc = (x.cuda().to(dtype).requires_grad_() for x in (q, k, v))
        out, lse = attend(qc, kc, vc, s.cuda(), lim.cuda(), window=50, position_ids=pos.cuda(),
                          backend=backend, return_lse=True, zreg_coeff=1e-2)
        torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=0)
        torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=tol * 10, rtol=0)
        ins = [x.detach().float().requires_grad_() for x in (qc, kc, vc)]
        out_e = attend(*ins, s.cuda(), lim.cuda(), window=50, position_ids=pos.cuda(), backend="eager",
                       zreg_coeff=1e-2)
        g = torch.autograd.grad((out.float() * dout.cuda()).sum(), [qc, kc, vc])
        g_e = torch.autograd.grad((out_e * dout.cuda()).sum(), ins)
        for a, b in zip(g, g_e):
            torch.testing.assert_close(a.float(), b, atol=tol * 5, rtol=tol)

"""Attention dropout under context parallelism (gloo, CP = 2): with the same seed, each rank's output, lse and
dQ/dK/dV equal a single-process dense attention (written out here) whose probabilities are dropped by the same
(batch, head, query position, key position) mask, in fp64, on causal and packed-document intervals with a window,
GQA and Z-Reg; the mask itself keeps 1 - p of the probabilities, is a function of positions, and changes with
the seed."""
from __future__ import annotations

import math

import torch
from testlib.distributed import run_distributed

from megatron_cai.core.transformer import visibility_layouts as V
from megatron_cai.core.transformer.attention_dropout import PositionalDropout

SEQ, DIM, P = 32, 8, 0.3
CASES = [("causal", 4, 2, None, 0.0), ("docs", 4, 1, 6, 0.2)]  # (kind, heads, kv_heads, window, zreg)


def _intervals(kind: str):
    if kind == "causal":
        start, limit = torch.arange(SEQ).expand(2, SEQ), torch.full((2, SEQ), SEQ)
        return start.long(), limit.long(), torch.arange(SEQ).expand(2, SEQ).long()
    rows = [V.from_document_lengths(lens) + (V.document_position_ids(lens),)
            for lens in ([5, 9, 3, 7, 8], [11, 1, 20])]
    return tuple(torch.stack([r[i] for r in rows]).long() for i in range(3))


def _reference(q, k, v, start, limit, pos, window, zreg, dropout: PositionalDropout):
    """Dense attention over the intervals, probabilities x the positional keep scale; Z-Reg adds
    zreg * mean(lse^2) to the objective (its gradient is what the kernels inject)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    i = torch.arange(SEQ).view(1, SEQ, 1)
    seen = (start.unsqueeze(1) <= i) & (i < limit.unsqueeze(1))  # [B, i, j]
    if window is not None:
        seen &= (pos.unsqueeze(2) - pos.unsqueeze(1)).abs() < window
    s = (q @ k.transpose(-1, -2) / math.sqrt(DIM)).masked_fill(~seen.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    keep = dropout.scale(q.shape[1], torch.arange(SEQ), torch.arange(SEQ).expand(2, SEQ)).double()
    out = (torch.softmax(s, -1) * keep) @ v
    return out, lse, zreg * lse.pow(2).mean()


def _worker(rank, world):
    import torch.distributed as dist

    from megatron_cai.core.context_parallel.batch import ContextParallelVisibility, split_for
    from megatron_cai.core.context_parallel.exchange import Peers

    errs, lse_errs, changed = [], [], []
    for case_i, (kind, heads, kv_heads, window, zreg) in enumerate(CASES):
        start, limit, pos = _intervals(kind)
        g = torch.Generator().manual_seed(case_i)
        q, k, v, do = (torch.randn(2, h, SEQ, DIM, generator=g, dtype=torch.float64)
                       for h in (heads, kv_heads, kv_heads, heads))
        batch = {"tokens": torch.zeros(2, SEQ, dtype=torch.long)}
        if kind != "causal":
            batch.update(visibility_start=start, visibility_limit=limit)
        split = split_for(batch, world)
        idx = split.token_index(rank)
        torch.manual_seed(100 + case_i)  # the shared generator stream the seed is drawn from
        vis = ContextParallelVisibility(split, rank, Peers(dist.group.WORLD, tuple(range(world))), start, limit, pos)
        mine = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
        out, lse = vis.attend(*mine, backend="blocked", zreg_coeff=zreg, window=window, block=8, dropout_p=P)
        (out * do[:, :, idx]).sum().mul(world).backward()
        out, lse = out.detach(), lse.detach()  # each rank's loss is CP x its share (as in training)
        torch.manual_seed(100 + case_i)
        ref = [x.clone().requires_grad_() for x in (q, k, v)]
        r_out, r_lse, omega = _reference(*ref, start, limit, pos, window, zreg, PositionalDropout.draw(P, "cpu"))
        ((r_out * do).sum() + omega).backward()
        errs.append(max(float((out - r_out[:, :, idx]).abs().max()),
                        *(float((x.grad / world - r.grad[:, :, idx]).abs().max()) for x, r in zip(mine, ref))))
        lse_errs.append(float((lse - r_lse[:, :, idx]).abs().max()))  # returned in fp32
        undropped = vis.attend(*(x.detach() for x in mine), backend="blocked", window=window, block=8)[0]
        changed.append(float((undropped - out.detach()).abs().max()))
    return {"errs": errs, "lse_errs": lse_errs, "changed": changed}


def test_context_parallel_dropout_equals_one_process_with_the_same_mask():
    for r in run_distributed(_worker, 2):
        assert max(r["errs"]) < 1e-12 and max(r["lse_errs"]) < 1e-6, r
        assert min(r["changed"]) > 1e-3, r  # dropout does change the output


def test_positional_dropout_mask():
    d = PositionalDropout(P, torch.tensor(12345))
    qi, ki = torch.arange(64), torch.arange(64).expand(2, 64)
    m = d.scale(4, qi, ki)
    kept = m > 0
    assert torch.equal(m.unique(), torch.tensor([0.0, 1.0 / (1.0 - P)]))
    assert abs(kept.float().mean().item() - (1.0 - P)) < 0.01  # 32768 draws: std 0.0025
    for same in ((kept[..., 1:] == kept[..., :-1]), (kept[:, :, 1:] == kept[:, :, :-1])):  # neighbouring keys,
        assert abs(same.float().mean().item() - (P * P + (1 - P) ** 2)) < 0.015  # queries independent
    perm = torch.randperm(64)  # a function of positions: any split or order of queries and keys sees the same
    assert torch.equal(d.scale(4, qi[perm], ki[:, perm]), m[:, :, perm][:, :, :, perm])
    assert not torch.equal(PositionalDropout(P, torch.tensor(12346)).scale(4, qi, ki), m)
    assert not torch.equal(m[0], m[1]) and not torch.equal(m[:, 0], m[:, 1])  # batch rows and heads differ

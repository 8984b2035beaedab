"""Context-parallel attention (gloo, CP = 2 and 4) equals single-process attention in fp64: outputs, lse
and dQ/dK/dV on causal, packed-document and tree intervals, with a sliding window, Attention Z-Reg and
GQA/MQA; the bytes sent are exactly the K/V of the keys some remote query can see (brute force)."""
from __future__ import annotations

import pytest
import torch
from testlib.distributed import run_distributed

from megatron_cai.core.transformer import visibility_layouts as V

SEQ, DIM = 48, 8
CASES = [  # (kind, heads, kv_heads, window, zreg)
    ("causal", 4, 2, None, 0.0), ("causal", 2, 1, 5, 0.0), ("docs", 4, 2, None, 0.3), ("docs", 4, 4, 4, 0.0),
    ("trees", 4, 1, None, 0.0), ("trees", 4, 2, 3, 0.2),
]


def _intervals(kind: str, bsz: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = []
    for b in range(bsz):
        if kind == "causal":
            rows.append((torch.arange(SEQ), torch.full((SEQ,), SEQ), torch.arange(SEQ)))
        elif kind == "docs":
            lens = [[5, 9, 3, 7, 8, 2, 14], [11, 1, 20, 4, 12]][b]
            s, lim = V.from_document_lengths(lens)
            rows.append((s, lim, V.document_position_ids(lens)))
        else:
            forest = [([-1, 0, 0, 1, 2, 2], [3, 4, 2, 5, 3, 4]), ([-1, 0, 1, 0], [6, 5, 4, 7])]
            lay = V.concat_layouts([V.from_tree(*t) for t in (forest if b == 0 else forest[::-1])])
            rows.append(V.pad(lay.start, lay.limit, SEQ, lay.position_ids))
    return tuple(torch.stack([r[i] for r in rows]).long() for i in range(3))


def _inputs(heads: int, kv_heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, SEQ, DIM, generator=g, dtype=torch.float64),
            torch.randn(2, kv_heads, SEQ, DIM, generator=g, dtype=torch.float64),
            torch.randn(2, kv_heads, SEQ, DIM, generator=g, dtype=torch.float64),
            torch.randn(2, heads, SEQ, DIM, generator=g, dtype=torch.float64))


def _worker(rank, world, backends, cases=None):
    import torch.distributed as dist

    from megatron_cai.core.context_parallel.batch import ContextParallelVisibility, split_for
    from megatron_cai.core.context_parallel.exchange import Peers
    from megatron_cai.core.transformer.attention import attend

    results = []
    for case_i, (kind, heads, kv_heads, window, zreg) in enumerate(CASES):
        if cases is not None and case_i not in cases:
            continue
        start, limit, pos = _intervals(kind, 2)
        q, k, v, do = _inputs(heads, kv_heads, case_i)
        batch = {"tokens": torch.zeros(2, SEQ, dtype=torch.long)}
        if kind != "causal":
            batch.update(visibility_start=start, visibility_limit=limit)
        split = split_for(batch, world)
        idx = split.token_index(rank)
        ref = [x.clone().requires_grad_() for x in (q, k, v)]
        r_out, r_lse = attend(*ref, start, limit, zreg_coeff=zreg, window=window, position_ids=pos, backend="eager",
                              return_lse=True)
        (r_out * do).sum().backward()
        for backend in backends:
            vis = ContextParallelVisibility(split, rank, Peers(dist.group.WORLD, tuple(range(world))), start, limit,
                                            pos)
            mine = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
            out, lse = vis.attend(*mine, backend=backend, zreg_coeff=zreg, window=window, block=16)
            # as in training, each rank's loss is CP x its share; the DP x CP mean divides by CP again
            (out * do[:, :, idx]).sum().mul(world).backward()
            grads = [x.grad / world for x in mine]
            err = max((out - r_out[:, :, idx]).abs().max(), (lse - r_lse[:, :, idx]).abs().max(),
                      *((g - x.grad[:, :, idx]).abs().max() for g, x in zip(grads, ref)))
            results.append({"case": (kind, heads, kv_heads, window, zreg, backend), "err": float(err.detach()),
                            "sent": (vis.stats.forward_bytes, vis.stats.backward_bytes), "split": split.chunk_owner})
    return results


def _expected_bytes(kind: str, kv_heads: int, window, split_owner, world: int) -> tuple[list[int], list[int]]:
    """Per rank, brute force: (sent, received) 8-byte K and V rows of every (row, key) that some query of
    another rank can see."""
    start, limit, pos = _intervals(kind, 2)
    chunk = SEQ // len(split_owner)
    owner = [split_owner[j // chunk] for j in range(SEQ)]
    sent, received = [0] * world, [0] * world
    for b in range(2):
        for j in range(SEQ):
            for r in range(world):
                if r == owner[j]:
                    continue
                if any(int(start[b, j]) <= i < int(limit[b, j]) and (window is None or
                                                                     abs(int(pos[b, i]) - int(pos[b, j])) < window)
                       for i in range(SEQ) if owner[i] == r):
                    sent[owner[j]] += 2 * kv_heads * DIM * 8
                    received[r] += 2 * kv_heads * DIM * 8
    return sent, received


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_matches_one_process(world):
    per_rank = run_distributed(_worker, world, (("eager", "blocked"),))
    for i, res in enumerate(per_rank[0]):
        kind, heads, kv_heads, window, zreg, backend = res["case"]
        for rank in range(world):
            assert per_rank[rank][i]["err"] < 1e-12, (rank, res["case"], per_rank[rank][i]["err"])
        sent, received = _expected_bytes(kind, kv_heads, window, res["split"], world)
        got = [per_rank[r][i]["sent"] for r in range(world)]
        if window is None:  # exact; a window is pruned per query block (conservative)
            assert [f for f, _ in got] == sent, res["case"]
            # backward: the same K/V again, then dK/dV of every received key back to its owner
            assert [b for _, b in got] == [s + r for s, r in zip(sent, received)], res["case"]
        else:
            assert all(f >= e for (f, _), e in zip(got, sent))
        assert sum(f for f, _ in got) > 0


def test_context_parallel_attention_with_triton_kernels_under_the_interpreter():
    per_rank = run_distributed(_worker, 2, (("triton",), (2, 5)), env={"TRITON_INTERPRET": "1"})
    for rank in range(2):
        for res in per_rank[rank]:
            assert res["err"] < 2e-5, res  # the kernels compute fp64 inputs in fp32

"""SquinchReducer over gloo: results equal the sum of independently encoded/decoded contributions."""
import pytest
import torch
from testlib.distributed import run_distributed

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.distributed.grad_buffer import Bucket, bucket_padding
from megatron_cai.core.distributed.squinch_collectives import row_nbytes
from megatron_cai.core.distributed.squinch_reducer import SquinchReducer
from megatron_cai.core.squinch import decode, encode

N_BLOCKS = 3


def _grad(global_rank: int, numel: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + global_rank)
    return torch.randn(numel, generator=g) * torch.logspace(-6, 0, numel).roll(global_rank)


def _worker(rank, world, tp, pp, mode, steps, rpn, cp=1):
    """Squinch over the gradient-reduction group: DP, or DP x CP with context parallelism."""
    ps.initialize_model_parallel(tp, pp, ranks_per_node=rpn, context_parallel_size=cp)
    dp, dp_rank = ps.get_data_parallel_world_size(True), ps.get_data_parallel_rank(True)
    numel = N_BLOCKS * bucket_padding(dp)
    reducer = SquinchReducer(ps.get_data_parallel_group(True), dp, error_feedback=True, shard_only=mode.endswith("rs"),
                             hierarchical=mode.startswith("hier"), backend="cpu")
    outs = []
    for step in range(steps):
        g = _grad(rank, numel, step)
        bucket = Bucket(0, 0, numel, [], g.clone(), torch.zeros(numel), dp, dp_rank)
        reducer.reduce(bucket).wait()
        outs.append(bucket.grad_data.clone().numpy())  # by value: a tensor would travel as a file descriptor
    return {"dp_ranks": ps.get_data_parallel_global_ranks(True), "dp_rank": dp_rank, "outs": outs,
            "bytes": reducer.bytes_sent, "numel": numel}


def _rs_expected(contribs: list[torch.Tensor], r: int, n: int) -> torch.Tensor:
    """Shard r: decode(chunk r of each sender's payload), summed in sender order."""
    c = contribs[0].numel() // n
    s = decode(encode(contribs[0][r * c:(r + 1) * c], backend="torch"), c, backend="torch")
    for w in range(1, n):
        s = s + decode(encode(contribs[w][r * c:(r + 1) * c], backend="torch"), c, backend="torch")
    return torch.zeros(c) + s


def _expected_first_step(results, mode, world):
    """Expected bucket of every rank after step 0 (zero residuals), from the reference codec."""
    out = {}
    for res in results:
        ranks, n = res["dp_ranks"], len(res["dp_ranks"])
        numel = res["numel"]
        contribs = [_grad(gr, numel, 0) * (1.0 / n) for gr in ranks]
        c = numel // n
        shards = [_rs_expected(contribs, r, n) for r in range(n)]
        r = res["dp_rank"]
        if mode == "rs":
            out[r, tuple(ranks)] = ("shard", shards[r])
        else:
            full = torch.cat([decode(encode(s, backend="torch"), c, backend="torch") for s in shards])
            out[r, tuple(ranks)] = ("full", full)
    return out


@pytest.mark.parametrize("world,tp,pp,mode,cp", [
    (2, 1, 1, "rs", 1), (2, 1, 1, "ar", 1), (4, 1, 1, "rs", 1), (4, 1, 1, "ar", 1),
    (4, 2, 1, "ar", 1), (4, 1, 2, "rs", 1), (4, 1, 1, "ar", 2),
])
def test_matches_independent_encode_decode(world, tp, pp, mode, cp):
    results = run_distributed(_worker, world, (tp, pp, mode, 2, None, cp))
    expected = _expected_first_step(results, mode, world)
    for res in results:
        kind, exp = expected[res["dp_rank"], tuple(res["dp_ranks"])]
        got = torch.from_numpy(res["outs"][0])
        n = len(res["dp_ranks"])
        if kind == "shard":
            c = got.numel() // n
            got = got[res["dp_rank"] * c:(res["dp_rank"] + 1) * c]
        assert torch.equal(got, exp), f"rank {res['dp_ranks'][res['dp_rank']]} ({mode}, DP={n})"
    # All-reduce: every replica holds identical gradients, at every step (error feedback on).
    if mode == "ar":
        for step in range(2):
            groups = {}
            for res in results:
                groups.setdefault(tuple(res["dp_ranks"]), []).append(torch.from_numpy(res["outs"][step]))
            for outs in groups.values():
                assert all(torch.equal(o, outs[0]) for o in outs)


def test_error_feedback_second_step():
    """Step 2 encodes g2/n + e1 where e1 = g1/n - decode(encode(g1/n))."""
    results = run_distributed(_worker, 2, (1, 1, "rs", 2, None))
    n = 2
    numel = results[0]["numel"]
    c = numel // n
    contribs = []
    for gr in range(2):
        y1 = _grad(gr, numel, 0) * (1.0 / n)
        e1 = y1 - decode(encode(y1, backend="torch"), numel, backend="torch")
        contribs.append(_grad(gr, numel, 1) * (1.0 / n) + e1)
    for res in results:
        r = res["dp_rank"]
        assert torch.equal(torch.from_numpy(res["outs"][1][r * c:(r + 1) * c]), _rs_expected(contribs, r, n))


@pytest.mark.parametrize("mode,cp", [("hier_rs", 1), ("hier_ar", 1), ("hier_ar", 2)])
def test_hierarchical_two_nodes_of_two(mode, cp):
    """4 ranks as 2 simulated nodes of 2: exact sum inside the node, Squinch across nodes. With CP = 2 the
    DP x CP group reduces and each node holds one CP pair (the CP ranks are intra-node)."""
    results = run_distributed(_worker, 4, (1, 1, mode, 1, 2, cp))
    n, L, M = 4, 2, 2
    numel = results[0]["numel"]
    c = numel // n
    g = [_grad(r, numel, 0) * (1.0 / n) for r in range(n)]
    node_sum = [g[m * L] + g[m * L + 1] for m in range(M)]  # two-term fp32 sums are order-free
    shards = {}
    for m in range(M):
        for lr in range(L):
            k = m * L + lr  # DP chunk owned by node m, local rank l
            s = decode(encode(node_sum[0][k * c:(k + 1) * c], backend="torch"), c, backend="torch")
            s = s + decode(encode(node_sum[1][k * c:(k + 1) * c], backend="torch"), c, backend="torch")
            shards[k] = torch.zeros(c) + s
    for res in results:
        r = res["dp_rank"]
        got = torch.from_numpy(res["outs"][0])
        if mode == "hier_rs":
            assert torch.equal(got[r * c:(r + 1) * c], shards[r])
        else:
            full = torch.cat([decode(encode(shards[k], backend="torch"), c, backend="torch") for k in range(n)])
            assert torch.equal(got, full)


def test_wire_bytes_are_six_sixteenths_of_bf16():
    results = run_distributed(_worker, 4, (1, 1, "ar", 1, None))
    numel, n = results[0]["numel"], 4
    bf16_allreduce = 2 * (n - 1) * numel * 2 // n
    row = row_nbytes(numel // n)  # 6 bits per element, the flag byte, zero padding to 16 bytes
    assert results[0]["bytes"] == 2 * (n - 1) * row  # every row sent, both phases
    assert 0 <= row - (numel // n) * 6 // 8 - 1 < 16 and results[0]["bytes"] > bf16_allreduce * 6 // 16

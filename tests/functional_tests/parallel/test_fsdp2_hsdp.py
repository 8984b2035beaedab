"""HSDP: --use-torch-fsdp2 --squinch --squinch-hierarchical shards within a node (FSDP2 over the node's
DP ranks) and all-reduces the shards across nodes with Squinch only (error feedback, inter-node bytes).

Two simulated nodes of two ranks (--ranks-per-node 2, DP = 4): nodes {0, 1} and {2, 3}; the cross-node
groups are {0, 2} and {1, 3}."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from testlib.distributed import run_distributed
from testlib.train import last_stage_history, train
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from functional_tests.parallel.test_parallel_equivalence import BASE
from megatron_cai.core.distributed.squinch_collectives import padded_chunk, row_nbytes
from megatron_cai.core.distributed.squinch_fsdp import SquinchReduceScatter
from megatron_cai.core.squinch import decode, encode_with_feedback

HSDP = ["--use-torch-fsdp2", "--squinch", "--squinch-hierarchical", "--ranks-per-node", "2"]


def _expected_all_reduce(inputs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """inputs[w][s]: cross-node member w's flat fp32 shard at step s. Independently, with the reference
    codec: each member pads to M chunks of whole blocks, encodes with its residual, e <- y - decode(y);
    owner r sums the decoded rows r (member order), zero-pads, re-encodes with its own residual; every
    member decodes every owner's payload. Returns the (identical) result of every step."""
    m, steps, n = len(inputs), len(inputs[0]), inputs[0][0].numel()
    chunk = -(-n // m)
    row = padded_chunk(chunk)
    residual = [torch.zeros(m * row) for _ in range(m)]
    owner = [torch.zeros(row) for _ in range(m)]
    out = []
    for s in range(steps):
        decoded = []
        for w in range(m):
            y = F.pad(F.pad(inputs[w][s], (0, m * chunk - n)).view(m, chunk), (0, row - chunk)).reshape(-1)
            payload, nonfinite = encode_with_feedback(y, residual[w], backend="torch")
            assert not bool(nonfinite)
            nb = payload.numel() // m
            decoded.append([decode(payload[r * nb:(r + 1) * nb], row, backend="torch") for r in range(m)])
        pieces = []
        for r in range(m):
            acc = decoded[0][r]
            for w in range(1, m):
                acc = acc + decoded[w][r]
            shard = torch.cat([acc[:chunk], torch.zeros(row - chunk)])
            payload, _ = encode_with_feedback(shard, owner[r], backend="torch")
            pieces.append(decode(payload, row, backend="torch")[:chunk])
        out.append(torch.cat(pieces)[:n])
    return out


def _groups(rank):
    """(intra-node group, cross-node group) of this rank: nodes {0, 1}, {2, 3}; cross {0, 2}, {1, 3}."""
    groups = {tuple(r): dist.new_group(list(r)) for r in ([0, 1], [2, 3], [0, 2], [1, 3])}
    return groups[(0, 1) if rank < 2 else (2, 3)], groups[(0, 2) if rank % 2 == 0 else (1, 3)]


def _hook_worker(rank, world, numel, steps):
    _, inter = _groups(rank)
    comm = SquinchReduceScatter(inter_group=inter, backend="cpu")
    ins, outs = [], []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * s + rank)
        x = torch.randn(numel, generator=g) * torch.logspace(-4, 0, numel).roll(5 * rank)
        ins.append(x.numpy().copy())
        comm.all_reduce_hook(x)
        outs.append(x.numpy())
    return {"ins": ins, "outs": outs, "bytes": comm.bytes_sent, "inter": comm.inter_node_bytes_sent}


@pytest.mark.parametrize("numel", [45, 64])  # 45: chunks of 23 padded to whole 8-element blocks
def test_cross_node_all_reduce_equals_independent_encode_decode(numel):
    """Two calls (the second carries both error feedbacks) equal the independent computation bit for
    bit, on every rank; all its bytes are inter-node."""
    res = run_distributed(_hook_worker, 4, (numel, 2))
    for members in ([0, 2], [1, 3]):
        expected = _expected_all_reduce([[torch.from_numpy(a) for a in res[w]["ins"]] for w in members])
        for w in members:
            for s in range(2):
                assert torch.equal(torch.from_numpy(res[w]["outs"][s]), expected[s]), f"rank {w} step {s + 1}"
    row = padded_chunk(-(-numel // 2))
    per_call = 2 * row_nbytes(row)  # all-to-all: one row of 2; all-gather: the owner's row to 1 peer
    assert res[0]["bytes"] == res[0]["inter"] == 2 * per_call


class _Recorder(ReduceScatter):
    """Wraps a unit's HSDP SquinchReduceScatter: records the intra-node reduce-scatter inputs and the
    all-reduce hook's input and output (what crosses the nodes), per call."""

    def __init__(self, inner: SquinchReduceScatter) -> None:
        self.inner, self.rs, self.ar = inner, [], []

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.rs.append((input_tensor.numel(), group.size()))
        return self.inner(output_tensor, input_tensor, group, op, async_op)

    def hook(self, reduce_output):
        x = reduce_output.clone()
        self.inner.all_reduce_hook(reduce_output)
        self.ar.append((x.numpy(), reduce_output.clone().numpy()))


def _recording_worker(rank, world, argv):
    from torch.distributed.fsdp import FSDPModule

    recorders = {}

    def hook(trainer):
        chunk = trainer.model[0]
        hook.chunk = chunk
        for name, m in chunk.module.named_modules():
            if isinstance(m, FSDPModule):
                rec = recorders[name or "root"] = _Recorder(chunk.comms[name or "root"])
                m.set_custom_reduce_scatter(rec)
                m.set_all_reduce_hook(rec.hook)
    out = train(argv, world, trainer_hook=hook)
    out["rs"] = {k: r.rs for k, r in recorders.items()}
    out["ar"] = {k: r.ar for k, r in recorders.items()}
    out["bytes"] = hook.chunk.reducer.bytes_sent
    out["inter"] = hook.chunk.reducer.inter_node_bytes_sent
    out["shard_numel"] = sum(p.to_local().numel() for p in hook.chunk.module.parameters())
    out["full_numel"] = sum(p.numel() for p in hook.chunk.module.parameters())
    return out


def test_training_cross_node_part_exact_and_bytes_inter_node():
    """In training (DP = 4 as 2 nodes x 2, two micro-batches per rank, 2 iterations): parameters are
    sharded over the 2 ranks of a node; every unit's cross-node result equals the independent Squinch
    all-reduce of the two nodes' intra-node-reduced shards, with error feedback, at iterations 1 and 2;
    the inter-node bytes are those of the Squinch all-reduce only, the rest is the fp32 intra-node
    reduce-scatter."""
    argv = BASE + HSDP + ["--train-iters", "2"]
    res = run_distributed(_recording_worker, 4, (argv,))
    assert res[0]["shard_numel"] * 2 == pytest.approx(res[0]["full_numel"], rel=0.02)  # over 2, not 4
    units = res[0]["ar"].keys()
    assert len(units) == 5  # 4 layers + the root
    inter_expected = intra_expected = 0
    for unit in units:
        for members in ([0, 2], [1, 3]):
            calls = [res[w]["ar"][unit] for w in members]
            assert len(calls[0]) == 2, unit  # one cross-node all-reduce per unit per iteration
            expected = _expected_all_reduce([[torch.from_numpy(x) for x, _ in c] for c in calls])
            for w, c in zip(members, calls):
                for s in range(2):
                    assert torch.equal(torch.from_numpy(c[s][1]), expected[s]), f"{unit} rank {w} step {s + 1}"
        for x, _ in res[0]["ar"][unit]:
            inter_expected += 2 * row_nbytes(padded_chunk(-(-x.size // 2)))
        for numel, size in res[0]["rs"][unit]:
            assert size == 2  # the reduce-scatter runs inside the node
            intra_expected += (size - 1) * numel * 4 // size
    assert res[0]["inter"] == inter_expected
    assert res[0]["bytes"] == inter_expected + intra_expected


def _exact_cross_node_worker(rank, world, argv):
    """HSDP with the codec replaced by an exact sum all-reduce across nodes (Squinch off)."""
    from megatron_cai.core.distributed import squinch_fsdp

    def exact(x, group, world, *args, **kwargs):
        dist.all_reduce(x, group=group)
        return 0

    squinch_fsdp.compressed_all_reduce = exact
    return train(argv, world)


def test_hsdp_matches_single_process_without_compression():
    """The HSDP machinery (intra-node sharding, the cross-node hook, the division by all of DP, the
    grad norm counting each shard once) with an exact cross-node sum: a single process's first 5
    iterations to 1e-5 in fp32."""
    reference = last_stage_history(run_distributed(_exact_cross_node_worker, 1, (BASE,)))
    got = last_stage_history(run_distributed(_exact_cross_node_worker, 4, (BASE + HSDP,)))
    assert len(got) == len(reference) == 5
    for i, (a, b) in enumerate(zip(got, reference)):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), f"iteration {i + 1} {key}: {a[key]} vs {b[key]}"


def _plain_worker(rank, world, argv):
    return train(argv, world)


def test_hsdp_with_squinch_trains_close_to_single_process():
    """With the real codec the run stays close to the exact one (6-bit gradients, error feedback)."""
    reference = last_stage_history(run_distributed(_plain_worker, 1, (BASE,)))
    got = last_stage_history(run_distributed(_plain_worker, 4, (BASE + HSDP,)))
    assert len(got) == len(reference) == 5
    for a, b in zip(got, reference):
        assert a["lm loss"] == pytest.approx(b["lm loss"], rel=2e-2)
        assert a["grad norm"] == pytest.approx(b["grad norm"], rel=5e-2)


def _nan_worker(rank, world, argv):
    from torch.distributed.fsdp import FSDPModule

    class Inject(_Recorder):  # NaN into rank 3's gradients (the second node) at iteration 2
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            self.calls = getattr(self, "calls", 0) + 1
            if rank == 3 and self.calls == 2:
                input_tensor[1] = float("nan")
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    def hook(trainer):
        for name, m in trainer.model[0].module.named_modules():
            if isinstance(m, FSDPModule):
                rec = Inject(trainer.model[0].comms[name or "root"])
                m.set_custom_reduce_scatter(rec)
                m.set_all_reduce_hook(rec.hook)
    return train(argv, world, trainer_hook=hook)


def test_nonfinite_on_one_node_skips_every_rank_and_drops_feedback():
    """A NaN in one rank's gradients reaches the other node only as Squinch's flag byte: every rank
    skips iteration 2, the cross-node residuals (NaN after that encode) are reset, iteration 3 is finite."""
    argv = BASE + HSDP + ["--train-iters", "3"]  # one micro-batch per rank: one reduce per unit and step
    for r in run_distributed(_nan_worker, 4, (argv,)):
        assert [h["skipped"] for h in r["history"]] == [False, True, False], f"rank {r['rank']}"
        assert math.isnan(r["history"][1]["grad norm"])
        assert math.isfinite(r["history"][2]["grad norm"])


def test_resume_bit_exact_with_cross_node_feedback(tmp_path):
    """8 iterations straight == 4, save torch_dist, exit, resume, 4: the cross-node error-feedback
    residuals of every unit are checkpointed and restored (with dropout on, the RNG too)."""
    args = BASE + HSDP + ["--hidden-dropout", "0.1", "--ckpt-format", "torch_dist", "--train-iters", "8"]
    straight = last_stage_history(run_distributed(_plain_worker, 4, (args,)))
    save = str(tmp_path / "ckpt")
    first = last_stage_history(run_distributed(_plain_worker, 4, (args + ["--save", save, "--exit-interval", "4"],)))
    second = last_stage_history(run_distributed(_plain_worker, 4, (args + ["--load", save],)))
    pairs = [(h["lm loss"], h["grad norm"]) for h in first + second]
    assert pairs == [(h["lm loss"], h["grad norm"]) for h in straight]

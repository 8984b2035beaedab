"""--use-torch-fsdp2 (FSDP2 over the DP mesh dimension, with our TP and PP) against a single-process run,
and Squinch as FSDP2's reduce-scatter against independently encoded and decoded contributions."""
import math

import pytest
import torch
import torch.distributed as dist
from testlib.distributed import run_distributed
from testlib.train import last_stage_history, train
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from functional_tests.parallel.test_parallel_equivalence import BASE
from megatron_cai.core.distributed.squinch_collectives import padded_chunk, row_nbytes
from megatron_cai.core.distributed.squinch_fsdp import SquinchReduceScatter
from megatron_cai.core.squinch import decode, encode_with_feedback
from megatron_cai.training.arguments import ArgumentError, parse_config

FSDP = ["--use-torch-fsdp2"]


def _worker(rank, world_size, argv):
    return train(argv, world_size)


def _run(world_size, extra):
    return last_stage_history(run_distributed(_worker, world_size, (BASE + extra,)))


@pytest.fixture(scope="module")
def reference():
    return _run(1, [])


LAYOUTS = {  # name: (world, flags); (TP, PP, DP) in the name
    "tp1pp1dp2": (2, FSDP),
    "tp1pp1dp4": (4, FSDP),
    "tp2pp1dp2_sp": (4, FSDP + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp1pp2dp2": (4, FSDP + ["--pipeline-model-parallel-size", "2"]),
    "tp1pp2dp2_interleaved_recompute": (4, FSDP + ["--pipeline-model-parallel-size", "2",
                                                   "--num-layers-per-virtual-pipeline-stage", "1",
                                                   "--recompute-granularity", "full"]),
    # One KV head on two TP ranks: the KV projection is replicated, its gradient shards summed over TP.
    "tp2pp1dp2_mqa_replicated_kv": (4, FSDP + ["--tensor-model-parallel-size", "2", "--num-query-groups", "1"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_single_process(name, reference):
    world, extra = LAYOUTS[name]
    got = _run(world, extra)
    if "--num-query-groups" in extra:  # another architecture: its own single-process reference
        reference = _run(1, extra[extra.index("--num-query-groups"):][:2])
    assert len(got) == len(reference) == 5
    for i, (a, b) in enumerate(zip(got, reference)):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), f"iteration {i + 1} {key}: {a[key]} vs {b[key]}"


# ------------------------------------------------------------------------------------- Squinch hook
def _x(rank: int, numel: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(numel, generator=g) * torch.logspace(-5, 0, numel).roll(7 * rank)


def _expected_shards(inputs: list[list[torch.Tensor]], world: int, chunk: int) -> list[list[torch.Tensor]]:
    """inputs[w][s]: rank w's flat input at step s. Independently, with the reference codec: each rank
    pads its rows to whole blocks, encodes y = x + e (e: its own residual), e <- y - decode(payload);
    shard r = sum over w (rank order) of decode(row r of w's payload), cut to the chunk."""
    row = padded_chunk(chunk)
    steps = len(inputs[0])
    residual = [torch.zeros(world * row) for _ in range(world)]
    out = [[None] * steps for _ in range(world)]
    for s in range(steps):
        decoded = []
        for w in range(world):
            y = torch.nn.functional.pad(inputs[w][s].view(world, chunk), (0, row - chunk)).reshape(-1)
            payload, nonfinite = encode_with_feedback(y, residual[w], backend="torch")
            assert not bool(nonfinite)
            nb = payload.numel() // world
            decoded.append([decode(payload[r * nb:(r + 1) * nb], row, backend="torch") for r in range(world)])
        for r in range(world):
            acc = decoded[0][r]
            for w in range(1, world):
                acc = acc + decoded[w][r]
            out[r][s] = acc[:chunk]
    return out


def _by_value(tensors):
    """Tensors as numpy arrays: pickled by value through the result queue (no shared-memory handles)."""
    return [t.numpy() for t in tensors]


def _tensors(arrays):
    return [torch.from_numpy(a) for a in arrays]


def _hook_worker(rank, world, chunk, steps):
    comm = SquinchReduceScatter(error_feedback=True, backend="cpu")
    ins, outs = [], []
    for s in range(steps):
        x = _x(rank, world * chunk, s)
        out = comm.allocate((chunk,), dtype=torch.float32, device=torch.device("cpu"))
        comm(out, x.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
        ins.append(x)
        outs.append(out.clone())
    return {"ins": _by_value(ins), "outs": _by_value(outs), "bytes": comm.bytes_sent}


@pytest.mark.parametrize("world,chunk", [(2, 37), (4, 24)])  # 37: rows padded to whole 8-element blocks
def test_squinch_hook_equals_independent_encode_decode(world, chunk):
    res = run_distributed(_hook_worker, world, (chunk, 2))
    expected = _expected_shards([_tensors(r["ins"]) for r in res], world, chunk)
    for r in range(world):
        for s, got in enumerate(_tensors(res[r]["outs"])):  # step 2 carries step 1's error feedback
            assert torch.equal(got, expected[r][s]), f"rank {r} step {s + 1}"
    row = padded_chunk(chunk)
    # per row: 6 bits per element, the flag byte, zero padding to 16 bytes (docs/squinch-format.md)
    assert res[0]["bytes"] == 2 * (world - 1) * row_nbytes(row) == 2 * (world - 1) * 16 * -(-(1 + row * 6 // 8) // 16)


class _Recorder(ReduceScatter):
    """Wraps a hook; records every call's input and output (what FSDP2 hands over and gets back)."""

    def __init__(self, inner, log: list, inject_nan_at: int | None = None) -> None:
        self.inner, self.log, self.inject_nan_at, self.calls = inner, log, inject_nan_at, 0

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.calls == self.inject_nan_at:
            input_tensor[3] = float("nan")
        self.calls += 1
        x = input_tensor.clone()
        work = self.inner(output_tensor, input_tensor, group, op, async_op)
        self.log.append((x.numpy(), output_tensor.clone().numpy()))
        return work


LOGS: dict = {}


def _recording_worker(rank, world, argv, nan_rank, nan_call):
    from torch.distributed.fsdp import FSDPModule

    def hook(trainer):
        for ci, chunk in enumerate(trainer.model):
            for name, m in chunk.module.named_modules():
                if isinstance(m, FSDPModule):
                    LOGS[ci, name] = []
                    inject = nan_call if rank == nan_rank else None
                    m.set_custom_reduce_scatter(_Recorder(chunk.comms[name or "root"], LOGS[ci, name], inject))
    out = train(argv, world, trainer_hook=hook)
    out["logs"] = {k: v for k, v in LOGS.items()}
    return out


def test_squinch_fsdp2_shards_exact_at_steps_1_and_2():
    """In training (DP=2, two micro-batches per rank), every unit's reduced shard equals the sum of the
    two ranks' independently encoded + decoded contributions, with error feedback, at iterations 1 and 2;
    one reduce-scatter per unit per iteration (none after the first micro-batch)."""
    argv = BASE + FSDP + ["--squinch", "--train-iters", "2"]
    res = run_distributed(_recording_worker, 2, (argv, None, None))
    keys = res[0]["logs"].keys()
    assert len(keys) == 5  # 4 layers + the root (tied embedding and output layer on one stage)
    for key in keys:
        calls = [r["logs"][key] for r in res]
        assert len(calls[0]) == 2, key  # one reduce-scatter per unit per iteration
        chunk = calls[0][0][1].size
        expected = _expected_shards([[torch.from_numpy(x) for x, _ in c] for c in calls], 2, chunk)
        for r in range(2):
            for s in range(2):
                got = torch.from_numpy(calls[r][s][1])
                assert torch.equal(got, expected[r][s]), f"{key} rank {r} step {s + 1}"


def test_squinch_nonfinite_skips_every_rank():
    """NaN in rank 1's gradients at iteration 2 travels as the flag byte: every rank skips that step."""
    argv = BASE + FSDP + ["--squinch", "--global-batch-size", "4", "--train-iters", "3"]
    res = run_distributed(_recording_worker, 2, (argv, 1, 1))
    for r in res:
        assert [h["skipped"] for h in r["history"]] == [False, True, False], f"rank {r['rank']}"
        assert r["skipped"] == 1
        assert math.isnan(r["history"][1]["grad norm"])
        assert math.isfinite(r["history"][2]["grad norm"])


def _bytes_worker(rank, world, argv):
    return train(argv, world)["history"][0]["grad comm bytes"]


@pytest.mark.parametrize("world", [2, 4])
def test_squinch_bytes_are_six_sixteenths_of_bf16_reduce_scatter(world):
    argv = BASE + FSDP + ["--train-iters", "1"]
    squinch = run_distributed(_bytes_worker, world, (argv + ["--squinch"],))[0]
    bf16 = run_distributed(_bytes_worker, world, (argv + ["--grad-reduce-in-bf16"],))[0]
    ratio = squinch / bf16
    # 6 bits per element instead of 16; per unit and row, one flag byte and padding to whole 8-blocks.
    assert 6 / 16 <= ratio < 6 / 16 * 1.02, ratio


# ------------------------------------------------------------------------------- precision, flags
def _bf16_worker(rank, world, argv):
    from megatron_cai.core.distributed.fsdp import local as local_

    def hook(trainer):
        p = next(trainer.model[0].module.parameters())
        hook.dtypes = (local_(p).dtype, trainer.model[0].settings.mp_policy().param_dtype)
    out = train(argv, world, trainer_hook=hook)
    out["dtypes"] = hook.dtypes
    return out


def test_bf16_compute_fp32_master_weights(reference):
    res = run_distributed(_bf16_worker, 2, (BASE + FSDP + ["--bf16"],))
    assert res[0]["dtypes"] == (torch.float32, torch.bfloat16)
    hist = last_stage_history(res)
    for a, b in zip(hist, reference):  # bf16 compute: close to the fp32 run, not equal
        assert a["lm loss"] == pytest.approx(b["lm loss"], rel=2e-2)
        assert a["lm loss"] != b["lm loss"] or a["grad norm"] != b["grad norm"]


@pytest.mark.parametrize("flag,message", [
    (["--save", "/tmp/x"], "saves only --ckpt-format torch_dist"),
    (["--load", "/tmp/x"], "loads only torch_dist checkpoints"),
    (["--use-distributed-optimizer"], "drop --use-distributed-optimizer"),
])
def test_unsupported_flags_refused(flag, message):
    with pytest.raises(ArgumentError, match=message):
        parse_config(BASE + FSDP + flag, world_size=2)


def _memory_worker(rank, world, argv):
    held = {}

    def hook(trainer):
        held["trainer"] = trainer
    train(argv, world, trainer_hook=hook)
    return held["trainer"].state.extra["memory"]


def test_memory_report_shards_model_state_over_dp():
    """The logged per-rank bytes: FSDP2 holds half of DDP's parameters, gradients and Adam state at DP=2."""
    argv = BASE + ["--train-iters", "1"]
    ddp = run_distributed(_memory_worker, 2, (argv,))[0]
    fsdp = run_distributed(_memory_worker, 2, (argv + FSDP,))[0]
    for key in ("params", "grads", "optimizer"):  # DDP's buckets and FSDP2's dim-0 shards pad differently
        assert fsdp[key] == pytest.approx(ddp[key] / 2, rel=0.02), key
    assert fsdp["optimizer"] == 2 * fsdp["params"] == 2 * fsdp["grads"]
    assert ddp["peak"] > 0 and fsdp["peak"] > 0

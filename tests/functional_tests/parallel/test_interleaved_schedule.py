"""The interleaved 1F1B schedule with micro-batch groups (--microbatch-group-size-per-virtual-pipeline-stage):
each pipeline rank runs its forwards and backwards in the order megatron-core 0.19.2's schedule does (its
``get_schedule_table`` and ``get_pp_rank_microbatches``), and the losses and gradients equal the same chain of
stages run in one process. Micro-batch counts need not divide by the pipeline size."""
from __future__ import annotations

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.mcore_cpu import shim_cpu

from megatron_cai.core.pipeline_parallel.schedules import interleaving_problem, schedule_table

PP, V, WIDTH = 4, 2, 3
# (micro-batches, group size): the tunable-overlap configurations' 5 in one group of 5; groups of 5 with a partial
# last group (4 >= PP); the default group (PP) with M divisible by PP, and M = PP (ranks 0-1 all in warm-up)
COMBOS = [(5, 5), (9, 5), (14, 5), (8, 4), (4, 4), (7, 7)]


class _Stage(torch.nn.Module):
    """One virtual stage: ``tanh(x @ W)``, W seeded by the global stage index; backwards are logged."""

    def __init__(self, stage: int, log: list) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(100 + stage)
        self.weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, generator=gen, dtype=torch.float64) * 0.7)
        self.stage, self.log, self.input_tensor = stage, log, None
        self.post_process = stage == PP * V - 1

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, batch: torch.Tensor, chunk: int, microbatch: int) -> torch.Tensor:
        x = batch if self.input_tensor is None else self.input_tensor.to(torch.float64)
        self.log.append(("F", chunk, microbatch))
        out = torch.tanh(x @ self.weight)
        out.register_hook(lambda g: self.log.append(("B", chunk, microbatch)))
        return out


class _Chunk:
    """The :class:`ModelChunk` members the schedule uses."""

    def __init__(self, module: _Stage) -> None:
        self.module = module

    def set_is_last_microbatch(self, last: bool) -> None:
        return None


def _batches(m: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(2, WIDTH, generator=gen, dtype=torch.float64) for _ in range(m)]


def _loss(out: torch.Tensor, microbatch: int) -> torch.Tensor:
    return (out * (microbatch + 1)).square().sum()


def _worker(rank: int, world_size: int, combos: list) -> list[dict]:
    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    ps.initialize_model_parallel(pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=V)
    results = []
    for m, group in combos:
        log: list = []
        chunks = [_Chunk(_Stage(c * PP + rank, log)) for c in range(V)]

        def step(it, chunk):
            microbatch, batch = next(it)
            out = chunk.module(batch, chunk.module.stage // PP, microbatch)
            return out, lambda o: (_loss(o, microbatch), {"loss": _loss(o, microbatch).detach()})

        iters = [iter(list(enumerate(_batches(m)))) for _ in range(V)]
        losses = forward_backward_pipelining_with_interleaving(step, iters, chunks, m, tensor_shape=(2, WIDTH),
                                                               dtype=torch.float64, microbatch_group_size=group)
        results.append({"log": log, "losses": [s["loss"].item() for s in losses],
                        "grads": {c.module.stage: c.module.weight.grad for c in chunks}})
    return results


def _megatron_order(m: int, group: int, rank: int) -> list[tuple]:
    """The (F|B, chunk, micro-batch) sequence megatron-core's interleaved schedule runs on pipeline ``rank``."""
    from types import SimpleNamespace

    shim_cpu()
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: PP, rank=lambda: rank),
                           virtual_pipeline_model_parallel_size=V)
    total, _, warmup, remaining = get_pp_rank_microbatches(m, V, group, p2p_communicator=comm)
    table = get_schedule_table(m, V, group)
    fwd = [("F", c, mb) for mb, c in table]
    bwd = [("B", V - 1 - c, mb) for mb, c in table]
    order = fwd[:warmup]
    for i in range(remaining):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[remaining:total]


def _reference(m: int) -> tuple[list[float], dict[int, torch.Tensor]]:
    """All PP x V stages in one process: each micro-batch's loss, and the gradient of the mean loss."""
    stages = [_Stage(s, []) for s in range(PP * V)]
    losses = []
    for mb, x in enumerate(_batches(m)):
        for s in stages:
            x = torch.tanh(x @ s.weight)
        loss = _loss(x, mb)
        (loss / m).backward()
        losses.append(loss.item())
    return losses, {s.stage: s.weight.grad for s in stages}


def test_schedule_table_is_megatrons():
    shim_cpu()
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    for m in range(1, 13):
        for v in (1, 2, 3):
            for group in range(1, m + 2):
                assert schedule_table(m, v, group) == get_schedule_table(m, v, group), (m, v, group)


def test_group_size_checks_are_megatrons():
    """megatron-core raises inside its schedule; the same combinations are refused here with its texts."""
    assert interleaving_problem(5, 4, 5) is None and interleaving_problem(8, 4, 4) is None
    assert "should range in [PP=4 , M=5]" in interleaving_problem(5, 4, 6)
    assert "should range in [PP=4 , M=5]" in interleaving_problem(5, 4, 3)
    assert "but it is 1." in interleaving_problem(5, 4, 4)  # the default group (PP) with M = 5
    assert interleaving_problem(9, 4, 5) is None  # last group of 4 >= PP
    assert "but it is 2." in interleaving_problem(7, 4, 5)


def test_order_losses_and_gradients_match_megatron_and_one_process():
    results = run_distributed(_worker, PP, (COMBOS,))
    for i, (m, group) in enumerate(COMBOS):
        ref_losses, ref_grads = _reference(m)
        for rank, per_rank in enumerate(results):
            got = per_rank[i]
            assert got["log"] == _megatron_order(m, group, rank), (m, group, rank)
            for stage, grad in got["grads"].items():
                torch.testing.assert_close(grad, ref_grads[stage], rtol=1e-12, atol=1e-12)
        assert results[PP - 1][i]["losses"] == pytest.approx(ref_losses, rel=1e-12)


def _train(rank: int, world_size: int, argv: list[str]) -> dict:
    from testlib.train import train

    return train(argv, world_size)


@pytest.mark.slow
def test_training_pp4_vp2_five_microbatches_matches_single_process():
    """The tunable-overlap configurations' schedule in the trainer: PP 4 x VP 2, 5 micro-batches in one group of
    5 (not a multiple of PP), 3 iterations: the losses and gradient norms of one process."""
    from testlib.train import TINY_MODEL, last_stage_history

    base = TINY_MODEL + ["--num-layers", "8", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "5",
                         "--train-iters", "3", "--lr", "3e-3", "--log-interval", "100", "--eval-interval", "0",
                         "--seed", "7"]
    reference = last_stage_history([_train(0, 1, base)])
    pipelined = base + ["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                        "--microbatch-group-size-per-virtual-pipeline-stage", "5"]
    got = last_stage_history(run_distributed(_train, 4, (pipelined,)))
    assert len(got) == len(reference) == 3
    for a, b in zip(got, reference):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a[key], b[key])

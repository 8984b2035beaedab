"""--fp16 with --use-torch-fsdp2: dynamic loss scaling over FSDP2's gradient shards. The run follows the DDP
path's fp16 run within fp16 tolerance, and a non-finite gradient on one rank's shard, even one the global norm
does not count, makes every rank skip the step and back the scale off."""
import math

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import last_stage_history, train

from functional_tests.parallel.test_parallel_equivalence import BASE

FP16 = ["--fp16", "--initial-loss-scale", "1024", "--loss-scale-window", "2", "--hysteresis", "1"]
FSDP = ["--use-torch-fsdp2"]


def _worker(rank, world_size, argv):
    return train(argv, world_size)


def test_fsdp2_dp2_matches_ddp_dp1():
    """The same global batch, fp16 autocast, fp32 master weights: DDP on one rank and FSDP2 over two agree
    within fp16 rounding, step for step, with the same loss-scale trajectory (it grows every 2 clean steps); both
    stay near the fp32 run (the scale is undone before the norm, the clipping and the update)."""
    ddp = last_stage_history(run_distributed(_worker, 1, (BASE + FP16,)))
    fsdp = last_stage_history(run_distributed(_worker, 2, (BASE + FP16 + FSDP,)))
    fp32 = last_stage_history(run_distributed(_worker, 1, (BASE,)))
    assert len(ddp) == len(fsdp) == 5
    assert [h["loss scale"] for h in fsdp] == [h["loss scale"] for h in ddp] == [1024, 2048, 2048, 4096, 4096]
    assert not any(h["skipped"] for h in ddp + fsdp)
    for i, (a, b, c) in enumerate(zip(fsdp, ddp, fp32)):
        assert a["lm loss"] == pytest.approx(b["lm loss"], rel=1e-4), i  # measured: 1.5e-6
        assert a["grad norm"] == pytest.approx(b["grad norm"], rel=1e-3), i  # 4e-5
        assert a["lm loss"] == pytest.approx(c["lm loss"], rel=1e-3), i  # 1.6e-5
        assert a["grad norm"] == pytest.approx(c["grad norm"], rel=5e-3), i  # 5e-4


POISONED_RANK = 3  # TP rank 1, DP rank 1 of TP 2 x DP 2


def _poison_worker(rank, world_size, argv):
    """Train; on POISONED_RANK, at iteration 2, one element of a TP-replicated (layer-norm) gradient shard becomes
    inf after the gradient sync. TP rank 1's copies are not counted in the global norm."""
    from megatron_cai.core import parallel_state as ps
    from megatron_cai.core.distributed.fsdp import local

    held = {}

    def hook(trainer):
        chunk = trainer.model[0]
        name = next(n for n in chunk.meta if chunk.meta[n].tp_replicated and chunk.meta[n].decay is False)
        param = dict(chunk.module.named_parameters())[name]
        sync = chunk.finish_grad_sync

        def poisoned_sync():
            sync()
            if trainer.state.iteration == 1 and ps.get_rank() == POISONED_RANK:
                assert not chunk.counted_in_norm(name)
                local(param.grad).view(-1)[0] = math.inf
        chunk.finish_grad_sync = poisoned_sync
        held.update(trainer=trainer, param=param)

    out = train(argv, world_size, trainer_hook=hook)
    out["replicated"] = held["param"].full_tensor().detach().clone()
    out["scale"] = held["trainer"].grad_scaler.scale
    return out


def test_inf_on_one_ranks_uncounted_shard_skips_everywhere():
    argv = BASE + FP16 + FSDP + ["--tensor-model-parallel-size", "2", "--train-iters", "3",
                                 "--loss-scale-window", "1000"]
    results = run_distributed(_poison_worker, 4, (argv,))
    for r in results:
        assert [h["skipped"] for h in r["history"]] == [False, True, False], r["rank"]
        assert [h["loss scale"] for h in r["history"]] == [1024, 512, 512], r["rank"]
        assert r["skipped"] == 1 and r["scale"] == 512
        assert torch.isfinite(r["replicated"]).all()
    # the TP-replicated weight stays one weight: both TP ranks of each DP pair hold the same values
    assert torch.equal(results[0]["replicated"], results[1]["replicated"])
    assert torch.equal(results[2]["replicated"], results[3]["replicated"])


@pytest.mark.slow
def test_loss_scale_resumes_from_a_torch_dist_checkpoint(tmp_path):
    """The scaler's state travels with FSDP2's optimizer state: 3 + 3 iterations through a torch_dist checkpoint
    give the straight run's loss scales and losses."""
    args = BASE + FP16 + FSDP + ["--train-iters", "6", "--ckpt-format", "torch_dist"]
    straight = last_stage_history(run_distributed(_worker, 2, (args,)))
    save = str(tmp_path / "ckpt")
    run_distributed(_worker, 2, (args + ["--save", save, "--exit-interval", "3"],))
    second = last_stage_history(run_distributed(_worker, 2, (args + ["--load", save],)))
    assert [h["loss scale"] for h in straight] == [1024, 2048, 2048, 4096, 4096, 8192]
    assert [h["loss scale"] for h in second] == [h["loss scale"] for h in straight[3:]]
    assert [h["lm loss"] for h in second] == [h["lm loss"] for h in straight[3:]]

"""Bit-exact resume, atomic saves, config-mismatch errors, NaN-skip across ranks."""
import os

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train

from megatron_cai.training import checkpoint
from megatron_cai.training.checkpoint import torch_format

BASE = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "2e-3",
                     "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0", "--seed", "11",
                     "--hidden-dropout", "0.1", "--attention-dropout", "0.0", "--lr-warmup-iters", "3"]


def _worker(rank, world_size, argv):
    return train(argv, world_size)


def _losses(results):
    return [h["lm loss"] for h in last_stage_history(results)]


@pytest.mark.parametrize("world,extra,iters", [
    (1, [], 20),
    (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
         "--ddp-bucket-size", "2000"], 8),
    (2, ["--pipeline-model-parallel-size", "2"], 8),
    (2, ["--squinch"], 8),
    (2, ["--squinch", "--squinch-stochastic-rounding", "--use-distributed-optimizer"], 8),
], ids=["single", "tp2dp2_distopt", "pp2", "squinch_ef", "squinch_stochastic_distopt"])
def test_resume_is_bit_exact(tmp_path, world, extra, iters):
    """N iterations straight == N/2, save, exit, resume, N/2 (fp32 CPU, dropout on)."""
    half = iters // 2
    args = BASE + extra + ["--train-iters", str(iters)]
    straight = _losses(run_distributed(_worker, world, (args,)))
    save = str(tmp_path / "ckpt")
    first = _losses(run_distributed(_worker, world, (args + ["--save", save, "--exit-interval", str(half)],)))
    assert checkpoint.read_tracker(save) == half
    second = _losses(run_distributed(_worker, world, (args + ["--load", save],)))
    assert len(first) == half and len(second) == iters - half
    assert first == straight[:half]
    assert second == straight[half:], "resumed losses differ from the uninterrupted run"
    assert straight[-1] < straight[0]


def _die_during_second_save(rank, world_size, argv):
    real_save = torch_format.save_torch

    def save(obj, path):
        if "iter_0000004" in path:
            os._exit(3)  # the process is killed in the middle of writing the checkpoint
        return real_save(obj, path)  # the content hash it returns

    torch_format.save_torch = save
    return train(argv, world_size)


def _crash(save_dir):
    run_distributed(_die_during_second_save, 1, (BASE + ["--train-iters", "6", "--save", save_dir,
                                                         "--save-interval", "2"],), timeout=120)


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    with pytest.raises(AssertionError, match="died with exit code"):
        _crash(save)
    assert checkpoint.read_tracker(save) == 2
    assert os.path.isdir(os.path.join(save, "iter_0000004.tmp"))
    resumed = run_distributed(_worker, 1, (BASE + ["--train-iters", "4", "--load", save],))[0]
    assert resumed["iteration"] == 4 and len(resumed["history"]) == 2


def test_mismatched_config_names_fields(tmp_path):
    save = str(tmp_path / "ckpt")
    run_distributed(_worker, 1, (BASE + ["--train-iters", "1", "--save", save],))
    bad = [a if a != "32" else "48" for a in BASE]  # --hidden-size 48
    with pytest.raises(AssertionError, match="most likely --hidden-size differs: 32 in the checkpoint, 48 in this run"):
        run_distributed(_worker, 1, (bad + ["--train-iters", "2", "--load", save],))


def test_changed_layout_points_to_converter(tmp_path):
    save = str(tmp_path / "ckpt")
    run_distributed(_worker, 1, (BASE + ["--train-iters", "1", "--save", save],))
    with pytest.raises(AssertionError, match="convert_checkpoint.py"):
        run_distributed(_worker, 2, (BASE + ["--train-iters", "2", "--load", save,
                                             "--tensor-model-parallel-size", "2"],))


@pytest.mark.slow
def test_changed_pipeline_split_is_refused(tmp_path):
    """PP 2 saved with the even split (layers 0-1 | 2-3), resumed with --decoder-first-pipeline-num-layers 1
    (0 | 1-3): the torch-format stages hold other layers, so the resume stops and points to the converter."""
    save = str(tmp_path / "ckpt")
    pp2 = ["--pipeline-model-parallel-size", "2"]
    run_distributed(_worker, 2, (BASE + pp2 + ["--train-iters", "1", "--save", save],))
    with pytest.raises(AssertionError, match="another pipeline split"):
        run_distributed(_worker, 2, (BASE + pp2 + ["--train-iters", "2", "--load", save,
                                                   "--decoder-first-pipeline-num-layers", "1"],))


def _nan_worker(rank, world_size, argv, bad_iteration):
    from megatron_cai.core import parallel_state as ps

    snapshots = {}

    def hook(trainer):
        ddp = trainer.model[0]
        original = ddp.finish_grad_sync

        def finish():
            it = trainer.state.iteration + 1  # the iteration in progress
            if it == bad_iteration:
                snapshots["before"] = ddp.buffer.param_data.clone()
                if ps.get_data_parallel_rank() == 1:
                    ddp.buffer.grad_data[5] = float("nan")
            if it == bad_iteration + 1:
                snapshots["after"] = ddp.buffer.param_data.clone()
            original()

        ddp.finish_grad_sync = finish

    out = train(argv, world_size, trainer_hook=hook)
    out["unchanged"] = bool(torch.equal(snapshots["before"], snapshots["after"]))
    return out


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer"], ["--squinch"],
                                   ["--squinch", "--use-distributed-optimizer"]],
                         ids=["allreduce", "distopt", "squinch", "squinch_distopt"])
def test_nan_on_one_rank_skips_step_everywhere(extra):
    argv = BASE + extra + ["--train-iters", "6"]
    results = run_distributed(_nan_worker, 2, (argv, 3))
    for r in results:
        assert r["skipped"] == 1, f"rank {r['rank']} did not skip"
        assert r["unchanged"], f"rank {r['rank']} changed its parameters in the skipped step"
        hist = r["history"]
        assert [h["skipped"] for h in hist] == [False, False, True, False, False, False]
        assert all(torch.isfinite(torch.tensor(h["lm loss"])) for h in hist)

"""--async-save: the checkpoint a background writer saves is the synchronous one, bit for bit; a job killed
while an asynchronous save is in flight resumes bit-exactly from the previous checkpoint; SIGTERM waits
for the save in flight."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from functional_tests.faults.test_faults import INJECT, MODEL, ROOT, assert_one_error, launch_ranks, rank_file, tracker
from functional_tests.faults.test_faults import run as run_fault
from megatron_cai.training.checkpoint import async_save

ARGS = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "2e-3",
                     "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0", "--seed", "7",
                     "--hidden-dropout", "0.1", "--lr-warmup-iters", "2", "--use-distributed-optimizer",
                     "--squinch", "--train-iters", "8"]


def _train_recording_finalizes(rank, world, argv, write_delay):
    """Train; with ``write_delay`` the background write starts that many seconds late (training goes on)."""
    if write_delay:
        real = async_save.AsyncCheckpointSaver._run

        def slow_run(job):
            time.sleep(write_delay)
            real(job)

        async_save.AsyncCheckpointSaver._run = staticmethod(slow_run)
    finalized = []

    def hook(trainer):
        real_finalize = trainer.finalize_async_save

        def finalize(blocking):
            saver = trainer.checkpointer.async_saver
            job = saver.in_flight if saver else None
            real_finalize(blocking)
            if job is not None and saver.in_flight is None:
                finalized.append((job.iteration, trainer.state.iteration))
        trainer.finalize_async_save = finalize

    out = train(argv, world, trainer_hook=hook)
    out["finalized"] = finalized
    return out


def _curves(results):
    return [(h["lm loss"], h["grad norm"]) for h in last_stage_history(results)]


def _payloads(root: str, iteration: int) -> dict[str, object]:
    d = os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00")
    return {f: torch.load(os.path.join(d, f), weights_only=False) for f in sorted(os.listdir(d))}


def _assert_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


FSDP2 = [a for a in ARGS if a not in ("--use-distributed-optimizer", "--squinch")] + ["--use-torch-fsdp2"]


@pytest.mark.parametrize("fmt,args", [("torch", ARGS), ("torch_dist", ARGS), ("torch_dist", FSDP2)],
                         ids=["torch", "torch_dist", "torch_dist_fsdp2"])
def test_async_save_equals_sync_and_resumes_bit_exactly(tmp_path, fmt, args):
    """DP=2, distributed optimizer, Squinch (and FSDP2): the async checkpoint (written while training went
    on) equals the synchronous one file for file (torch format), and resuming it gives the uninterrupted
    run's losses and grad norms."""
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    flags = args + ["--save-interval", "4", "--ckpt-format", fmt]
    sync = run_distributed(_train_recording_finalizes, 2, (flags + ["--save", sync_dir], 0.0))
    asyn = run_distributed(_train_recording_finalizes, 2, (flags + ["--save", async_dir, "--async-save"], 1.5))
    assert _curves(asyn) == _curves(sync)  # saving in the background does not perturb training
    # the write of iteration 4 started 1.5 s late: it was made current only later (at the next save's wait)
    assert asyn[0]["finalized"] == [(4, 8), (8, 8)], asyn[0]["finalized"]
    assert tracker(async_dir) == 8 and not [d for d in os.listdir(async_dir) if d.endswith(".tmp")]
    if fmt == "torch":
        for it in (4, 8):
            a, s = _payloads(async_dir, it), _payloads(sync_dir, it)
            assert sorted(a) == ["model_optim_rng.pt", "reducer_dp_000.pt", "reducer_dp_001.pt"]
            _assert_equal(a, s, f"iter {it}")
    else:
        assert sorted(os.listdir(os.path.join(async_dir, "iter_0000004"))) == \
            sorted(os.listdir(os.path.join(sync_dir, "iter_0000004")))
    resumed = run_distributed(_train_recording_finalizes, 2,
                              (args + ["--ckpt-format", fmt, "--load", async_dir, "--ckpt-step", "4"], 0.0))
    assert _curves(resumed) == _curves(sync)[4:]


FAULT_FLAGS = ["--mock-data", "--vocab-size", "64", *MODEL, "--hidden-dropout", "0.1", "--global-batch-size", "4",
               "--use-distributed-optimizer", "--squinch", "--train-iters", "6", "--save-interval", "2"]


def _lm_losses(stdout: str) -> dict[int, str]:
    out = {}
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: (\S+) .*?grad norm: (\S+) ", stdout):
        out[int(m.group(1))] = (m.group(2), m.group(3))
    return out


def _wait_all(procs, timeout=240):
    return [p.communicate(timeout=timeout) for p in procs]


def _checkpoint(root: str, iteration: int, fmt: str, tmp_path) -> dict:
    """Everything a checkpoint holds, as nested dicts of tensors (torch_dist: read back through DCP)."""
    if fmt == "torch":
        return _payloads(root, iteration)
    out = str(tmp_path / f"dcp_{abs(hash(root))}_{iteration}.pt")
    dcp_to_torch_save(os.path.join(root, f"iter_{iteration:07d}"), out)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_kill_during_async_save_resumes_from_the_previous_checkpoint(tmp_path, fmt):
    """SIGKILL the job while iteration 4's asynchronous save is being written (training has gone on to
    iteration 5): the tracker stays on 2, and resuming gives the uninterrupted run's checkpoints exactly."""
    ref, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    flags = [*FAULT_FLAGS, "--ckpt-format", fmt]
    procs = launch_ranks([*flags, "--save", ref], 2)
    ref_out = _wait_all(procs)
    assert [p.returncode for p in procs] == [0, 0], ref_out[1]
    procs = launch_ranks([*flags, "--save", run_dir, "--async-save"], 2,
                         env={"FAULT_HANG_SAVE": "iter_0000004", "FAULT_ITER_SLEEP": "0.05"})
    try:
        for line in procs[1].stderr:  # the writer thread of iteration 4 hangs after 4 KiB
            if line.startswith("FAULT: saving") and "iter_0000004" in line:
                break
        seen = []
        for line in procs[1].stdout:  # the last rank logs: training went on while the save was in flight
            seen.append(line)
            if "iteration        5/" in line:
                break
        assert any("iteration        5/" in s for s in seen), "".join(seen)[-3000:]
        assert tracker(run_dir) == 2
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.communicate(timeout=60)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    assert tracker(run_dir) == 2
    assert not os.path.exists(os.path.join(run_dir, "iter_0000004"))
    assert os.path.isdir(os.path.join(run_dir, "iter_0000004.tmp"))  # the interrupted write, never current
    _assert_equal(_checkpoint(run_dir, 2, fmt, tmp_path), _checkpoint(ref, 2, fmt, tmp_path), "iter 2")
    procs = launch_ranks([*flags, "--load", run_dir, "--save", run_dir, "--async-save"], 2)
    outs = _wait_all(procs)
    assert [p.returncode for p in procs] == [0, 0], outs[1][0][-3000:] + outs[1][1][-3000:]
    assert f"loaded checkpoint from {run_dir} at iteration 2" in outs[0][0]
    assert tracker(run_dir) == 6 and not [d for d in os.listdir(run_dir) if d.endswith(".tmp")]
    resumed, straight = _lm_losses(outs[1][0]), _lm_losses(ref_out[1][0])
    assert sorted(resumed) == [3, 4, 5, 6] and all(resumed[i] == straight[i] for i in (3, 5, 6)), (resumed, straight)
    # Megatron-LM prints a run's first iteration without resetting its loss window: iteration 4's line
    # averages iterations 3 and 4 of the uninterrupted run (its grad norm is iteration 4's own).
    assert float(resumed[4][0]) == pytest.approx((float(straight[3][0]) + float(straight[4][0])) / 2, rel=2e-6)
    assert resumed[4][1] == straight[4][1]
    for it in (4, 6):
        _assert_equal(_checkpoint(run_dir, it, fmt, tmp_path), _checkpoint(ref, it, fmt, tmp_path), f"iter {it}")


def test_sigterm_waits_for_the_save_in_flight(tmp_path):
    """SIGTERM while iteration 2's asynchronous write is slow: the job waits for it, makes it current,
    then saves its final state as without --async-save, and exits 0."""
    save = str(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FAULT_SLOW_SAVE": "iter_0000002",
           "FAULT_SLOW_SAVE_SECONDS": "2", "FAULT_ITER_SLEEP": "0.05"}
    proc = subprocess.Popen([sys.executable, INJECT, "--mock-data", "--vocab-size", "64", *MODEL, "--train-iters",
                             "1000", "--save", save, "--save-interval", "2", "--async-save"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("FAULT: slow saving") and "iter_0000002" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out + err)[-3000:]
    m = re.search(r"exit signal received at iteration (\d+)", out)
    assert m, out[-3000:]
    last = int(m.group(1))
    saved = [int(s) for s in re.findall(r"saved checkpoint at iteration\s+(\d+)", out)]
    assert saved[0] == 2 and saved[-1] == last >= 2, saved
    assert tracker(save) == last
    assert os.path.isdir(os.path.join(save, "iter_0000002"))  # waited for, made current, not abandoned
    assert not [d for d in os.listdir(save) if d.endswith(".tmp")]
    assert torch.load(rank_file(save, 2), weights_only=False)["iteration"] == 2


def _train_with_inf_before_save(rank, world, argv, at):
    """Train; just before the save of iteration ``at`` one parameter becomes inf (no step was skipped)."""
    def hook(trainer):
        real_save = trainer.save

        def save():
            if trainer.state.iteration == at:
                with torch.no_grad():
                    next(trainer.model[0].module.parameters()).view(-1)[0] = float("inf")
            real_save()
        trainer.save = save

    return train(argv, world, trainer_hook=hook)


def test_async_save_of_a_non_finite_state_is_dropped(tmp_path, capfd):
    """The finiteness check that guards a synchronous save runs on the staged copy in the writer thread:
    a non-finite state is never made current (tracker unchanged, no directory left), as without async."""
    save = str(tmp_path / "ckpt")
    flags = [a for a in ARGS[:-1] if a not in ("--squinch", "--use-distributed-optimizer")]
    run_distributed(_train_with_inf_before_save, 1,
                    (flags + ["2", "--save", save, "--save-interval", "1", "--async-save"], 2))
    assert tracker(save) == 1
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert "dropped the asynchronous save of iteration 2" in capfd.readouterr().out


def test_failed_async_write_is_one_error_and_keeps_the_tracker(tmp_path):
    """A full disk in the writer thread: the next check stops the job with one error naming the file (as a
    synchronous save does), and the tracker stays on the last complete checkpoint."""
    save = str(tmp_path / "ckpt")
    proc = run_fault(["--mock-data", "--vocab-size", "64", *MODEL, "--train-iters", "8", "--save", save,
                      "--save-interval", "2", "--async-save"], env={"FAULT_ENOSPC": "iter_0000006"})
    line = assert_one_error(proc, os.path.join("iter_0000006.tmp", "mp_rank_00", "model_optim_rng.pt"), "ENOSPC")
    assert "needs about" in line
    assert tracker(save) == 4 and not os.path.exists(os.path.join(save, "iter_0000006"))

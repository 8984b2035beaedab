"""Exit signals at DP = 2, as real processes: Ctrl-C (SIGINT) mid-training, and SIGUSR1 during start-up.

- SIGINT to every rank (a terminal's Ctrl-C reaches the whole foreground group) behaves as SIGTERM: one save
  at one iteration, every rank exits 0, no traceback (before: a KeyboardInterrupt traceback per rank and no
  checkpoint).
- SIGUSR1 to one rank while the job builds its datasets, after loading a checkpoint: every rank stops before
  its first iteration and exits 0, and the loaded checkpoint is left byte for byte as it was (before: that
  rank died of the signal).
- SIGUSR1 to ``pretrain_gpt.py`` as soon as it handles the signal, which is before torch is loaded: a clean
  stop before training (before: the handler came after the checkpoint load and the dataset build).
- SIGUSR1 to the torchrun launcher alone (``megatron_cai.training.preemption.torchrun``), before its workers
  exist and mid-training: the launcher survives, the workers get it, the job exits 0 (plain torchrun dies of it).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from testlib import ROOT

from megatron_cai.training.preemption.torchrun import child_pids

from .test_faults import BASE, MODEL, _free_port, launch_ranks, snapshot, tracker

LONG = ["--mock-data", "--vocab-size", "64", *MODEL, "--train-iters", "1000"]


def _wait_line(stream, needle: str, seen: list[str]) -> None:
    for line in stream:
        seen.append(line)
        if needle in line:
            return
    raise AssertionError(f"no {needle!r} before the stream closed:\n{''.join(seen)[-3000:]}")


def _finish(procs: list[subprocess.Popen], seen: list[str], act) -> tuple[list[tuple[str, str]], str]:
    """``act()``, then every rank's (stdout, stderr) and all the text; each rank exits 0."""
    try:
        act()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "".join(seen) + "".join(o + e for o, e in outs)
    assert [p.returncode for p in procs] == [0, 0], text[-3000:]
    return outs, text


def test_ctrl_c_at_dp2_saves_once_and_every_rank_exits_cleanly(tmp_path):
    save = str(tmp_path / "ckpt")
    procs = launch_ranks([*LONG, "--save", save], 2, env={"FAULT_ITER_SLEEP": "0.05"})
    seen: list[str] = []

    def ctrl_c():
        _wait_line(procs[1].stdout, "iteration        3/", seen)  # the last rank prints the iteration lines
        for p in procs:
            p.send_signal(signal.SIGINT)

    _, text = _finish(procs, seen, ctrl_c)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    exits = re.findall(r"exit signal received at iteration (\d+): saved and exiting", text)
    assert len(exits) == 1, text[-3000:]
    saved = int(exits[0])
    assert saved >= 3 and tracker(save) == saved
    assert len(re.findall(r"saved checkpoint at iteration", text)) == 1


def test_usr1_during_start_up_on_one_rank_stops_every_rank_before_training(tmp_path):
    ckpt, release = str(tmp_path / "ckpt"), str(tmp_path / "release")
    first = launch_ranks([*BASE, "--train-iters", "2", "--save", ckpt], 2)
    outs = [p.communicate(timeout=240) for p in first]
    assert [p.returncode for p in first] == [0, 0], "".join(o + e for o, e in outs)[-3000:]
    assert tracker(ckpt) == 2
    before = snapshot(ckpt)
    procs = launch_ranks([*BASE, "--train-iters", "4", "--load", ckpt, "--save", ckpt], 2,
                         env={"FAULT_PAUSE_DATA": "1", "FAULT_PAUSE_UNTIL": release})
    seen: list[str] = []

    def usr1_to_rank_1():
        _wait_line(procs[1].stderr, "FAULT: building datasets", seen)  # rank 1 has loaded iteration 2
        procs[1].send_signal(signal.SIGUSR1)
        open(release, "w").close()

    outs, text = _finish(procs, seen, usr1_to_rank_1)
    assert "Traceback" not in text
    assert "loaded checkpoint from" in outs[0][0] and "at iteration 2" in outs[0][0]
    assert ("exit signal (on another rank) during start-up: exiting before the first iteration, nothing saved "
            "(the checkpoint at iteration 2 is current)") in outs[0][0], text[-3000:]
    assert not re.search(r"iteration\s+3/", text)
    assert snapshot(ckpt) == before and tracker(ckpt) == 2
    assert not os.path.exists(os.path.join(ckpt, "iter_0000003"))


def _usr1_in(pid: int, field: str) -> bool:
    """Whether SIGUSR1 is in the process's ``SigBlk`` (blocked) or ``SigCgt`` (handled) mask."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith(field + ":"))
    return bool(mask & (1 << (signal.SIGUSR1 - 1)))


def test_the_handler_is_in_place_before_torch_is_loaded(tmp_path):
    save = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "pretrain_gpt.py", *LONG, "--save", save], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    try:
        while not _usr1_in(proc.pid, "SigCgt"):
            assert proc.poll() is None
            time.sleep(0.005)
        with open(f"/proc/{proc.pid}/maps") as f:
            assert "libtorch" not in f.read(), "the handler must come before torch's import"
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "during start-up: exiting before the first iteration, nothing saved (nothing was trained)" in out
    assert tracker(save) is None


@pytest.mark.parametrize("when", ["before the workers exist", "mid-training"])
def test_torchrun_launcher_survives_usr1_and_hands_it_to_the_workers(tmp_path, when):
    save = str(tmp_path / "ckpt")
    cmd = [sys.executable, "-m", "megatron_cai.training.preemption.torchrun", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "launcher-test",
           "pretrain_gpt.py", *LONG, "--save", save, "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    seen: list[str] = []
    try:
        if when == "mid-training":
            _wait_line(proc.stdout, "iteration        3/", seen)
        else:
            while not _usr1_in(proc.pid, "SigBlk"):
                time.sleep(0.01)
            assert not child_pids(proc.pid), "the launcher is still importing torch: no worker yet"
        proc.send_signal(signal.SIGUSR1)  # the launcher alone (a proctrack/pgid Slurm reaches no more)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(seen) + out
    assert proc.returncode == 0, text[-3000:]
    if when == "mid-training":
        saved = int(re.search(r"exit signal received at iteration (\d+): saved and exiting", text).group(1))
        assert saved >= 3 and tracker(save) == saved
    else:
        assert "during start-up: exiting before the first iteration, nothing saved" in text, text[-3000:]
        assert tracker(save) is None and not re.search(r"iteration\s+1/", text)

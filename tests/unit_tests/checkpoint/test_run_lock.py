"""The run lock on --save: one holder, a second process refused with the holder named, dead holders taken over;
publishing never replaces an iteration without --overwrite-checkpoints, and then moves it aside."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from testlib import ROOT

from megatron_cai.training.checkpoint import CheckpointError, RunLock, run_dirs
from megatron_cai.training.checkpoint.run_lock import LOCK_FILE

_TRY_LOCK = ("import sys; sys.path.insert(0, {root!r})\n"
             "from megatron_cai.training.checkpoint import RunLock, CheckpointError\n"
             "try:\n    RunLock.acquire({save!r}, log=print); print('ACQUIRED')\n"
             "except CheckpointError as e:\n    print('REFUSED', e)\n")


def _other_process(save: str) -> str:
    return subprocess.run([sys.executable, "-c", _TRY_LOCK.format(root=ROOT, save=save)], capture_output=True,
                          text=True, timeout=120).stdout


def test_second_process_is_refused_with_the_holder_named(tmp_path):
    save = str(tmp_path)
    lock = RunLock.acquire(save)
    try:
        record = json.load(open(os.path.join(save, LOCK_FILE)))
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname() and record["start_time"]
        out = _other_process(save)
        assert out.startswith("REFUSED"), out
        assert f"process {os.getpid()} on host {socket.gethostname()}" in out and "another job" in out
    finally:
        lock.release()
    assert not os.path.exists(os.path.join(save, LOCK_FILE))  # a clean exit removes it
    assert "ACQUIRED" in _other_process(save)


def test_a_dead_holders_lock_file_is_taken_over_with_a_line(tmp_path):
    save = str(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(os.path.join(save, LOCK_FILE), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": dead.pid, "start_time": "then", "slurm_job_id": "77"}, f)
    lines = []
    lock = RunLock.acquire(save, log=lines.append)
    lock.release()
    assert len(lines) == 1 and f"process {dead.pid}" in lines[0] and "Slurm job 77" in lines[0], lines


def _published(root, iteration, marker):
    tmp = run_dirs.iteration_dir(root, iteration) + ".tmp"
    os.makedirs(tmp)
    open(os.path.join(tmp, "f"), "w").write(marker)
    return run_dirs.publish(root, iteration)


def test_publish_never_replaces_and_moves_aside_with_the_flag(tmp_path):
    root = str(tmp_path)
    for it in (4, 5, 6):
        _published(root, it, f"old{it}")
    tmp = run_dirs.iteration_dir(root, 4) + ".tmp"
    os.makedirs(tmp)
    open(os.path.join(tmp, "f"), "w").write("new4")
    with pytest.raises(CheckpointError, match="already exists.*--overwrite-checkpoints"):
        run_dirs.publish(root, 4)
    assert open(os.path.join(root, "iter_0000004", "f")).read() == "old4" and run_dirs.read_tracker(root) == 6
    lines = []
    run_dirs.publish(root, 4, overwrite=True, log=lines.append)
    assert open(os.path.join(root, "iter_0000004", "f")).read() == "new4" and run_dirs.read_tracker(root) == 4
    assert run_dirs.list_iterations(root) == [4]
    aside = sorted(n for n in os.listdir(root) if ".superseded-" in n)
    assert [n[:len("iter_0000004")] for n in aside] == ["iter_0000004", "iter_0000005", "iter_0000006"]
    for n in aside:
        assert open(os.path.join(root, n, "f")).read() == "old" + n[len("iter_000000"):len("iter_0000004")]
    assert len(lines) == 3

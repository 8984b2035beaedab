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


def test_a_symlinked_lock_path_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    save = tmp_path / "run"
    save.mkdir()
    os.symlink(victim, save / LOCK_FILE)
    with pytest.raises(CheckpointError, match=f"is a symbolic link \\(to {victim}\\)"):
        RunLock.acquire(str(save))
    os.unlink(save / LOCK_FILE)
    os.symlink(tmp_path / "nowhere", save / LOCK_FILE)  # a dangling link is not created through either
    with pytest.raises(CheckpointError, match="symbolic link"):
        RunLock.acquire(str(save))
    assert victim.read_text() == "keep me" and not (tmp_path / "nowhere").exists()


def _held_by_this_process(save: str, record: dict, age: float) -> int:
    """A lock file holding ``record``, flock-held here (a live holder, or an NFS lock daemon's stale lock)."""
    import fcntl
    import time

    path = os.path.join(save, LOCK_FILE)
    with open(path, "w") as f:
        json.dump(record, f)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.utime(path, (time.time() - age, time.time() - age))
    return fd


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


@pytest.mark.parametrize("case, taken", [("other_namespace", False), ("other_host", False), ("alive", False),
                                         ("fresh_heartbeat", False), ("dead_here", True)])
def test_a_held_lock_is_taken_over_only_when_its_holder_is_dead_for_certain(tmp_path, case, taken):
    """Host, boot, PID namespace, PID and heartbeat age: anything that cannot be judged is refused, naming the
    holder and why."""
    from megatron_cai.training.checkpoint.run_lock import STALE_AFTER_SECONDS, holder_record

    record = {**holder_record(), "pid": _dead_pid()}
    age = STALE_AFTER_SECONDS + 60
    if case == "other_namespace":
        record["pid_namespace"] = "pid:[1]"
    elif case == "other_host":
        record["host"] = "elsewhere"
    elif case == "alive":
        record["pid"] = os.getppid()
    elif case == "fresh_heartbeat":
        age = 1.0
    fd = _held_by_this_process(str(tmp_path), record, age)
    lines: list[str] = []
    try:
        if taken:
            RunLock.acquire(str(tmp_path), log=lines.append).release()
            assert len(lines) == 1 and "no longer exists" in lines[0], lines
        else:
            with pytest.raises(CheckpointError) as e:
                RunLock.acquire(str(tmp_path), log=lines.append)
            why = {"other_namespace": "another PID namespace", "other_host": "another host", "alive": "is alive",
                   "fresh_heartbeat": "heartbeat"}[case]
            assert f"process {record['pid']} on host {record['host']}" in str(e.value) and why in str(e.value)
            assert json.load(open(os.path.join(str(tmp_path), LOCK_FILE))) == record  # never rewritten
    finally:
        os.close(fd)


def test_the_holder_refreshes_its_heartbeat(tmp_path):
    import time

    lock = RunLock.acquire(str(tmp_path), heartbeat_seconds=0.05)
    try:
        path = os.path.join(str(tmp_path), LOCK_FILE)
        os.utime(path, (0, 0))
        t0 = time.time()
        while os.stat(path).st_mtime == 0 and time.time() - t0 < 10:
            time.sleep(0.02)
        assert os.stat(path).st_mtime > t0 - 1
    finally:
        lock.release()


def test_retention_keeps_an_iteration_another_job_is_loading(tmp_path):
    from megatron_cai.training.checkpoint.retention import remove_iteration
    from megatron_cai.training.checkpoint.run_dirs import IterationPin

    root = str(tmp_path)
    _published(root, 3, "x")
    pin = IterationPin.take(root, 3)
    lines: list[str] = []
    assert pin is not None and not remove_iteration(root, 3, lines.append)
    assert "another job is loading it" in lines[0] and os.path.isdir(run_dirs.iteration_dir(root, 3))
    pin.release()
    assert remove_iteration(root, 3, lines.append) and not os.path.exists(run_dirs.iteration_dir(root, 3))
    assert IterationPin.take(root, 3) is None

"""Temporary files of a dead run (core/datasets/temp_files.py): removed only when their PID is not a live
process; a zombie (dead, not yet reaped) counts as dead."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from megatron_cai.core.datasets.temp_files import pid_alive, remove_dead_temporaries


def _zombie() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    t0 = time.time()
    while time.time() - t0 < 30:  # exited, not reaped: state Z
        if open(f"/proc/{proc.pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0] == b"Z":
            return proc
        time.sleep(0.05)
    raise AssertionError("the child did not exit")


def test_only_dead_runs_temporaries_are_removed(tmp_path):
    zombie = _zombie()
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    target = str(tmp_path / "c_text_document.bin")
    names = {pid: f"{target}.tmp-{pid}" for pid in (os.getpid(), os.getppid(), zombie.pid, reaped.pid)}
    for path in [*names.values(), target + ".tmp-x", str(tmp_path / "other.bin.tmp-999999999")]:
        open(path, "w").close()
    try:
        assert pid_alive(os.getppid()) and not pid_alive(zombie.pid) and not pid_alive(reaped.pid)
        removed = remove_dead_temporaries(target)
    finally:
        zombie.wait()
    assert sorted(removed) == sorted([names[zombie.pid], names[reaped.pid]])
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (
        names[os.getpid()], names[os.getppid()], target + ".tmp-x", str(tmp_path / "other.bin.tmp-999999999")))

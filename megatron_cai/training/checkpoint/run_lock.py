"""One job per run directory: rank 0 holds an exclusive ``fcntl`` lock on ``--save`` for the job's life.

The lock file ``<save>/.megatron_cai.lock`` records who holds it (host, PID, start time, Slurm job ID,
command line). A second job on the same ``--save`` (a Slurm requeue overlapping the job it replaces, two
submissions of one script) is refused with one error naming the holder. The kernel drops the lock when
its process dies, however it dies; a lock file left by a dead process is taken over with one line
saying whose it was. A lock still held by a process that no longer exists on this host (a stale lock
of a network file system's lock daemon) is removed and taken over, also with a line. A clean exit
removes the file.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import time

from .file_io import CheckpointError

LOCK_FILE = ".megatron_cai.lock"
_HELD: dict[str, RunLock] = {}  # locks this process holds, by path (an earlier run in this process left it)


def _holder_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "command": " ".join(sys.argv)[:500]}


def describe_holder(record: dict | None) -> str:
    if not record:
        return "an unknown process (the lock file holds no record)"
    job = f", Slurm job {record['slurm_job_id']}" if record.get("slurm_job_id") else ""
    return f"process {record.get('pid')} on host {record.get('host')} (started {record.get('start_time')}{job})"


def _read_record(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 1 << 16).decode(errors="replace")
        record = json.loads(text) if text.strip() else None
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _dead_here(record: dict | None) -> bool:
    """Whether ``record`` names a process on this host that no longer exists."""
    if not record or record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class RunLock:
    """An acquired run lock; :meth:`release` (also run at exit) unlocks and removes the file."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd
        _HELD[os.path.realpath(path)] = self
        atexit.register(self.release)

    @classmethod
    def acquire(cls, save: str, log=print) -> RunLock:
        """Lock ``save`` for this process, or raise :class:`CheckpointError` naming the holder."""
        path = os.path.join(save, LOCK_FILE)
        earlier = _HELD.get(os.path.realpath(path))
        if earlier is not None:  # an earlier run in this process (a notebook, a test) ended without releasing
            earlier.release()
        for attempt in range(3):
            try:
                # held read-only: no open writer keeps the file system from being remounted read-only
                fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
            except OSError as e:
                raise CheckpointError(f"cannot create the run lock {path}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise CheckpointError(f"cannot lock {path}: {e.strerror}") from None
                record = _read_record(fd)
                os.close(fd)
                if _dead_here(record) and attempt == 0:  # held for a process that is gone: stale
                    log(f" the run lock {path} is held for {describe_holder(record)}, which no longer exists: "
                        f"removing the stale lock and taking it over")
                    os.remove(path)
                    continue
                raise CheckpointError(
                    f"--save {save} is in use by another job: {describe_holder(record)} holds {path}. Two jobs "
                    f"writing one run directory would mix their checkpoints; wait for that job to end (or stop "
                    f"it), or choose another --save") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the file was removed (a clean exit, a stale takeover) between open and lock
                os.close(fd)
                continue
            previous = _read_record(fd)
            if previous:
                log(f" taking over the run lock {path} left by {describe_holder(previous)}, which has ended")
            out = os.open(path, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(out, json.dumps(_holder_record()).encode())
                os.fsync(out)
            finally:
                os.close(out)
            return cls(path, fd)
        raise CheckpointError(f"cannot lock {path}: it keeps being replaced by another process")

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            os.remove(self.path)  # still locked: no other process can hold this file
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1
        _HELD.pop(os.path.realpath(self.path), None)
        atexit.unregister(self.release)

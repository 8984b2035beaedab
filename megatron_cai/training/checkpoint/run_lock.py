"""One job per run directory: rank 0 holds an exclusive ``fcntl`` lock on ``--save`` for the job's life.

The lock file ``<save>/.megatron_cai.lock`` records who holds it: host, PID, PID namespace
(``/proc/self/ns/pid``), boot ID, start time, Slurm job ID and command line; its modification time is a
heartbeat that the holder refreshes every ``HEARTBEAT_SECONDS``. A second job on the same ``--save`` (a Slurm
requeue overlapping the job it replaces, two submissions of one script) is refused with one error naming the
holder.

The lock file is never a write primitive: it is created by this process under a private name (``O_CREAT |
O_EXCL | O_NOFOLLOW``), filled with the record, locked, and only then hard-linked into place, so an existing
file is never opened for writing, let alone truncated. A lock path that is a symbolic link (or not a regular
file) is refused, naming its target; an existing lock file is opened with ``O_NOFOLLOW``.

Staleness: the kernel drops an ``flock`` when its process dies, however it dies, so a lock file nobody holds
was left by a job that ended: it is removed and taken over with one line saying whose it was. A lock that is
still held is taken over only when the holder can be judged dead for certain: same host, same boot, same PID
namespace, its PID gone, and its heartbeat older than ``STALE_AFTER_SECONDS`` (a stale lock of a network file
system's lock daemon). A holder on another host or in another PID namespace (a container) cannot be judged:
the lock is refused, naming it and its heartbeat's age. A clean exit removes the file.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import threading
import time

from .file_io import CheckpointError

LOCK_FILE = ".megatron_cai.lock"
HEARTBEAT_SECONDS = 30.0
STALE_AFTER_SECONDS = 4 * HEARTBEAT_SECONDS
_HELD: dict[str, RunLock] = {}  # locks this process holds, by path (an earlier run in this process left it)


def _read_first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip() or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def holder_record() -> dict:
    """Who this process is, as the lock file records it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_namespace": _pid_namespace(),
            "boot_id": _read_first_line("/proc/sys/kernel/random/boot_id"),
            "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "command": " ".join(sys.argv)[:500]}


def describe_holder(record: dict | None, heartbeat_age: float | None = None) -> str:
    if not record:
        return "an unknown process (the lock file holds no record)"
    job = f", Slurm job {record['slurm_job_id']}" if record.get("slurm_job_id") else ""
    beat = f", last heartbeat {heartbeat_age:.0f} s ago" if heartbeat_age is not None else ""
    return f"process {record.get('pid')} on host {record.get('host')} (started {record.get('start_time')}{job}{beat})"


def _read_record(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 1 << 16, 0).decode(errors="replace")
        record = json.loads(text) if text.strip() else None
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def why_not_dead(record: dict | None, heartbeat_age: float) -> str | None:
    """None when the holder named by ``record`` is dead for certain (see the module docstring), else why it
    cannot be judged so."""
    me = holder_record()
    if not record or not isinstance(record.get("pid"), int):
        return "the lock file holds no usable record"
    if record.get("host") != me["host"]:
        return f"it runs on another host ({record.get('host')}), where this job cannot see its processes"
    if record.get("boot_id") != me["boot_id"] or record.get("pid_namespace") != me["pid_namespace"]:
        return (f"it runs in another PID namespace ({record.get('pid_namespace')}, this job's is "
                f"{me['pid_namespace']}: another container), where PID {record['pid']} means another process")
    if _alive(record["pid"]):
        return f"PID {record['pid']} is alive"
    if heartbeat_age < STALE_AFTER_SECONDS:
        return f"its heartbeat is {heartbeat_age:.0f} s old (less than {STALE_AFTER_SECONDS:.0f} s)"
    return None


def _refuse_link(path: str) -> None:
    """A lock path that is a symbolic link or not a regular file is refused (never followed, never written)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"the run lock {path} is a symbolic link (to {os.readlink(path)}): refusing to follow "
                              f"it (a lock must never write through a link); remove the link")
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"the run lock {path} is not a regular file: remove it")


def _create(path: str) -> int | None:
    """A new lock file at ``path`` holding this process's record, locked by the returned descriptor; None when
    ``path`` exists. The record is written to a private file that is linked into place only once locked."""
    private = f"{path}.{socket.gethostname()}.{os.getpid()}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        os.unlink(private)  # our own leftover (this host and PID) from a killed run
    except FileNotFoundError:
        pass
    writer = os.open(private, flags, 0o644)
    fd = -1
    try:
        os.write(writer, json.dumps(holder_record()).encode())
        os.fsync(writer)
        # Hold the lock on a read-only descriptor: a descriptor open for writing for the job's life would keep
        # the file system from being remounted read-only (and the heartbeat's futimens needs no write mode).
        fd = os.open(private, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.close(writer)
        writer = -1
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.link(private, path)
        except FileExistsError:
            os.close(fd)
            return None
        return fd
    except BaseException:
        for f in (writer, fd):
            if f >= 0:
                try:
                    os.close(f)
                except OSError:
                    pass
        raise
    finally:
        os.unlink(private)


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.lstat(path).st_ino
    except FileNotFoundError:
        return False


class RunLock:
    """An acquired run lock; :meth:`release` (also run at exit) stops the heartbeat, unlocks and removes the
    file."""

    def __init__(self, path: str, fd: int, heartbeat_seconds: float = HEARTBEAT_SECONDS) -> None:
        self.path, self.fd = path, fd
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_seconds,), daemon=True,
                                      name="run-lock-heartbeat")
        self._beat.start()
        _HELD[os.path.realpath(path)] = self
        atexit.register(self.release)

    def _heartbeat(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                os.utime(self.fd)
            except OSError:
                pass

    @classmethod
    def acquire(cls, save: str, log=print, heartbeat_seconds: float = HEARTBEAT_SECONDS) -> RunLock:
        """Lock ``save`` for this process, or raise :class:`CheckpointError` naming the holder."""
        path = os.path.join(save, LOCK_FILE)
        earlier = _HELD.get(os.path.realpath(path))
        if earlier is not None:  # an earlier run in this process (a notebook, a test) ended without releasing
            earlier.release()
        for _ in range(3):
            _refuse_link(path)
            try:
                fd = _create(path)
            except OSError as e:
                raise CheckpointError(f"cannot create the run lock {path}: {e.strerror}") from None
            if fd is not None:
                return cls(path, fd, heartbeat_seconds)
            cls._clear_stale(path, save, log)
        raise CheckpointError(f"cannot lock {path}: it keeps being replaced by another process")

    @staticmethod
    def _clear_stale(path: str, save: str, log) -> None:
        """``path`` exists: remove it when its holder has ended (or is dead for certain), else refuse."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # released meanwhile: try again
        except OSError as e:
            _refuse_link(path)
            raise CheckpointError(f"cannot open the run lock {path}: {e.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"the run lock {path} is not a regular file: remove it")
            record = _read_record(fd)
            age = max(0.0, time.time() - os.fstat(fd).st_mtime)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = False
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(f"cannot lock {path}: {e.strerror}") from None
                held = True
            if not held and not _alive_here(record or {}):  # its holder ended: the kernel dropped the lock
                if _same_file(fd, path):
                    log(f" taking over the run lock {path} left by {describe_holder(record, age)}, which has ended")
                    os.unlink(path)
                return
            reason = why_not_dead(record, age) if held else f"PID {record['pid']} is alive"
            if reason is None:
                if _same_file(fd, path):
                    log(f" the run lock {path} is held for {describe_holder(record, age)}, which no longer exists: "
                        f"removing the stale lock and taking it over")
                    os.unlink(path)
                return
            raise CheckpointError(
                f"--save {save} is in use by another job: {describe_holder(record, age)} holds {path} ({reason}). Two "
                f"jobs writing one run directory would mix their checkpoints; wait for that job to end (or stop "
                f"it), or choose another --save") from None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self.fd < 0:
            return
        self._stop.set()
        if _same_file(self.fd, self.path):  # still ours and still locked: no other process can hold it
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self.fd)
        self.fd = -1
        _HELD.pop(os.path.realpath(self.path), None)
        atexit.unregister(self.release)


def _alive_here(record: dict) -> bool:
    """Whether ``record`` names a live process of this host, boot and PID namespace (a lock file being created
    without ``flock`` yet, on a file system without hard links, or a holder whose lock the NFS daemon lost)."""
    me = holder_record()
    same = all(record.get(k) == me[k] for k in ("host", "boot_id", "pid_namespace"))
    return same and isinstance(record.get("pid"), int) and record["pid"] != os.getpid() and _alive(record["pid"])


def lock_holder(directory: str) -> str | None:
    """Who holds the run lock of ``directory`` now (a job saving into it), or None when nobody does."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it exclusively
    except OSError:
        return describe_holder(_read_record(fd))
    finally:
        os.close(fd)

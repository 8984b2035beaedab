"""Run a function in N CPU processes joined by a gloo process group (tests and benchmarks).

Usage in a test::

    def _worker(rank, world_size, tmp):       # module-level so it pickles
        ...                                    # torch.distributed is initialised here
        return some_picklable_result

    results = run_distributed(_worker, world_size=4, args=(tmp,))   # list indexed by rank
"""
from __future__ import annotations

import atexit
import io
import os
import queue as queue_mod
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import forkserver, reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports anyway: loaded once in the fork server, so a rank starts in a fraction of a second
# instead of importing torch afresh (spawn), which dominated the short multi-process tests on 2 cores.
_PRELOAD = ["torch", "torch.distributed", "megatron_cai.training.training"]


# The fork server's own stdout / stderr: what a rank prints before it takes over the test's (a failure to
# unpickle its arguments, say) lands here, and a rank that dies that way is reported with this file's tail.
_SERVER_LOG = os.path.join(tempfile.gettempdir(), f"megatron-cai-forkserver-{os.getpid()}.log")


def _remove_empty_log() -> None:
    try:
        if os.path.getsize(_SERVER_LOG) == 0:
            os.remove(_SERVER_LOG)
    except OSError:
        pass


def _context():
    """``forkserver`` with :data:`_PRELOAD` imported in the server (its own process, never the test's), started
    (once, or again if it died) with its output going to :data:`_SERVER_LOG`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    if not os.path.exists(_SERVER_LOG):
        atexit.register(_remove_empty_log)  # a log the server never wrote to is not left behind
    log = os.open(_SERVER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        forkserver.ensure_running()  # a no-op once it runs: the server keeps the output it started with
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)
    return ctx


def _server_log_tail(nbytes: int = 4000) -> str:
    try:
        with open(_SERVER_LOG, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class _ParentFd:
    """One of the parent's file descriptors, handed to a forked rank (the fork server's own stdout / stderr
    are those of when it started, not the test's current capture)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, base: dict, env: dict,
           out_fd: int, err_fd: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)  # the rank prints where the test's own output goes now, as a spawned rank would
    os.dup2(err_fd, 2)
    os.environ.clear()  # the parent's environment now, as spawn would give it (not the server's, older)
    os.environ.update(base)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", _to_bytes(result)))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from megatron_cai.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:  # noqa: BLE001
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit._run_exitfuncs()  # a forked rank ends in os._exit: run what a spawned one would (run locks, writers)


def _to_bytes(obj: Any) -> bytes:
    """Serialise a result with torch.save: tensors travel as bytes, not as shared-memory handles that
    vanish when the rank exits before the parent has opened them (FileNotFoundError under load)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def run_distributed(fn: Callable, world_size: int, args: tuple = (), env: dict | None = None,
                    timeout: float = 600.0) -> list[Any]:
    """Start `world_size` gloo ranks running `fn(rank, world_size, *args)`; return their results by rank.

    Ranks fork from a server that has imported torch and the package: a fresh process each, as with spawn
    (the test's current environment, stdout and stderr; atexit handlers at the end), in a fraction of the time.

    Any exception in a rank fails the test with that rank's traceback; a hang fails after `timeout` s.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    base = dict(os.environ)
    fds = (_ParentFd(1), _ParentFd(2))  # what a spawned rank inherits
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, base, env or {}, *fds))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.time() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"rank(s) {dead} died with exit code(s) {[procs[r].exitcode for r in dead]}; "
                                  f"the fork server's output ({_SERVER_LOG}) ends:\n{_server_log_tail()}")
                elif time.time() > deadline:
                    errors.append(f"timed out after {timeout} s waiting for ranks "
                                  f"{sorted(set(range(world_size)) - set(results))}")
                continue
            if status == "error":
                errors.append(f"rank {rank} failed:\n{payload}")
                break
            results[rank] = _from_bytes(payload)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.terminate()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]

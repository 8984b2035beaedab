"""Run a function in N CPU processes joined by a gloo process group (the distributed test harness).

Usage in a test::

    def _worker(rank, world_size, tmp):       # module-level so it pickles
        ...                                    # torch.distributed is initialised here
        return some_picklable_result

    results = run_distributed(_worker, world_size=4, args=(tmp,))   # list indexed by rank
"""
from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, env: dict) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
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


def run_distributed(fn: Callable, world_size: int, args: tuple = (), env: dict | None = None,
                    timeout: float = 600.0) -> list[Any]:
    """Spawn `world_size` gloo ranks running `fn(rank, world_size, *args)`; return their results by rank.

    Any exception in a rank fails the test with that rank's traceback; a hang fails after `timeout` s.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, env or {}))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank} failed:\n{payload}")
                break
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.terminate()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]

"""A rank waiting for its peers says so: world size, rank and master address, every 30 s.

``MEGATRON_CAI_WAIT_LOG_SECONDS`` changes the interval (tests use 1 s).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

from .errors import safe_print

DEFAULT_INTERVAL_S = 30.0


def waiting_line(rank: int, world_size: int, waited_s: float, environ=None) -> str:
    env = os.environ if environ is None else environ
    master = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return (f" [rank {rank}] waiting for the other ranks to join: world size {world_size}, rank {rank}, "
            f"master address {master} ({waited_s:.0f} s so far)")


@contextlib.contextmanager
def log_while_waiting(rank: int, world_size: int, interval_s: float | None = None) -> Iterator[None]:
    """Log ``waiting_line`` every ``interval_s`` seconds on stderr until the block finishes."""
    if interval_s is None:
        interval_s = float(os.environ.get("MEGATRON_CAI_WAIT_LOG_SECONDS", DEFAULT_INTERVAL_S))
    stop = threading.Event()
    start = time.time()

    def loop() -> None:
        while not stop.wait(interval_s):
            safe_print(waiting_line(rank, world_size, time.time() - start), file=sys.stderr)

    thread = threading.Thread(target=loop, name="rendezvous-log", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()

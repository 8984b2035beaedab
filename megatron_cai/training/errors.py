"""Known errors print one ``error: ...`` line and exit 2; unknown errors keep their traceback.

A *known* error is one the user can act on: bad flags, bad data, a bad or incompatible checkpoint, an
impossible parallel layout, a diverged run. Every such class of ``training/`` derives from
:class:`UserError` (``ArgumentError``, ``CheckpointError``, ``ConversionError``, ``DataError``,
``DivergenceError``); ``core/`` knows nothing of ``training/``, so its three (``IndexedDatasetError``,
``ParallelLayoutError``, ``TreeFormatError``) are named in :data:`KNOWN_ERRORS`. ``run_cli(main)`` wraps an entry point:

- an error every rank finds alike (flags, layout, data, divergence) is printed by rank 0; the other ranks wait
  for its report (``PEER_REPORT_GRACE_S``; the process group's store says when it is out) and print it
  themselves if it does not come, so that no rank's exit can make torchrun stop rank 0 before the report is out;
- an error only some ranks find (their own checkpoint file: ``RankLocalError``) is printed by each such
  rank, prefixed with ``[rank R]``;
- either way the process exits with status 2 and no traceback. Anything else propagates unchanged.

``exit_process(main)`` ends an entry point's process with ``main``'s status. A distributed process that
fails leaves without interpreter finalization (after its ``atexit`` handlers, e.g. the run lock's): a
process group that was never destroyed can abort the process while the interpreter is torn down
(``terminate called without an active exception``: gloo's worker threads still hold tensors), turning a
clean ``error:`` exit 2 into a SIGABRT. Destroying the group instead could hang on a peer that is gone.

``safe_print`` is the log writer for paths that must not fail (checkpoint saves, preemption): a closed
stdout (``BrokenPipeError``) silences further output instead of aborting the caller.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from ..core.datasets.indexed_dataset import IndexedDatasetError
from ..core.datasets.tree_format import TreeFormatError
from ..core.parallel_state import ParallelLayoutError

EXIT_KNOWN_ERROR = 2
# Set by training.initialize once its heartbeats run: which rank stopped answering (for a timed-out collective).
timeout_diagnosis: Callable[[], str] | None = None


class UserError(Exception):
    """Base of the errors the user can fix (a flag, a file, the data): one ``error:`` line, exit 2."""


class RankLocalError(UserError, RuntimeError):
    """Raised by the rank that found the problem (e.g. its own checkpoint file): reported with its rank."""


class DataError(UserError, ValueError):
    """The training data cannot be used as given (empty corpus, token ids outside the vocabulary)."""


KNOWN_ERRORS: tuple[type[BaseException], ...] = (UserError, IndexedDatasetError, ParallelLayoutError, TreeFormatError)


def _distributed_initialized() -> bool:
    """Whether torch.distributed has a default group (best effort while reporting another error)."""
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except Exception:  # noqa: BLE001
        return False


def current_rank() -> int:
    """This process's global rank (from torch.distributed, else the launcher's environment)."""
    if _distributed_initialized():
        import torch.distributed as dist

        return dist.get_rank()
    for var in ("RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def world_size() -> int:
    if _distributed_initialized():
        import torch.distributed as dist

        return dist.get_world_size()
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def format_known_error(exc: BaseException, rank: int, world: int) -> str | None:
    """The line this rank prints for a known error, or None when another rank reports it."""
    message = str(exc).strip() or type(exc).__name__
    if isinstance(exc, RankLocalError):
        return f"error: [rank {rank}] {message}" if world > 1 else f"error: {message}"
    return f"error: {message}" if rank == 0 else None


# How long a rank other than 0 waits for rank 0's report of an error every rank finds alike. A rank that exits
# first would have torchrun stop rank 0, perhaps before it printed; so no rank exits before the report is out.
# With the process group up, rank 0 marks its report in the group's store and the others leave silently once it
# is there; before (a flag error), rank 0 prints and exits and the launcher stops the waiting ranks. A waiting rank
# that sees no report within the grace prints it itself.
PEER_REPORT_GRACE_S = 5.0
_REPORTED_KEY = "megatron_cai/error_reported"
_SEEN_KEY = "megatron_cai/error_report_seen"  # how many other ranks saw the mark: rank 0 (the store's host) stays
# until they all have, or the grace is over, so that a waiting rank never loses the store and prints a second line


def _default_store():
    """The default process group's store (None before torch.distributed is initialised)."""
    if not _distributed_initialized():
        return None
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - reporting another error: never fail here
        return None


def _rank0_reported(grace_s: float) -> bool:
    """Whether rank 0 marked its report within ``grace_s`` (False after sleeping the grace without a store)."""
    store = _default_store()
    if store is None:
        time.sleep(grace_s)
        return False
    try:
        import datetime

        store.wait([_REPORTED_KEY], datetime.timedelta(seconds=grace_s))
    except Exception:  # noqa: BLE001 - timed out, or rank 0 (the store's host) is gone
        return False
    try:
        store.add(_SEEN_KEY, 1)
    except Exception:  # noqa: BLE001 - rank 0 left already: it printed
        pass
    return True


def _wait_until_peers_saw_the_report(store, peers: int, grace_s: float) -> None:
    """Rank 0, after marking its report: keep the store up until ``peers`` ranks saw the mark (or the grace)."""
    deadline = time.monotonic() + grace_s
    try:
        while store.add(_SEEN_KEY, 0) < peers and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - reporting another error: never fail here
        pass


def report_known_error(exc: BaseException) -> int:
    """Print this rank's line for a known error (see :func:`format_known_error`). Rank 0 prints and marks the
    report; a rank whose line rank 0 prints waits up to :data:`PEER_REPORT_GRACE_S` for that mark and prints the
    line itself when it does not come."""
    rank, world = current_rank(), world_size()
    line = format_known_error(exc, rank, world)
    if line is None:
        if _rank0_reported(PEER_REPORT_GRACE_S):
            return EXIT_KNOWN_ERROR
        line = format_known_error(exc, 0, world)
    safe_print(line, file=sys.stderr)
    if rank == 0 and (store := _default_store()) is not None:
        try:
            store.set(_REPORTED_KEY, "1")
        except Exception:  # noqa: BLE001
            return EXIT_KNOWN_ERROR
        if not isinstance(exc, RankLocalError):  # every rank found it: the others wait for this mark
            _wait_until_peers_saw_the_report(store, world - 1, PEER_REPORT_GRACE_S)
    return EXIT_KNOWN_ERROR


def _peer_lost(exc: BaseException) -> bool:
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


def _timed_out(exc: BaseException) -> bool:
    text = str(exc)
    return any(s in text for s in ("Timed out", "timed out", "Timeout", "timeout"))


def run_cli(main: Callable[[], int], known: tuple[type[BaseException], ...] = KNOWN_ERRORS) -> int:
    """Run ``main``; a ``known`` error (or any :class:`UserError`) prints one line (see the module docstring)
    and returns 2.

    A rank whose collective fails because a peer rank already exited (after printing its own error)
    prints one line saying so instead of a traceback, and returns 1.
    """
    try:
        return main()
    except known + (UserError,) as e:
        return report_known_error(e)
    except RuntimeError as e:
        if world_size() > 1 and _timed_out(e):
            who = timeout_diagnosis() if timeout_diagnosis is not None else "the rank that stopped is not known"
            safe_print(f"error: [rank {current_rank()}] a collective timed out (--distributed-timeout-minutes): "
                       f"{who}; stopping ({str(e).splitlines()[0][-160:]})", file=sys.stderr)
            return EXIT_KNOWN_ERROR
        if world_size() > 1 and _peer_lost(e):
            safe_print(f"[rank {current_rank()}] stopping: a peer rank exited ({str(e).splitlines()[0][:200]})",
                       file=sys.stderr)
            return 1
        raise


def exit_process(main: Callable[[], int]) -> NoReturn:
    """Exit with ``main()``'s status (an escaped exception: its traceback, status 1); see the module docstring."""
    try:
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the same exit
        traceback.print_exc()
        code = 1
    if code == 0 or not _distributed_initialized():
        sys.exit(code)
    atexit._run_exitfuncs()  # the run lock, compile workers, ... while the interpreter is whole
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def safe_print(msg: str, file=None) -> None:
    """``print(msg, flush=True)`` that never raises: a closed stream is replaced by /dev/null."""
    stream = file if file is not None else sys.stdout
    try:
        print(msg, file=stream, flush=True)
    except (BrokenPipeError, ValueError, OSError):  # closed pipe / closed file / EIO on a dead terminal
        for name in ("stdout", "stderr"):
            if getattr(sys, name) is stream:
                try:
                    setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process
                except OSError:
                    pass

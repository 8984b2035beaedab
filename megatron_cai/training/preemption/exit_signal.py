"""SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 (Slurm's preemption warning) ask for a checkpoint and a clean exit.

The handler is installed before anything slow happens: ``pretrain_gpt.py`` calls :func:`install` before it
imports torch, and again as the first line of ``main``. It only records the signal. What follows is decided
once for every rank:

- during start-up (flags, checkpoint load, dataset build) the job stops before its first iteration, saves
  nothing and exits 0; a loaded checkpoint is left as it was (``Trainer.train``, one collective);
- during training the request travels in the step's one read-back (``step_readback.read_step``): every
  rank saves at the same iteration and exits 0.

A launcher that must survive SIGUSR1 (``megatron_cai.training.preemption.torchrun``) starts its workers with the
signal blocked; :func:`install` unblocks it after its handler is in place, so a signal that arrived in
between is delivered then, not lost and not fatal.

``--no-exit-signal-handler`` gives the default dispositions back (:func:`handling`); a signal recorded
before the flags were read is then re-raised, so the process ends as it would have without a handler.

No torch import here: this module runs before torch is loaded.
"""
from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

_previous: dict[int, object] | None = None  # the handlers replaced by install(); None while not installed
_received: int | None = None  # the first exit signal recorded


def _record(signum: int, frame) -> None:
    global _received
    if _received is None:
        _received = signum


def install() -> bool:
    """Record SIGTERM / SIGINT / SIGUSR1 from now on (idempotent); False outside the main thread."""
    global _previous
    if _previous is not None:
        return True
    try:
        previous = {sig: signal.signal(sig, _record) for sig in EXIT_SIGNALS}
    except ValueError:  # not the main thread: signals stay as they are
        return False
    _previous = previous
    signal.pthread_sigmask(signal.SIG_UNBLOCK, EXIT_SIGNALS)  # one left pending by the launcher arrives now
    return True


def uninstall() -> None:
    """Give back the handlers that :func:`install` replaced and forget any recorded signal."""
    global _previous, _received
    if _previous is None:
        return
    for sig, handler in _previous.items():
        signal.signal(sig, handler)
    _previous, _received = None, None


def installed() -> bool:
    return _previous is not None


def received() -> str | None:
    """The name of the first exit signal recorded (``"SIGUSR1"``), or None."""
    return signal.Signals(_received).name if _received is not None else None


@contextlib.contextmanager
def handling(enabled: bool) -> Iterator[None]:
    """A run's exit-signal handling (``--exit-signal-handler``, on by default).

    ``enabled``: install it unless ``main`` already did, and give the previous handlers back after the run
    when it was installed here (a library caller keeps its own Ctrl-C). Not ``enabled``: the default
    dispositions, and a signal already recorded takes its default action now."""
    if not enabled:
        pending = _received
        uninstall()
        if pending is not None:
            signal.raise_signal(pending)
        yield
        return
    mine = not installed() and install()
    try:
        yield
    finally:
        if mine:
            uninstall()

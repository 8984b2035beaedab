"""torchrun that survives SIGUSR1 and hands it to its workers (Slurm's ``--signal=USR1@N``, ``scancel --signal=USR1``).

    python -m megatron_cai.training.preemption.torchrun --nnodes 2 --nproc-per-node 8 ... pretrain_gpt.py FLAGS...

Slurm signals every process of a job step, torchrun's agent included, and torchrun has no SIGUSR1 handler:
it dies of the signal (``FAILED 10:0``) while its workers save. This launcher is torchrun with SIGUSR1
blocked from its first line: the agent never sees it, every thread and every worker inherits the block,
and a thread here takes each SIGUSR1 (``sigwait``) and forwards it to the workers, which torchrun starts in
sessions of their own (a ``proctrack/pgid`` Slurm would not reach them); one that arrives before the
workers exist (imports, rendezvous) is forwarded when they appear. One worker that has it is enough: the
ranks decide on it together. A worker keeps the signal pending until ``pretrain_gpt.py`` has installed its
handler (``training.preemption.exit_signal``), so a signal during the workers' start-up is neither lost
nor fatal. Everything else is torchrun's (``torch.distributed.run``).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

FORWARDED = signal.SIGUSR1


def child_pids(parent: int, proc: str = "/proc") -> list[int]:
    """The processes whose parent is ``parent`` (from ``/proc/*/stat``)."""
    pids = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:  # the field after the state: the parent's pid
            pids.append(int(name))
    return pids


def _forward_forever(poll_s: float = 0.2) -> None:
    """After the first SIGUSR1, every child of this launcher gets it once, also the ones that start later: the
    workers (torchrun starts them after its imports and the rendezvous) and short-lived helpers (a helper
    that dies of it is harmless). A further SIGUSR1 goes to every child again."""
    signal.sigwait({FORWARDED})
    told: set[int] = set()
    while True:
        for pid in set(child_pids(os.getpid())) - told:
            try:
                os.kill(pid, FORWARDED)
            except ProcessLookupError:
                pass
            told.add(pid)
        if signal.sigtimedwait({FORWARDED}, poll_s) is not None:
            told.clear()


def main() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {FORWARDED})  # before any thread or worker exists
    threading.Thread(target=_forward_forever, name="forward-sigusr1", daemon=True).start()
    from torch.distributed.run import main as torchrun_main

    sys.exit(torchrun_main())


if __name__ == "__main__":
    main()

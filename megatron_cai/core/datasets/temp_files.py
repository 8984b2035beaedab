"""Temporary files of the corpus writers: ``<path>.tmp-<PID>``, and the removal of those a dead run left.

Every writer of a ``.bin``, ``.idx`` or ``.tree`` writes ``<path>.tmp-<PID>`` and renames it into place, so a
reader never sees a partial file. A process killed with SIGKILL (or a lost node) cannot remove its own
temporaries; the next run for the same output removes every ``<path>.tmp-<PID>`` whose PID is not a live
process on this host. The PID is judged on this host only: on a file system shared between hosts, do not
start a second run for the same output while a run on another host is writing it.
"""
from __future__ import annotations

import glob
import os
import re

_SUFFIX = re.compile(r"\.tmp-(\d+)$")


def temp_path(path: str) -> str:
    """This process's temporary name for ``path``."""
    return f"{path}.tmp-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process on this host (a zombie, already dead, is not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: the signal test said it exists


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def remove_dead_temporaries(path: str) -> list[str]:
    """Remove ``<path>.tmp-<PID>`` files whose PID is not alive; return what was removed."""
    removed = []
    for tmp in glob.glob(glob.escape(path) + ".tmp-*"):
        m = _SUFFIX.search(tmp)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            remove_quietly(tmp)
            removed.append(tmp)
    return removed

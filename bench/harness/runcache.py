"""One JSON file per finished (configuration, seed), so that a long seed-repeated bench resumes where it stopped.

Several processes may share one cache (e.g. one per seed, to use more cores): a run being computed holds
``NAME.lock`` (its process id); ``try_run`` skips it (returns None), ``run_all`` comes back to it later.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable


def settings_key(settings: dict) -> str:
    """A short hash of the settings a cached run depends on."""
    return hashlib.md5(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]


class RunCache:
    """Finished runs under ``root/key``; ``key`` names the settings (see the module docstring)."""

    def __init__(self, root: str, key: str) -> None:
        self.dir = os.path.join(root, key)
        os.makedirs(self.dir, exist_ok=True)

    def _path(self, name: str, seed: int) -> str:
        slug = "".join(ch if ch.isalnum() else "_" for ch in name)
        return os.path.join(self.dir, f"{slug}__seed{seed}.json")

    def try_run(self, name: str, seed: int, fn: Callable[[], dict]) -> dict | None:
        """The cached result, else ``fn()`` (then cached); None while another live process computes it."""
        path = self._path(name, seed)
        while True:
            if os.path.exists(path):
                with open(path) as f:
                    return json.load(f)
            try:
                fd = os.open(path + ".lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if _lock_alive(path + ".lock"):
                    return None
                _remove(path + ".lock")  # its process died: take it over
                continue
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            try:
                out = fn()
                with open(path + f".tmp{os.getpid()}", "w") as f:
                    json.dump(out, f)
                os.replace(path + f".tmp{os.getpid()}", path)
                return out
            finally:
                _remove(path + ".lock")

    def get_or_run(self, name: str, seed: int, fn: Callable[[], dict]) -> dict:
        """The cached result, else ``fn()``; waits while another process computes it."""
        while (out := self.try_run(name, seed, fn)) is None:
            time.sleep(5)
        return out

    def run_all(self, items: list[tuple[str, int, Callable[[], dict]]],
                report: Callable[[str, int, dict], None] | None = None) -> dict[str, dict[str, dict]]:
        """{name: {str(seed): result}} of every (name, seed, fn); runs held by other processes come last."""
        out: dict[str, dict[str, dict]] = {}
        pending = list(items)
        while pending:
            later = []
            for name, seed, fn in pending:
                res = self.try_run(name, seed, fn)
                if res is None:
                    later.append((name, seed, fn))
                    continue
                out.setdefault(name, {})[str(seed)] = res
                if report:
                    report(name, seed, res)
            if later and len(later) == len(pending):
                time.sleep(5)
            pending = later
        return {name: out[name] for name in dict.fromkeys(n for n, _, _ in items)}


def _lock_alive(lock: str) -> bool:
    try:
        with open(lock) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return True  # being written right now
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass

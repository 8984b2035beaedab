"""Count the tensor methods that read device values back to the host (tests and benchmarks).

``Tensor.item``, ``__bool__``, ``tolist``, ``cpu`` and ``numpy`` are patched while a
:class:`HostSyncCounter` is installed; on an accelerator each call waits for the queued work (a host
synchronisation), on the CPU the same calls mark where a GPU run would wait. ``where`` keeps the caller
of each counted call (file:line), to say which one a test did not expect.
"""
from __future__ import annotations

import sys
from collections import Counter

import torch

METHODS = ("item", "__bool__", "tolist", "cpu", "numpy")


class HostSyncCounter:
    """Counts calls of :data:`METHODS` on tensors between :meth:`install` and :meth:`uninstall`."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.where: Counter[str] = Counter()
        self._originals: dict[str, object] = {}
        self._inside = False  # a counted method calling another (cpu() inside numpy()) counts once

    def install(self) -> HostSyncCounter:
        for name in METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def counted(t, *args, _original=original, _name=name, **kwargs):
                if self._inside:
                    return _original(t, *args, **kwargs)
                self._inside = True
                try:
                    self.calls[_name] += 1
                    caller = sys._getframe(1)
                    self.where[f"{caller.f_code.co_filename}:{caller.f_lineno}"] += 1
                    return _original(t, *args, **kwargs)
                finally:
                    self._inside = False

            setattr(torch.Tensor, name, counted)
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals = {}

    def total(self) -> int:
        return sum(self.calls.values())

    def reset(self) -> None:
        self.calls.clear()
        self.where.clear()

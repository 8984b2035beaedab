"""Micro-batches copied to the device one step ahead, so the host-to-device copy overlaps the step.

``DevicePrefetcher(iterator, device).take(n)`` returns the next ``n`` micro-batches on the device and at
once starts copying the ``n`` after them (the next iteration's, at the same batch size), so by the time
the loop asks for them they are (nearly) there. On an accelerator the copies run on a side stream from
pinned host memory (the data loader's ``pin_memory``); the compute stream waits for a batch's copy only
when it is handed over, and each tensor is marked as used there (``record_stream``), so the allocator
never reuses it early. On the CPU the "copy" is the identity and nothing is read ahead: reading the
loader early would only move the same work.

Reading ahead never changes what a step sees or the resume point (checkpoints count consumed samples in
the loop, not in the iterator). An exhausted iterator is reported only when a batch it could not give is
taken.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import torch

Batch = dict[str, torch.Tensor]


class DevicePrefetcher:
    """Hands out micro-batches on ``device``; copies of the next ones run ahead on a side stream.

    ``lookahead``: read ahead at all (default: on accelerators only). ``copy`` (tests): how one host
    batch becomes a device batch (default ``tensor.to(device, non_blocking=True)`` on the side stream).
    """

    def __init__(self, iterator: Iterator[Batch], device: torch.device, *, lookahead: bool | None = None,
                 copy: Callable[[Batch], Batch] | None = None) -> None:
        self.iterator, self.device = iterator, torch.device(device)
        accelerator = self.device.type not in ("cpu", "meta")
        self.lookahead = accelerator if lookahead is None else lookahead
        self._stream = torch.Stream(self.device) if accelerator else None
        self._copy = copy or self._to_device
        self._ready: deque[tuple[Batch, object]] = deque()  # (device batch, copy-done event or None)
        self._exhausted = False

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _start(self, count: int) -> None:
        """Start copying up to ``count`` more batches (fewer when the iterator runs out)."""
        for _ in range(count):
            if self._exhausted:
                return
            try:
                host = next(self.iterator)
            except StopIteration:
                self._exhausted = True
                return
            if self._stream is None:
                self._ready.append((self._copy(host), None))
                continue
            with self._stream:
                batch = self._copy(host)
                done = self._stream.record_event()
            self._ready.append((batch, done))

    def _hand_over(self, batch: Batch, done) -> Batch:
        if done is not None:
            current = torch.accelerator.current_stream(self.device)
            current.wait_event(done)
            for t in batch.values():
                t.record_stream(current)
        return batch

    def take(self, n: int) -> list[Batch]:
        """The next ``n`` micro-batches on the device (raises StopIteration if the data runs out first);
        with lookahead, the copies of the following ``n`` are started before this returns."""
        self._start(n - len(self._ready))
        if len(self._ready) < n:
            raise StopIteration
        out = [self._hand_over(*self._ready.popleft()) for _ in range(n)]
        if self.lookahead:
            self._start(n - len(self._ready))
        return out

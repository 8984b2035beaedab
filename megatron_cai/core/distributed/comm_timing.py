"""Phase timers for the gradient reduction of every bucket (``--timing-log-level``).

Megatron's ``--timing-log-level`` spirit: level 0 records nothing and costs nothing (a shared no-op
context); level 1 and up record, per bucket, the time of each phase of the reduction:

    encode | all-to-all | decode-accumulate | owner re-encode | all-gather | decode
    (hierarchical also: intra-node reduce-scatter | intra-node all-gather)

On CPU a phase is wall-clock time on the host (for an asynchronous collective: the time the host spent
issuing it plus the time it blocked waiting for it, i.e. the exposed communication). On an accelerator
it is the time between two timing events recorded on the stream that runs the phase; ``collect()``
then synchronises once per logged iteration (only when timing is on).

``collect()`` returns and clears what was recorded since the last call (totals, in ms):
``{"phases": {phase: ms}, "buckets": {bucket_index: {phase: ms}}}``; callers divide by the number of
iterations it covers.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

PHASES = ("intra reduce-scatter", "encode", "all-to-all", "decode-accumulate", "owner re-encode", "all-gather",
          "decode", "intra all-gather")

_NULL = contextlib.nullcontext()


class PhaseTimers:
    """Per-bucket, per-phase timers; a no-op unless ``level >= 1``."""

    def __init__(self, level: int = 0, device: torch.device | None = None) -> None:
        self.level = level
        self.device = device if device is not None else torch.device("cpu")
        self._host: dict[tuple[int, str], float] = {}
        self._events: list[tuple[int, str, torch.Event, torch.Event]] = []

    @property
    def enabled(self) -> bool:
        return self.level >= 1

    def phase(self, bucket: int, name: str):
        """Context manager timing `name` for bucket `bucket` (a shared no-op when disabled)."""
        if self.level < 1:
            return _NULL
        return self._timed(bucket, name)

    @contextlib.contextmanager
    def _timed(self, bucket: int, name: str) -> Iterator[None]:
        if self.device.type == "cpu":
            t0 = time.perf_counter()
            yield
            key = (bucket, name)
            self._host[key] = self._host.get(key, 0.0) + 1000.0 * (time.perf_counter() - t0)
            return
        start = torch.Event(self.device, enable_timing=True)
        end = torch.Event(self.device, enable_timing=True)
        start.record()
        yield
        end.record()
        self._events.append((bucket, name, start, end))

    def collect(self) -> dict:
        """Milliseconds per phase (and per bucket and phase) recorded since the last call; clears them."""
        per_bucket: dict[int, dict[str, float]] = {}
        for (b, name), ms in self._host.items():
            per_bucket.setdefault(b, {})[name] = per_bucket.get(b, {}).get(name, 0.0) + ms
        for b, name, start, end in self._events:
            end.synchronize()
            per_bucket.setdefault(b, {})[name] = per_bucket.get(b, {}).get(name, 0.0) + start.elapsed_time(end)
        phases: dict[str, float] = {}
        for times in per_bucket.values():
            for name, ms in times.items():
                phases[name] = phases.get(name, 0.0) + ms
        out = {"phases": {p: phases[p] for p in PHASES if p in phases}, "buckets": per_bucket}
        self._host, self._events = {}, []
        return out


def timing_log_lines(iteration: int, timings: list[dict], level: int, iters: int) -> list[str]:
    """Megatron-style timer lines: ms per iteration (over `iters`) of each phase, summed over chunks."""
    steps = max(iters, 1)
    phases: dict[str, float] = {}
    for t in timings:
        for name, ms in t["phases"].items():
            phases[name] = phases.get(name, 0.0) + ms / steps
    if not phases:
        return []
    lines = [f" gradient reduction phases at iteration {iteration} (ms per iteration, this rank):"]
    lines += [f"    {name} {'.' * max(40 - len(name), 2)}: {ms:.3f}" for name, ms in phases.items()]
    lines.append(f"    total {'.' * 35}: {sum(phases.values()):.3f}")
    if level >= 2:
        for chunk, t in enumerate(timings):
            for b, times in sorted(t["buckets"].items()):
                cells = ", ".join(f"{n} {ms / steps:.3f}" for n, ms in times.items())
                lines.append(f"    chunk {chunk} bucket {b}: {cells}")
    return lines


def timing_scalars(timings: list[dict], iters: int) -> dict[str, float]:
    """TensorBoard scalars: ``grad-reduce-time/<phase>`` in ms per iteration (over `iters`)."""
    steps = max(iters, 1)
    out: dict[str, float] = {}
    for t in timings:
        for name, ms in t["phases"].items():
            key = "grad-reduce-time/" + name.replace(" ", "-")
            out[key] = out.get(key, 0.0) + ms / steps
    return out

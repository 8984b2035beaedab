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

Level 2 also records a :class:`StepTimeline` per model chunk, for every reducer: when each bucket
becomes ready in backward, when backward ends, when the gradient sync and the step end. These are the
inputs of the step-time model (``comm_model``): on CPU the reducer's own work runs on the host inside
backward, so the ready times are also given on a compute-only clock (minus the host time spent in the
reducer so far). On an accelerator the marks are events on the compute stream (the reducer works on
its own stream, so the two clocks are one).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

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


# ------------------------------------------------------------------------------------ step timeline
MARKS = ("backward end", "sync end", "step end")


@dataclass
class _StepRecord:
    start: object = None
    buckets: list = field(default_factory=list)   # (index, numel, mark, reducer host seconds before it)
    marks: dict = field(default_factory=dict)      # name -> (mark, reducer host seconds before it)
    reducer_s: float = 0.0


class StepTimeline:
    """Per step: when each bucket was handed to the reducer, and the ends of backward, of the gradient
    sync and of the step (``--timing-log-level 2``; off: every method returns at once).

    ``collect()`` returns and clears the medians over the steps recorded since the last call, in ms from
    the step's start: ``{"steps", "buckets": [(index, numel, ready_ms, compute_ms)], "backward end",
    "backward end compute", "sync end", "step end", "after sync", "reducer host"}``, buckets by index.
    The compute clock is this rank's clock minus the host time spent inside the reducer so far (CPU; on
    an accelerator the two are one), and its values (``compute_ms``, "backward end compute", "after
    sync") are, step by step, the largest over the ranks of ``group``: a collective starts when its
    slowest rank gets there. ``collect()`` is then collective over ``group``."""

    def __init__(self, enabled: bool, device: torch.device | None = None, group=None) -> None:
        self.enabled = enabled
        self.device = device if device is not None else torch.device("cpu")
        self.group = group
        self._cur: _StepRecord | None = None
        self._done: list[_StepRecord] = []

    def _mark(self):
        if self.device.type == "cpu":
            return time.perf_counter()
        ev = torch.Event(self.device, enable_timing=True)
        ev.record()
        return ev

    def _ms(self, start, mark) -> float:
        if isinstance(start, float):
            return 1000.0 * (mark - start)
        mark.synchronize()
        return start.elapsed_time(mark)

    def step_start(self) -> None:
        if self.enabled:
            self._cur = _StepRecord(start=self._mark())

    def bucket_ready(self, index: int, numel: int) -> None:
        if self.enabled and self._cur is not None:
            self._cur.buckets.append((index, numel, self._mark(), self._cur.reducer_s))

    @contextlib.contextmanager
    def in_reducer(self) -> Iterator[None]:
        """Wrap a reducer call: its host time is taken off the compute clock (CPU)."""
        if not (self.enabled and self._cur is not None and self.device.type == "cpu"):
            yield
            return
        t0 = time.perf_counter()
        yield
        self._cur.reducer_s += time.perf_counter() - t0

    def mark(self, name: str) -> None:
        """``name``: one of MARKS; "step end" closes the step."""
        if not (self.enabled and self._cur is not None):
            return
        self._cur.marks[name] = (self._mark(), self._cur.reducer_s)
        if name == "step end":
            self._done.append(self._cur)
            self._cur = None

    def _step_row(self, r: _StepRecord, indices: list[int]) -> tuple[list[float], list[float]]:
        """(raw ms, compute-clock ms) of one step: bucket ready times by index, then the marks."""
        by_index = {i: (self._ms(r.start, mark), 1000.0 * host) for i, _, mark, host in r.buckets}
        raw = [by_index[i][0] for i in indices] + [self._ms(r.start, r.marks[m][0]) for m in MARKS]
        compute = [by_index[i][0] - by_index[i][1] for i in indices]
        compute += [raw[-3] - 1000.0 * r.marks["backward end"][1], raw[-1] - raw[-2]]  # backward end, after sync
        return raw, compute

    def collect(self) -> dict:
        recs = [r for r in self._done if all(m in r.marks for m in MARKS)]
        self._done = []
        if not recs:
            return {}
        numel = {i: n for r in recs for i, n, _, _ in r.buckets}
        indices = sorted(numel)
        recs = [r for r in recs if sorted(b[0] for b in r.buckets) == indices]
        rows = [self._step_row(r, indices) for r in recs]
        compute = torch.tensor([c for _, c in rows], dtype=torch.float64)
        if self.group is not None and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size(self.group) > 1:
            worst = compute.to(self.device)
            torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=self.group)
            compute = worst.cpu()
        med = statistics.median
        raw = [[row[k] for row, _ in rows] for k in range(len(indices) + len(MARKS))]
        comp = [med(col) for col in compute.T.tolist()]
        out: dict = {"steps": len(rows),
                     "buckets": [(i, numel[i], med(raw[k]), comp[k]) for k, i in enumerate(indices)]}
        for k, name in enumerate(MARKS):
            out[name] = med(raw[len(indices) + k])
        out["backward end compute"], out["after sync"] = comp[-2], comp[-1]
        out["reducer host"] = med(1000.0 * r.reducer_s for r in recs)
        return out


def timeline_log_lines(iteration: int, timelines: list[dict]) -> list[str]:
    """The level-2 lines of ``StepTimeline.collect()`` results (one per model chunk)."""
    lines = []
    for chunk, t in enumerate(timelines):
        if not t:
            continue
        lines.append(f" backward timeline at iteration {iteration} (ms from the step's start, median of {t['steps']} "
                     f"iterations, chunk {chunk}; compute: the slowest data-parallel rank's):")
        lines += [f"    bucket {i}: {n} elements ready at {ready:.3f} (compute {comp:.3f})"
                  for i, n, ready, comp in t["buckets"]]
        lines.append(f"    backward end {t['backward end']:.3f} (compute {t['backward end compute']:.3f}), "
                     f"sync end {t['sync end']:.3f}, step end {t['step end']:.3f} (after sync, compute "
                     f"{t['after sync']:.3f}), reducer host {t['reducer host']:.3f}")
    return lines

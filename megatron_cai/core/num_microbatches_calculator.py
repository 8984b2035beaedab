"""Micro-batches per iteration, constant or ramped up (Megatron-LM's ``--rampup-batch-size``).

``--rampup-batch-size START INCREMENT SAMPLES`` grows the global batch from START to ``--global-batch-size``
in steps of INCREMENT, spread evenly over the first SAMPLES consumed samples: with
``n = (global - START) / INCREMENT`` increments, the batch is ``START + floor(consumed / (SAMPLES / n)) x
INCREMENT`` while ``consumed <= SAMPLES``, and the full global batch after (the rules of Megatron's
``RampupBatchsizeNumMicroBatchesCalculator``). Each batch must be a multiple of micro batch x DP, unless
``--decrease-batch-size-if-needed`` rounds it down to one.

``--step-batch-size-schedule "THRESHOLD:BATCH ..."`` (megatron-core's ``StepBatchsizeNumMicroBatchesCalculator``)
sets the global batch to BATCH from THRESHOLD consumed tokens on (K/M/B/T suffixes; a threshold is converted
to samples by floor division by the sequence length); the first threshold must be 0.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRampup:
    start: int
    increment: int
    samples: int


def parse_rampup(values: list[int] | list[str] | None) -> BatchRampup | None:
    """``--rampup-batch-size START INCREMENT SAMPLES`` as three non-negative integers."""
    if values is None:
        return None
    if len(values) != 3:
        raise ValueError(f"--rampup-batch-size takes START INCREMENT SAMPLES (3 integers), got {values}")
    try:
        start, inc, samples = (int(v) for v in values)
    except ValueError:
        raise ValueError(f"--rampup-batch-size takes 3 integers, got {values}") from None
    if start <= 0 or inc <= 0 or samples < 0:
        raise ValueError(f"--rampup-batch-size: START and INCREMENT must be positive and SAMPLES >= 0, got {values}")
    return BatchRampup(start, inc, samples)


_SUFFIXES = {"T": 10 ** 12, "B": 10 ** 9, "M": 10 ** 6, "K": 10 ** 3}


def _schedule_number(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def parse_step_schedule(schedule: str, seq_length: int) -> list[tuple[int, int]]:
    """``--step-batch-size-schedule`` as sorted (threshold in samples, global batch) pairs, as megatron-core
    0.19.2 reads it (entries separated by spaces or commas, thresholds in tokens)."""
    pairs = []
    for entry in schedule.strip().replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        try:
            if not sep:
                raise ValueError
            pairs.append((_schedule_number(threshold) // seq_length, _schedule_number(batch)))
        except ValueError:
            raise ValueError(f"--step-batch-size-schedule: entry {entry!r} is not THRESHOLD:BATCH_SIZE") from None
    pairs.sort(key=lambda p: p[0])
    if not pairs or pairs[0][0] != 0:
        raise ValueError(f"--step-batch-size-schedule {schedule!r}: the first threshold must be 0")
    for (a, _), (b, _) in zip(pairs, pairs[1:]):
        if b <= a:
            raise ValueError(f"--step-batch-size-schedule {schedule!r}: thresholds must increase (in samples of "
                             f"--seq-length {seq_length} tokens)")
    if any(batch <= 0 for _, batch in pairs):
        raise ValueError(f"--step-batch-size-schedule {schedule!r}: batch sizes must be positive")
    return pairs


class NumMicroBatchesCalculator:
    """The global batch and micro-batches per iteration as a function of consumed samples."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup: BatchRampup | None = None, decrease_batch_size_if_needed: bool = False,
                 step_schedule: tuple[tuple[int, int], ...] | None = None) -> None:
        self.global_batch_size, self.rampup, self.step_schedule = global_batch_size, rampup, step_schedule
        self.micro_batch_size = micro_batch_size
        self.unit = micro_batch_size * data_parallel_size
        self.decrease = decrease_batch_size_if_needed
        if rampup is not None:
            diff = global_batch_size - rampup.start
            if diff < 0 or diff % rampup.increment != 0:
                raise ValueError(f"--rampup-batch-size: --global-batch-size {global_batch_size} minus START "
                                 f"{rampup.start} must be a non-negative multiple of INCREMENT {rampup.increment}")
            self.samples_per_increment = rampup.samples / (diff // rampup.increment) if diff else float("inf")
        self.update(0, consistency_check=False)

    def batch_at(self, consumed_samples: int) -> int:
        """The nominal global batch size after `consumed_samples` samples."""
        if self.step_schedule is not None:
            return [batch for threshold, batch in self.step_schedule if consumed_samples >= threshold][-1]
        r = self.rampup
        if r is None or consumed_samples > r.samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.samples_per_increment)
        return min(r.start + steps * r.increment, self.global_batch_size)

    def update(self, consumed_samples: int, consistency_check: bool = True) -> None:
        """Set ``current_global_batch_size`` (nominal), ``running_global_batch_size`` and ``num_microbatches``."""
        current = self.batch_at(consumed_samples)
        if consistency_check and not self.decrease and current % self.unit != 0:
            raise ValueError(f"global batch size {current} (after {consumed_samples} samples) is not a multiple of "
                             f"micro batch x DP = {self.unit}: change --rampup-batch-size or set "
                             f"--decrease-batch-size-if-needed")
        running = (current // self.unit) * self.unit if self.decrease else current
        if consistency_check and running < self.unit:
            raise ValueError(f"global batch size {current} is smaller than micro batch x DP = {self.unit}")
        self.current_global_batch_size, self.running_global_batch_size = current, running
        self.num_microbatches = running // self.unit

    def check_ramp(self) -> None:
        """Raise ValueError unless every global batch of the ramp (or step schedule) divides into micro batch x DP."""
        if self.step_schedule is None and self.rampup is None:
            return
        batches = self._nominal_batches()
        flag = "--step-batch-size-schedule" if self.step_schedule is not None else "--rampup-batch-size"
        for batch in batches:
            running = (batch // self.unit) * self.unit if self.decrease else batch
            if running % self.unit or running < self.unit:
                raise ValueError(f"{flag}: global batch size {batch} is not a positive multiple of "
                                 f"micro batch x DP = {self.unit} (or set --decrease-batch-size-if-needed)")

    def microbatch_counts(self) -> set[int]:
        """Every number of micro-batches per iteration the ramp (or step schedule) runs; assumes :meth:`check_ramp`."""
        return {batch // self.unit for batch in self._nominal_batches()}  # floored: --decrease-batch-size-if-needed

    def _nominal_batches(self) -> list[int]:
        """The global batch sizes of the ramp or step schedule (the one global batch without either)."""
        if self.step_schedule is not None:
            return [batch for _, batch in self.step_schedule]
        if self.rampup is not None:
            return list(range(self.rampup.start, self.global_batch_size + 1, self.rampup.increment))
        return [self.global_batch_size]

    def train_iters(self, train_samples: int) -> int:
        """Iterations for `train_samples` samples: the ramp, then full batches (a partial last one dropped); with
        a step schedule, Megatron's count (batches until `train_samples` are reached, the last one included)."""
        if self.step_schedule is not None:
            iterations = consumed = 0
            while consumed < train_samples:
                consumed += self.batch_at(consumed)
                iterations += 1
            return iterations
        if self.rampup is None:
            return train_samples // self.global_batch_size
        iterations = consumed = 0
        while consumed <= self.rampup.samples and consumed <= train_samples:
            consumed += self.batch_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations

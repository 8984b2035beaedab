"""Pieces of the training loop behind Megatron-LM flags: the log window (Megatron's per-interval counts),
--calculate-per-token-loss, --profile (torch.profiler), --wandb-*, --empty-unused-memory-level."""
from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..core import device as device_mod
from ..core import parallel_state as ps
from .logging import is_last_rank, print_rank_0


class LogWindow:
    """One --log-interval window, counted as megatron-core's training_log counts it: losses averaged over
    the advanced (not skipped) iterations; skipped and nan iteration counts of this window only."""

    def __init__(self) -> None:
        self.start = __import__("time").time()
        self.iterations = self.advanced = self.skipped = self.nan = 0
        self.sums: dict[str, float] = {}

    def add(self, losses: dict[str, float], skipped: bool) -> None:
        self.iterations += 1
        if skipped:
            self.skipped += 1
            return
        self.advanced += 1
        for k, v in losses.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.nan += int(any(not math.isfinite(v) for v in losses.values()))

    def averages(self) -> dict[str, float]:
        return {k: v / max(1, self.advanced) for k, v in self.sums.items()}

    def seconds_per_iteration(self) -> float:
        return (__import__("time").time() - self.start) / max(1, self.iterations)


class _RecordingIterator:
    """Yields the micro-batches and remembers the last one (its loss mask weighs its loss)."""

    def __init__(self, batches: list[dict]) -> None:
        self._it, self.last = iter(batches), None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.last = next(self._it)
        return self.last


def per_token_loss_step(step_func: Callable, batches: list[dict], model_chunks: list, num_microbatches: int,
                        device: torch.device) -> tuple[Callable, list]:
    """--calculate-per-token-loss: the loss is the sum over every loss-mask token of the global batch divided
    by their number (Megatron-LM's rule), instead of the mean of per-micro-batch means.

    Each micro-batch's mean loss is weighted by n_mb * M * DP / N (N: tokens of the global batch), so that
    the schedule's 1/M and the data-parallel mean turn it into sum / N; the logged stats likewise. The
    weights stay on the device: nothing is read back before the forward pass."""
    counts = [b["loss_mask"].float().sum().to(torch.float64) for b in batches]
    total = torch.stack(counts).sum()
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        dist.all_reduce(total, group=ps.get_data_parallel_group())
    scale = (num_microbatches * dp) / total.clamp_min(1.0)
    weights = {id(b): (c * scale).float() for b, c in zip(batches, counts)}  # device scalars

    def step(data_iterator: _RecordingIterator, model):
        output, loss_func = step_func(data_iterator, model)
        weight = weights[id(data_iterator.last)]

        def weighted(out):
            loss, stats = loss_func(out)
            return loss * weight, {k: v * weight for k, v in stats.items()}

        return output, weighted

    return step, [_RecordingIterator(batches) for _ in model_chunks]


def empty_device_cache(device: torch.device) -> None:
    """--empty-unused-memory-level: release the CUDA caching allocator's unused blocks (no-op on CPU)."""
    device_mod.empty_cache(device)


class StepProfiler:
    """--profile: a torch.profiler trace of iterations [--profile-step-start, --profile-step-end) on the
    ranks in --profile-ranks (default: all), written with tensorboard_trace_handler (TensorBoard's profile
    plugin reads it)."""

    def __init__(self, log, rank: int) -> None:
        """``log``: the run's LoggingConfig."""
        self.enabled = bool(log.profile) and (not log.profile_ranks or rank in log.profile_ranks)
        self.start, self.end = log.profile_step_start, log.profile_step_end
        self.dir = log.tensorboard_dir or "profile"
        self.prof = None

    def before_step(self, iteration: int) -> None:
        if self.enabled and self.prof is None and iteration == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device_mod.cuda_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True,
                                               on_trace_ready=torch.profiler.tensorboard_trace_handler(self.dir))
            self.prof.start()

    def after_step(self, iteration: int) -> None:
        if self.prof is not None and iteration >= self.end:
            self.close()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
            print(f" > profile of iterations [{self.start}, {self.end}) written to {self.dir}", flush=True)


class WandbWriter:
    """--wandb-project: Weights & Biases logging from the last rank (wandb is an optional dependency)."""

    def __init__(self, log, save_dir: str | None, run_config: dict) -> None:
        """``log``: the run's LoggingConfig; ``save_dir``: --save (the default wandb directory is under it)."""
        self.run = None
        if not log.wandb_project or not is_last_rank():
            return
        import wandb  # its presence is checked when the config is built

        directory = log.wandb_save_dir or (os.path.join(save_dir, "wandb") if save_dir else None)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=log.wandb_project, name=log.wandb_exp_name, dir=directory,
                              entity=log.wandb_entity, config=run_config)
        print_rank_0(f" > logging to Weights & Biases project {log.wandb_project}")

    def log(self, values: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(values, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()

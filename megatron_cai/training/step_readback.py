"""What the training loop decides on the host after a step, read back from the device in one transfer.

Each read of a device value (``.item()``, ``bool(t)``, ``.tolist()``) stalls the host until the
accelerator has finished everything queued before it, so kernels stop overlapping Python. A training
iteration that does not log reads once, after the gradient-norm reduction::

    [sum of squared gradients, non-finite micro-batch losses, --fp16: non-finite gradients met while
     unscaling, exit requested, time is up]                                      all-reduced (sum) over the world
    [loss means ...]                                                             averaged over DP x CP (last stage)

Everything the loop needs follows from it: the global grad norm (non-finite when any gradient is, including
Squinch's non-finite flag, which fills the reduced bucket with NaN on the device), the fp16 overflow (also of a
gradient the norm does not count), the divergence check over every rank's losses (accumulated on the device per
micro-batch), the loss values for the log window, the spike check and the history, whether any rank received
an exit signal, and whether the run's time is up (``--exit-duration-in-mins``).

Time is one clock: only rank 0 reads its monotonic clock against the deadline (:class:`Deadline`), every
other rank contributes 0, so a stepped or skewed clock on any other host cannot make one rank save and
leave while the rest train on; every rank sees the same sum and stops at the same iteration.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..core import parallel_state as ps


@dataclass(frozen=True)
class StepReadback:
    grad_norm: float          # global L2 norm of the DP-mean gradient; nan when any element is not finite
    losses: dict[str, float]  # each statistic's mean over micro-batches and DP x CP ranks (last stage; {} elsewhere)
    nonfinite_loss: bool      # some rank's micro-batch statistic was NaN or Inf
    exit_requested: bool      # some rank received SIGTERM / SIGUSR1
    time_up: bool = False     # rank 0's monotonic clock passed the run's deadline
    found_inf: bool = False   # --fp16: some rank's unscaling met a non-finite gradient (all ranks skip the step)


@dataclass
class Deadline:
    """``--exit-duration-in-mins`` measured on rank 0's monotonic clock from ``start`` (None: no limit).

    :meth:`passed` is rank 0's vote; on every other rank it is False without reading a clock."""

    minutes: float | None
    start: float = field(default_factory=lambda: time.monotonic())

    def passed(self) -> bool:
        if not self.minutes or ps.get_rank() != 0:
            return False
        return (time.monotonic() - self.start) / 60 > self.minutes


def loss_means(stats: list[dict], dp_group, dp_size: int) -> tuple[list[str], torch.Tensor | None]:
    """Keys and, on the device, each key's mean over this rank's micro-batches averaged over DP (fp32).

    Collective over DP on the ranks that hold losses; nothing is read back."""
    keys = list(stats[0].keys()) if stats else []
    if not keys:
        return [], None
    vec = torch.stack([torch.stack([s[k].float() for s in stats]).mean() for k in keys])
    if dp_size > 1:
        dist.all_reduce(vec, group=dp_group)
        vec /= dp_size
    return keys, vec


def nonfinite_count(stats: list[dict], device: torch.device) -> torch.Tensor:
    """How many statistic values of this rank's micro-batches are NaN or Inf (a device scalar, fp64)."""
    count = torch.zeros((), dtype=torch.float64, device=device)
    for s in stats:
        for v in s.values():
            if isinstance(v, torch.Tensor):
                count += (~torch.isfinite(v.detach())).sum()
    return count


def read_step(norm_sq: torch.Tensor, stats: list[dict], exit_signal: bool, device: torch.device,
              time_up: bool = False, found_inf: torch.Tensor | None = None) -> StepReadback:
    """The step's one read-back (collective over the world; over DP x CP for the losses). ``time_up`` is this
    rank's vote (only rank 0 votes, see :class:`Deadline`); ``found_inf``: this rank's --fp16 unscaling flag.

    With DiLoCo's islands the gradient norm, the non-finite count and the fp16 flag are the island's own (each
    island is its own inner-loop job) and only the two exit votes cross the slow link: two all-reduces, the same
    read."""
    keys, means = loss_means(stats, ps.get_data_parallel_group(with_context_parallel=True),
                             ps.get_data_parallel_world_size(with_context_parallel=True))
    votes = [torch.full((), float(v), dtype=torch.float64, device=device) for v in (exit_signal, time_up)]
    inf = torch.zeros((), dtype=torch.float64, device=device) if found_inf is None else found_inf.to(torch.float64)
    flags = torch.stack([norm_sq.to(torch.float64), nonfinite_count(stats, device), inf, *votes])
    if ps.get_num_islands() > 1:
        dist.all_reduce(flags[:3], group=ps.get_island_group())
        dist.all_reduce(flags[3:])
    elif ps.get_world_size() > 1:
        dist.all_reduce(flags)
    vec = flags if means is None else torch.cat([flags, means.to(torch.float64)])
    total, nonfinite, infs, exits, time_votes, *losses = vec.tolist()  # the one host read
    return StepReadback(grad_norm=math.sqrt(total) if math.isfinite(total) else float("nan"),
                        losses=dict(zip(keys, losses)), nonfinite_loss=nonfinite > 0, exit_requested=exits > 0,
                        time_up=time_votes > 0, found_inf=infs > 0)

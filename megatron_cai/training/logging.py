"""Megatron-format log lines (so existing log parsers work) and optional TensorBoard scalars."""
from __future__ import annotations

import math
import sys

from ..core import parallel_state as ps
from .errors import safe_print


def is_last_rank() -> bool:
    return ps.get_rank() == ps.get_world_size() - 1


def print_rank_0(msg: str) -> None:
    if ps.get_rank() == 0:
        safe_print(msg)  # a closed stdout never aborts training or a checkpoint save


def print_rank_last(msg: str) -> None:
    if is_last_rank():
        safe_print(msg)


def training_log_line(iteration: int, train_iters: int, consumed: int, ms_per_iter: float, lr: float,
                      global_batch: int, losses: dict[str, float], grad_norm: float | None, skipped: int,
                      tokens_per_sec: float, grad_comm_bytes: int | None = None,
                      extra: dict[str, float] | None = None) -> str:
    parts = [f" iteration {iteration:8d}/{train_iters:8d}",
             f"consumed samples: {consumed:12d}",
             f"elapsed time per iteration (ms): {ms_per_iter:.1f}",
             f"learning rate: {lr:.3E}",
             f"global batch size: {global_batch:5d}"]
    parts += [f"{k}: {v:.6E}" for k, v in losses.items()]
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    parts.append(f"number of skipped iterations: {skipped:3d}")
    parts.append(f"tokens per second: {tokens_per_sec:.1f}")
    if grad_comm_bytes is not None:
        parts.append(f"grad comm bytes: {grad_comm_bytes}")
    for k, v in (extra or {}).items():
        parts.append(f"{k}: {v:.4g}")
    return " | ".join(parts) + " |"


def validation_log_lines(iteration: int, losses: dict[str, float], what: str = "validation") -> str:
    parts = [f" {what} loss at iteration {iteration}"]
    for k, v in losses.items():
        parts.append(f"{k} value: {v:.6E}")
        parts.append(f"{k} PPL: {math.exp(min(20.0, v)):.6E}")
    line = " | ".join(parts) + " | "
    bar = "-" * len(line)
    return f"{bar}\n{line}\n{bar}"


class TensorBoard:
    """A SummaryWriter on the last rank when --tensorboard-dir is set (a no-op otherwise)."""

    def __init__(self, log_dir: str | None) -> None:
        self.writer = None
        if log_dir and is_last_rank():
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("WARNING: --tensorboard-dir given but the tensorboard package is not installed",
                      file=sys.stderr)
                return
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()

"""What a run reports: Megatron-format log lines (so existing log parsers work), the --log-interval window
they are computed over, and the optional writers: TensorBoard scalars, Weights & Biases (--wandb-*),
torch.profiler traces (--profile)."""
from __future__ import annotations

import math
import os
import sys
import time
from datetime import datetime

import torch

from ..core import device as device_mod
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
                      extra: dict[str, float] | None = None, *, loss_scale: float = 1.0, nan_iters: int = 0,
                      throughput_tflops: float | None = None, timestamp: datetime | None = None,
                      num_zeros: float | None = None, params_norm: float | None = None) -> str:
    """megatron-core 0.19.2's ``training_log`` line, field by field, then our extra fields.

    ``skipped`` and ``nan_iters`` count the iterations of this log interval, as Megatron's do.
    """
    ts = (timestamp or datetime.now()).strftime("%Y-%m-%d %H:%M:%S.%f")
    line = f" [{ts}]"
    line += f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed:12d} |"
    line += f" elapsed time per iteration (ms): {ms_per_iter:.1f} |"
    if throughput_tflops is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput_tflops:.1f} |"
    line += f" learning rate: {lr:.6E} |"
    line += f" global batch size: {global_batch:5d} |"
    for key, avg in losses.items():
        if avg >= 0.0 or not math.isfinite(avg):
            line += f" {key}: {avg:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        line += f" num zeros: {num_zeros} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan_iters:3d} |"
    line += f" tokens per second: {tokens_per_sec:.1f} |"
    if grad_comm_bytes is not None:
        line += f" grad comm bytes: {grad_comm_bytes} |"
    for k, v in (extra or {}).items():
        line += f" {k}: {v:.4g} |"
    return line


def parameter_count_line(num_parameters: int, tp_rank: int = 0, pp_rank: int = 0) -> str:
    """megatron-core 0.19.2's parameter-count line (printed by each model-parallel rank's DP rank 0)."""
    return (" > number of parameters on (tensor, gtp_weight_remat, pipeline) "
            f"model parallel rank ({tp_rank}, 0, {pp_rank}): {num_parameters}")


def validation_log_lines(iteration: int, losses: dict[str, float], what: str = "validation",
                         on: str | None = None) -> str:
    """megatron-core's validation block: a rule, the values and PPLs, a rule one character longer. ``on``: the
    final evaluation's set ("validation set", "test set"; megatron-core's prefix "iteration N on <set>")."""
    where = f"iteration {iteration}" + (f" on {on}" if on else "")
    string = f" {what} loss at {where} | "
    for k, v in losses.items():
        string += f"{k} value: {v:.6E} | "
        string += f"{k} PPL: {math.exp(min(20, v)):.6E} | "
    bar = "-" * (len(string) + 1)
    return f"{bar}\n{string}\n{bar}"


def gpt_flops_per_iteration(model, batch_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward) of the GPTConfig ``model``: megatron-core
    0.19.2's ``num_floating_point_operations`` for a dense GPT (no MoE / MTP / linear attention terms)."""
    h, s, layers = model.hidden_size, model.seq_length, model.num_layers
    q_size, kv_size = model.kv_channels * model.num_attention_heads, model.kv_channels * model.num_query_groups
    gemm = 3 * 2  # forward, wgrad and dgrad GEMMs; 2 FLOPs per multiply-add
    mlp = gemm * h * model.ffn_hidden_size * (3 if model.activation == "swiglu" else 2)
    attn_linear = gemm * (h * (q_size + 2 * kv_size) + q_size * h)
    attn_core = gemm * q_size / 2 * 2  # causal half of QK^T and of (QK^T)V
    logits = gemm * h * model.padded_vocab_size
    tokens = batch_size * s
    return tokens * (layers * (mlp + attn_linear) + logits) + batch_size * s * s * layers * attn_core


class TensorBoard:
    """A SummaryWriter on the last rank when --tensorboard-dir is set (a no-op otherwise)."""

    def __init__(self, log_dir: str | None, max_queue: int = 1000) -> None:
        self.writer = None
        if log_dir and is_last_rank():
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("WARNING: --tensorboard-dir given but the tensorboard package is not installed",
                      file=sys.stderr)
                return
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=max_queue)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def add(self, scalars: list[tuple[str, float, int]]) -> None:
        """``(tag, value, step)`` scalars, each at its own step (Megatron's ``... vs samples`` tags)."""
        if self.writer is not None:
            for tag, value, step in scalars:
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


class LogWindow:
    """One --log-interval window, counted as megatron-core's training_log counts it: losses averaged over
    the advanced (not skipped) iterations; skipped and nan iteration counts of this window only."""

    def __init__(self) -> None:
        self.start = time.time()
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
        return (time.time() - self.start) / max(1, self.iterations)


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

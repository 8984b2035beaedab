"""Megatron-LM's ``training_log`` (megatron-core 0.19.2): what each iteration writes to TensorBoard and
Weights & Biases, and when the log line is printed.

- TensorBoard, at every ``--tensorboard-log-interval`` iteration: Megatron's tags with this iteration's
  values (``learning-rate``, ``batch-size``, each loss such as ``lm loss``, ``loss-scale`` unless
  ``--no-log-loss-scale-to-tensorboard``, ``world-size`` with ``--log-world-size-to-tensorboard``,
  ``grad-norm``, ``num-zeros`` with ``--log-num-zeros-in-grad``, ``params-norm`` with ``--log-params-norm``),
  each also as ``<tag> vs samples`` at the consumed-sample count, then the ``mem-*`` tags with
  ``--log-memory-to-tensorboard``. The learning rate is the one the scheduler set after this iteration's
  update (the rate of the next iteration), as Megatron reads it from the optimizer's parameter groups.
- The log line, at every ``--log-interval`` iteration and at the first iteration of the run (whose counts
  are then not reset, as Megatron's ``is_first_iteration``), followed by ``iteration-time`` (and
  ``throughput`` with ``--log-throughput``) when ``--log-timers-to-tensorboard``.

Our own tags (``tokens-per-second``, ``grad-comm-bytes``, ``attention-lse/...``) stay beside Megatron's, at
the log line's cadence.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import LoggingConfig


@dataclass
class IterationStats:
    """One iteration's figures, as ``training_log`` receives them."""

    iteration: int
    consumed_samples: int          # after this iteration
    losses: dict[str, float]
    learning_rate: float | None    # after the scheduler step (Megatron's logged rate)
    batch_size: int                # this iteration's global batch
    loss_scale: float
    grad_norm: float | None
    skipped: bool = False
    num_zeros: float | None = None     # --log-num-zeros-in-grad
    params_norm: float | None = None   # --log-params-norm
    memory: dict[str, int] | None = None  # --log-memory-to-tensorboard (core.device.memory_stats)


def megatron_scalars(stats: IterationStats, log: LoggingConfig, world_size: int) -> list[tuple[str, float, int]]:
    """``(tag, value, step)`` in the order megatron-core's training_log writes them at a
    --tensorboard-log-interval iteration (the caller checks the interval)."""
    it, samples = stats.iteration, stats.consumed_samples
    out: list[tuple[str, float, int]] = []

    def both(tag: str, value: float) -> None:
        out.extend([(tag, value, it), (f"{tag} vs samples", value, samples)])

    if stats.learning_rate is not None:
        both("learning-rate", stats.learning_rate)
    both("batch-size", stats.batch_size)
    for key, value in stats.losses.items():
        both(key, value)
    if log.log_loss_scale_to_tensorboard:
        both("loss-scale", stats.loss_scale)
    if log.log_world_size_to_tensorboard:
        both("world-size", world_size)
    if stats.grad_norm is not None:
        both("grad-norm", stats.grad_norm)
    if stats.num_zeros is not None:
        both("num-zeros", stats.num_zeros)
    if stats.params_norm is not None:
        both("params-norm", stats.params_norm)
    if stats.memory is not None:
        m = stats.memory
        out += [("mem-reserved-bytes", m["reserved"], it), ("mem-allocated-bytes", m["allocated"], it),
                ("mem-max-allocated-bytes", m["peak"], it), ("mem-allocated-count", m["count"], it)]
    return out


def megatron_wandb(stats: IterationStats, log: LoggingConfig, world_size: int) -> dict[str, float]:
    """What megatron-core's training_log sends to Weights & Biases at the same iterations."""
    values = {"samples vs steps": stats.consumed_samples}
    values.update({tag: v for tag, v, _ in megatron_scalars(stats, log, world_size)
                   if not tag.endswith(" vs samples") and not tag.startswith("mem-")})
    return values


def prints_log_line(iteration: int, log_interval: int, first: bool) -> bool:
    """Megatron prints the line every --log-interval iterations and after the run's first iteration."""
    return first or iteration % log_interval == 0


def log_line_timers(iteration_time: float, throughput: float | None, log: LoggingConfig,
                    first: bool) -> dict[str, float]:
    """The TensorBoard scalars written with a log line (``iteration-time`` not at the first iteration)."""
    out = {}
    if log.log_timers_to_tensorboard and not first:
        out["iteration-time"] = iteration_time
    if log.log_timers_to_tensorboard and throughput is not None:
        out["throughput"] = throughput
    return out


def validation_scalars(losses: dict[str, float], iteration: int, consumed_samples: int,
                       ppl: bool) -> list[tuple[str, float, int]]:
    """megatron-core's evaluate_and_print_results tags: ``<key> validation`` (and ``... ppl`` with
    --log-validation-ppl-to-tensorboard), each also ``vs samples``."""
    import math

    out = []
    for key, value in losses.items():
        out += [(f"{key} validation", value, iteration), (f"{key} validation vs samples", value, consumed_samples)]
        if ppl:
            p = math.exp(min(20.0, value))
            out += [(f"{key} validation ppl", p, iteration), (f"{key} validation ppl vs samples", p, consumed_samples)]
    return out

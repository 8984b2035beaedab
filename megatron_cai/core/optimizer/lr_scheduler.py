"""Learning-rate schedule with Megatron-LM's rules (``OptimizerParamScheduler``).

Steps are counted in samples, as in Megatron: ``step(increment)`` adds the iteration's global batch size,
and warmup / decay / WSD-anneal lengths are given in samples (``--lr-*-iters`` x global batch size, or the
``--lr-*-samples`` flags). The rate of an iteration is the rate at the samples consumed *before* it, so a
warmup starts at ``--lr-warmup-init``. Decay styles: constant, linear, cosine, inverse-square-root, and WSD
(warmup-stable-decay: constant until the last ``lr_wsd_decay_samples``, then an exponential / linear / cosine /
minus_sqrt anneal to ``min_lr``). ``--decoupled-lr`` / ``--decoupled-min-lr`` give the input embedding and
output layer their own peak and minimum (``get_lr(decoupled=True)``); ``--use-mup`` scales the MuP group's peak
and minimum (``get_lr(mup=True)``, megatron-core's ``max_lr`` / ``min_lr`` overrides of that group).
"""
from __future__ import annotations

import dataclasses
import math

from .config import LR_DECAY_STYLES, LR_WSD_DECAY_STYLES, SchedulerConfig

__all__ = ["LR_DECAY_STYLES", "LR_WSD_DECAY_STYLES", "OptimizerParamScheduler", "SchedulerConfig"]


class OptimizerParamScheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg  # validated by SchedulerConfig itself
        self.num_steps = 0

    # The fields the checkpoint and the log read.
    @property
    def max_lr(self) -> float:
        return self.cfg.lr

    @property
    def min_lr(self) -> float:
        return self.cfg.min_lr

    def get_lr(self, decoupled: bool = False, num_steps: float | None = None, mup: bool = False) -> float:
        """The rate at `num_steps` samples (default: now, i.e. for the next optimizer step)."""
        c = self.cfg
        max_lr, min_lr = c.lr, c.min_lr
        if decoupled and c.decoupled_lr is not None:
            max_lr = c.decoupled_lr
            min_lr = c.decoupled_min_lr if c.decoupled_min_lr is not None else c.min_lr
        if mup:
            max_lr, min_lr = max_lr * c.mup_lr_mult, min_lr * c.mup_lr_mult
        n = self.num_steps if num_steps is None else num_steps
        if c.lr_warmup_samples > 0 and n <= c.lr_warmup_samples:
            return c.lr_warmup_init + (max_lr - c.lr_warmup_init) * float(n) / float(c.lr_warmup_samples)
        if c.lr_decay_style == "constant":
            return max_lr
        if n > c.lr_decay_samples:
            return min_lr
        if c.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(c.lr_warmup_samples, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - c.lr_warmup_samples) / float(c.lr_decay_samples - c.lr_warmup_samples)
        if c.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif c.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            anneal_start = c.lr_decay_samples - c.lr_wsd_decay_samples
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = float(n - anneal_start) / float(c.lr_wsd_decay_samples)
                coeff = {"linear": lambda: 1.0 - r, "cosine": lambda: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda: 2.0 * math.pow(0.5, r) - 1.0,
                         "minus_sqrt": lambda: 1.0 - math.sqrt(r)}[c.lr_wsd_decay_style]()
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: float) -> None:
        """Advance by one iteration's global batch size."""
        self.num_steps += increment

    def state_dict(self) -> dict:
        c = self.cfg
        return {"num_steps": self.num_steps, "max_lr": c.lr, "min_lr": c.min_lr, "warmup_steps": c.lr_warmup_samples,
                "decay_steps": c.lr_decay_samples, "decay_style": c.lr_decay_style,
                "wsd_decay_steps": c.lr_wsd_decay_samples, "wsd_decay_style": c.lr_wsd_decay_style,
                "unit": "samples"}

    def load_state_dict(self, state: dict) -> None:
        if state.get("unit") == "samples" and self.cfg.use_checkpoint_values:  # --use-checkpoint-opt-param-scheduler
            self.cfg = dataclasses.replace(
                self.cfg, lr=state["max_lr"], min_lr=state["min_lr"], lr_warmup_samples=state["warmup_steps"],
                lr_decay_samples=state["decay_steps"], lr_decay_style=state["decay_style"],
                lr_wsd_decay_samples=state.get("wsd_decay_steps"),
                lr_wsd_decay_style=state.get("wsd_decay_style", self.cfg.lr_wsd_decay_style))
        if state.get("unit") == "samples":
            self.num_steps = state["num_steps"]
        else:  # an older checkpoint counted iterations: rescale by (samples / iterations) of the decay length
            self.num_steps = state["num_steps"] * self.cfg.lr_decay_samples / max(state.get("decay_steps", 1), 1)

"""Learning-rate schedule: linear warmup, then constant / linear / cosine decay to ``min_lr``."""
from __future__ import annotations

import math


class OptimizerParamScheduler:
    def __init__(self, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                 decay_style: str = "cosine") -> None:
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style must be constant, linear or cosine, got {decay_style!r}")
        if min_lr > max_lr:
            raise ValueError(f"--min-lr {min_lr} is larger than --lr {max_lr}")
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, max(decay_steps, 1)
        self.decay_style = decay_style
        self.num_steps = 0

    def get_lr(self, step: int | None = None) -> float:
        """The learning rate of optimizer step number `step` (1-based; default: the next step)."""
        n = self.num_steps + 1 if step is None else step
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        span = max(self.decay_steps - self.warmup_steps, 1)
        ratio = (n - self.warmup_steps) / span
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self) -> None:
        self.num_steps += 1

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps,
                "decay_style": self.decay_style}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]

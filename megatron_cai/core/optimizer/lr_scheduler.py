"""Learning-rate schedule with Megatron-LM's rules (``OptimizerParamScheduler``).

Steps are counted in samples, as in Megatron: ``step(increment)`` adds the iteration's global batch size,
and warmup / decay / WSD-anneal lengths are given in samples (``--lr-*-iters`` x global batch size, or the
``--lr-*-samples`` flags). The rate of an iteration is the rate at the samples consumed *before* it, so a
warmup starts at ``--lr-warmup-init``. Decay styles: constant, linear, cosine, inverse-square-root, and WSD
(warmup-stable-decay: constant until the last ``wsd_decay_steps``, then an exponential / linear / cosine /
minus_sqrt anneal to ``min_lr``). ``--decoupled-lr`` / ``--decoupled-min-lr`` give the input embedding and
output layer their own peak and minimum (``get_lr(decoupled=True)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass(frozen=True)
class LRScheduleConfig:
    """Lengths in samples (or any unit that ``step(increment)`` counts in)."""

    max_lr: float
    min_lr: float = 0.0
    warmup_steps: float = 0
    decay_steps: float = 1
    decay_style: str = "linear"
    init_lr: float = 0.0
    wsd_decay_steps: float | None = None
    wsd_decay_style: str = "exponential"
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None


def lr_schedule_config_from_args(args) -> LRScheduleConfig:
    """Megatron's ``get_optimizer_param_scheduler``: iteration flags x global batch size, or sample flags."""
    gbs = args.global_batch_size
    if getattr(args, "train_samples", None) is not None:  # sample-based training
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_samples)
        wsd = args.lr_wsd_decay_samples
    else:
        decay = args.lr_decay_iters * gbs
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_iters * gbs)
        wsd = args.lr_wsd_decay_iters * gbs if getattr(args, "lr_wsd_decay_iters", None) is not None else None
    return LRScheduleConfig(
        max_lr=args.lr, min_lr=args.min_lr, warmup_steps=warmup, decay_steps=decay,
        decay_style=args.lr_decay_style, init_lr=getattr(args, "lr_warmup_init", 0.0), wsd_decay_steps=wsd,
        wsd_decay_style=getattr(args, "lr_wsd_decay_style", "exponential"),
        decoupled_lr=getattr(args, "decoupled_lr", None), decoupled_min_lr=getattr(args, "decoupled_min_lr", None))


class OptimizerParamScheduler:
    def __init__(self, cfg: LRScheduleConfig) -> None:
        if cfg.decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, got {cfg.decay_style!r}")
        if cfg.min_lr < 0 or cfg.min_lr > cfg.max_lr:
            raise ValueError(f"--min-lr {cfg.min_lr} must lie in [0, --lr {cfg.max_lr}]")
        if cfg.init_lr > cfg.max_lr:
            raise ValueError(f"--lr-warmup-init {cfg.init_lr} is larger than --lr {cfg.max_lr}")
        if cfg.decay_steps <= 0:
            raise ValueError(f"the LR decay length must be positive, got {cfg.decay_steps} samples")
        if cfg.warmup_steps >= cfg.decay_steps and cfg.decay_style != "constant":
            raise ValueError(f"the LR warmup ({cfg.warmup_steps} samples) must be shorter than the decay "
                             f"({cfg.decay_steps} samples): check --lr-warmup-* and --lr-decay-*")
        if cfg.decay_style == "WSD":
            if cfg.wsd_decay_steps is None or not 0 < cfg.wsd_decay_steps <= cfg.decay_steps:
                raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples) "
                                 f"in (0, decay length {cfg.decay_steps}], got {cfg.wsd_decay_steps}")
            if cfg.wsd_decay_style not in WSD_DECAY_STYLES:
                raise ValueError(f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_STYLES)}")
        self.cfg = cfg
        self.num_steps = 0

    # The fields the checkpoint and the log read.
    @property
    def max_lr(self) -> float:
        return self.cfg.max_lr

    @property
    def min_lr(self) -> float:
        return self.cfg.min_lr

    def get_lr(self, decoupled: bool = False, num_steps: float | None = None) -> float:
        """The rate at `num_steps` samples (default: now, i.e. for the next optimizer step)."""
        c = self.cfg
        max_lr, min_lr = c.max_lr, c.min_lr
        if decoupled and c.decoupled_lr is not None:
            max_lr = c.decoupled_lr
            min_lr = c.decoupled_min_lr if c.decoupled_min_lr is not None else c.min_lr
        n = self.num_steps if num_steps is None else num_steps
        if c.warmup_steps > 0 and n <= c.warmup_steps:
            return c.init_lr + (max_lr - c.init_lr) * float(n) / float(c.warmup_steps)
        if c.decay_style == "constant":
            return max_lr
        if n > c.decay_steps:
            return min_lr
        if c.decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(c.warmup_steps, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - c.warmup_steps) / float(c.decay_steps - c.warmup_steps)
        if c.decay_style == "linear":
            coeff = 1.0 - ratio
        elif c.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            anneal_start = c.decay_steps - c.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = float(n - anneal_start) / float(c.wsd_decay_steps)
                coeff = {"linear": lambda: 1.0 - r, "cosine": lambda: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda: 2.0 * math.pow(0.5, r) - 1.0,
                         "minus_sqrt": lambda: 1.0 - math.sqrt(r)}[c.wsd_decay_style]()
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: float) -> None:
        """Advance by one iteration's global batch size."""
        self.num_steps += increment

    def state_dict(self) -> dict:
        c = self.cfg
        return {"num_steps": self.num_steps, "max_lr": c.max_lr, "min_lr": c.min_lr,
                "warmup_steps": c.warmup_steps, "decay_steps": c.decay_steps, "decay_style": c.decay_style,
                "wsd_decay_steps": c.wsd_decay_steps, "wsd_decay_style": c.wsd_decay_style, "unit": "samples"}

    def load_state_dict(self, state: dict) -> None:
        if state.get("unit") == "samples":
            self.num_steps = state["num_steps"]
        else:  # an older checkpoint counted iterations: rescale by (samples / iterations) of the decay length
            self.num_steps = state["num_steps"] * self.cfg.decay_steps / max(state.get("decay_steps", 1), 1)

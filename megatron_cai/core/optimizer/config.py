"""Typed configuration of the optimizer (OptimizerConfig) and the learning-rate schedule (SchedulerConfig)."""
from __future__ import annotations

from dataclasses import dataclass

LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class OptimizerConfig:
    """Optimizer settings (flags --optimizer, --lr, --weight-decay, --adam-*, --sgd-momentum, --clip-grad,
    --use-distributed-optimizer, --overlap-param-gather)."""

    lr: float = 3e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0                   # max global grad norm; 0: no clipping
    use_distributed_optimizer: bool = False  # shard the Adam state over DP (ZeRO-1)
    optimizer: str = "adam"                  # adam (AdamW) | sgd (momentum, L2 weight decay on matrices)
    sgd_momentum: float = 0.9
    overlap_param_gather: bool = False       # distributed optimizer: all-gather overlapped with the next forward

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"--optimizer must be adam or sgd, got {self.optimizer!r}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer (Megatron-LM's rule)")
        if not self.lr >= 0:
            raise ValueError(f"--lr must be >= 0, got {self.lr}")
        if not (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0):
            raise ValueError(f"--adam-beta1/--adam-beta2 must be in [0, 1), got {self.adam_beta1}, "
                             f"{self.adam_beta2}")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")

    @property
    def betas(self) -> tuple[float, float]:
        return (self.adam_beta1, self.adam_beta2)


@dataclass
class SchedulerConfig:
    """The learning-rate schedule, in optimizer steps (warmup and decay lengths already resolved from
    --lr-warmup-fraction / --train-samples by the config builder)."""

    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 0
    lr_decay_iters: int = 1

    def __post_init__(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, "
                             f"got {self.lr_decay_style!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is larger than --lr {self.lr}")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")

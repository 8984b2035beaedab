"""Typed configuration of the optimizer (OptimizerConfig) and the learning-rate schedule (SchedulerConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from ..mup import mup_lr_scaled

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


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
    apply_wd_to_qk_layernorm: bool = False   # weight decay on the QK-layernorm's parameters too (Qwen3-Next)
    # --use-mup: m = hidden / base hidden size (1: no MuP rescaling); core.mup.mup_lr_scaled names the parameters
    # whose learning rate the scheduler's get_lr(mup=True) gives, and whose Adam epsilon is divided by m
    mup_width_mult: float = 1.0

    def __post_init__(self) -> None:
        if not self.mup_width_mult > 0:
            raise ValueError(f"the MuP width multiplier must be > 0, got {self.mup_width_mult}")
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

    def lr_kind(self, name: str, ndim: int) -> str:
        """The learning-rate group of a parameter: ``mup`` (MuP-rescaled, see core.mup), ``decoupled``
        (--decoupled-lr: the input embedding and output layer, Megatron's is_embedding_or_output_parameter) or
        ``base``."""
        if self.mup_width_mult != 1.0 and mup_lr_scaled(name, ndim, self.optimizer):
            return "mup"
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            return "decoupled"
        return "base"

    def eps_of(self, lr_kind: str) -> float:
        """Adam's epsilon for a learning-rate group (MuP: the hidden parameters' is divided by m)."""
        return self.adam_eps / self.mup_width_mult if lr_kind == "mup" else self.adam_eps


@dataclass
class SchedulerConfig:
    """The learning-rate schedule (Megatron's OptimizerParamScheduler). Lengths are in samples, as Megatron
    counts them: the builder turns --lr-*-iters into samples (x global batch size) or takes --lr-*-samples."""

    lr: float = 3e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    lr_warmup_samples: float = 0
    lr_decay_samples: float = 1
    lr_warmup_init: float = 0.0              # the rate at the start of warmup
    lr_wsd_decay_samples: float | None = None  # WSD: the final anneal's length
    lr_wsd_decay_style: str = "exponential"
    decoupled_lr: float | None = None        # the input embedding and output layer's own peak ...
    decoupled_min_lr: float | None = None    # ... and minimum (default: min_lr)
    mup_lr_mult: float = 1.0                 # --use-mup: the MuP group's peak and minimum x this (Adam 1/m, SGD m)
    # on resume: True takes the schedule's values (peak / minimum LR, warmup, decay length and style, WSD anneal)
    # from the checkpoint (--use-checkpoint-opt-param-scheduler); False keeps these flags' values
    use_checkpoint_values: bool = False

    def __post_init__(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, "
                             f"got {self.lr_decay_style!r}")
        if self.lr_wsd_decay_style not in LR_WSD_DECAY_STYLES:
            raise ValueError(f"--lr-wsd-decay-style must be one of {', '.join(LR_WSD_DECAY_STYLES)}")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must lie in [0, --lr {self.lr}]")
        if self.lr_warmup_init > self.lr:
            raise ValueError(f"--lr-warmup-init {self.lr_warmup_init} is larger than --lr {self.lr}")
        if self.lr_warmup_samples < 0:
            raise ValueError(f"--lr-warmup-iters / --lr-warmup-samples must be >= 0, got {self.lr_warmup_samples}")
        if self.lr_decay_samples <= 0:
            raise ValueError(f"the LR decay length must be positive, got {self.lr_decay_samples} samples")
        # A warmup as long as the decay is allowed (Megatron-LM asserts against it): a short debug run with the
        # usual warmup then just warms up, and the LR is --min-lr after the decay length.
        if self.lr_decay_style == "WSD" and (self.lr_wsd_decay_samples is None
                                             or not 0 < self.lr_wsd_decay_samples <= self.lr_decay_samples):
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples) within "
                             f"the decay length ({self.lr_decay_samples} samples), got {self.lr_wsd_decay_samples}")


def applies_weight_decay(name: str, is_matrix: bool, apply_wd_to_qk_layernorm: bool = False) -> bool:
    """megatron-core's rule (get_standard_config_overrides): no weight decay on 1-D parameters (norm weights,
    biases); with --apply-wd-to-qk-layernorm, the query / key layernorms' parameters decay too."""
    if apply_wd_to_qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name):
        return True
    return is_matrix


def group_lrs(config: OptimizerConfig, lr: float, decoupled_lr: float | None, mup_lr: float | None
              ) -> dict[str, float]:
    """The rate of each learning-rate kind (OptimizerConfig.lr_kind). SGD takes `lr` for the decoupled kind; a
    missing `mup_lr` is `lr` x megatron-core's MuP multiplier (exact for schedules linear in the peak)."""
    if mup_lr is None:
        mup_lr = lr * mup_lr_mult(config)
    sgd = config.optimizer == "sgd"
    return {"base": lr, "decoupled": lr if sgd or decoupled_lr is None else decoupled_lr, "mup": mup_lr}


def mup_lr_mult(config: OptimizerConfig) -> float:
    """megatron-core's MuP learning-rate multiplier of the MuP group: 1/m for Adam's hidden parameters, m for
    SGD's vector-like ones."""
    m = config.mup_width_mult
    return m if config.optimizer == "sgd" else 1.0 / m

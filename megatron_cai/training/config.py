"""TrainConfig: the whole run's configuration, one typed dataclass per component.

::

    TrainConfig
      model       GPTConfig        (core/models/gpt/config.py; its .qat is a QATConfig)
      parallel    ParallelConfig   world size, TP / PP / VPP / CP / DP, backend, device
      training    TrainingConfig   batch sizes, iterations, seed, precision, exit conditions, divergence
      ddp         DDPConfig        (core/distributed/config.py; its .squinch is a SquinchConfig)
      optimizer   OptimizerConfig  (core/optimizer/config.py)
      scheduler   SchedulerConfig  (core/optimizer/config.py)
      data        DataConfig
      tokenizer   TokenizerConfig
      checkpoint  CheckpointConfig
      logging     LoggingConfig    logging and evaluation
      distill     DistillConfig
      diloco      DilocoConfig     (core/diloco/config.py) DiLoCo across islands
      flags       the parsed command line it was built from (a record: nothing reads options from it)

It is built once by the pure function :func:`megatron_cai.training.arguments.build_config` from the
parsed flags and the world size (validation included), printed at start-up, saved in every checkpoint
and compared field by field on resume (:func:`config_diff`). Each component receives its own part:
``Trainer(config)``, ``DistributedDataParallel(module, reducer, config.ddp)``,
``build_reducer(config.ddp, ...)``, ``DistributedAdamW(chunks, config.optimizer)``, ``GPTModel(config.model)``.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..core.diloco import DilocoConfig
from ..core.distributed.config import DDPConfig
from ..core.models.gpt.config import GPTConfig
from ..core.num_microbatches_calculator import BatchRampup
from ..core.optimizer.config import OptimizerConfig, SchedulerConfig
from ..core.optimizer.grad_scaler import LossScaleConfig
from .divergence import DivergenceConfig
from .errors import UserError

__all__ = ["ArgumentError", "CheckpointConfig", "DataConfig", "DistillConfig", "LoggingConfig", "ParallelConfig",
           "TokenizerConfig", "TrainConfig", "TrainingConfig", "config_diff", "flatten", "format_config"]


class ArgumentError(UserError, ValueError):
    """A flag value that cannot work; the message names the flag."""


@dataclass
class ParallelConfig:
    """How the ``world_size`` ranks are laid out (DP and VPP are derived by the builder)."""

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1            # ranks that split each sequence; gradients reduce over DP x CP
    data_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None  # interleaved schedule's micro-batch groups (None: PP)
    sequence_parallel: bool = False           # only effective with TP > 1 (see GPTConfig.sequence_parallel)
    distributed_backend: str | None = None    # None: nccl on CUDA, gloo on CPU
    distributed_timeout_minutes: float = 10
    ranks_per_node: int | None = None         # None: LOCAL_WORLD_SIZE
    device: str | None = None                 # None: cuda when available
    deterministic_mode: bool = False          # Megatron's deterministic environment + algorithms (determinism.py)
    use_tp_pp_dp_mapping: bool = False        # global ranks enumerate TP, CP, PP, then DP (default: TP, CP, DP, PP)
    expert_model_parallel_size: int = 1       # MoE: experts split over EP ranks
    expert_tensor_parallel_size: int | None = None  # None: the TP size


@dataclass
class TrainingConfig:
    """The loop: batch sizes, length (resolved to iterations), seed, precision and exit conditions."""

    micro_batch_size: int = 4
    global_batch_size: int = 4
    num_microbatches: int = 1                 # global / (micro x DP)
    train_iters: int = 1                      # from --train-iters, or ceil(--train-samples / global batch)
    train_samples: int | None = None          # the flag, when the length was given in samples
    seed: int = 1234
    bf16: bool = False
    fp16: bool = False                        # fp16 autocast with loss scaling (fp32 master weights)
    loss_scale: LossScaleConfig | None = None  # the --fp16 loss scaler (None without --fp16)
    rampup_batch_size: BatchRampup | None = None  # --rampup-batch-size START INCREMENT SAMPLES
    # --step-batch-size-schedule: (threshold in samples, global batch) pairs, from threshold 0
    step_batch_size_schedule: tuple[tuple[int, int], ...] | None = None
    decrease_batch_size_if_needed: bool = False
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = True
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)  # non-finite steps, loss spikes
    calculate_per_token_loss: bool = False    # loss = sum over the global batch's tokens / their number
    empty_unused_memory_level: int = 0        # 1: empty the CUDA cache after each step; 2: also mid-step
    manual_gc: bool = False                   # no automatic Python GC; collect every manual_gc_interval steps
    manual_gc_interval: int = 0
    compile: bool = False                     # torch.compile each transformer layer (core/transformer/compile.py)
    skip_train: bool = False                  # --skip-train: no training loop; the final evaluation only
    check_weight_hash_across_dp_replicas_interval: int | None = None  # DP replicas' weights compared (weight_hash.py)


@dataclass
class DataConfig:
    data_path: list[str] | None = None
    train_data_path: list[str] | None = None  # Megatron's per-split blends (instead of data_path + split)
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    split: str | None = "969,30,1"            # normalised ("99,1,0"); None with the per-split paths
    data_cache_path: str | None = None
    mock_data: bool = False
    allow_data_change: bool = False           # resume on corpus files whose content fingerprint differs
    num_workers: int = 2
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    data_format: str = "auto"
    tree_loss_weighting: str = "token"
    fim: Any = None                           # --fim-data: flags/fim.py FimSettings (None: no FIM transform)


@dataclass
class TokenizerConfig:
    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: str | None = None
    vocab_size: int | None = None             # the flag (NullTokenizer / mock data); the model's is in GPTConfig
    make_vocab_size_divisible_by: int = 128
    vocab_file: str | None = None             # GPT2BPETokenizer
    merge_file: str | None = None
    tiktoken_pattern: str | None = None       # TikTokenizer: v1 | v2
    tiktoken_num_special_tokens: int = 1000
    tiktoken_special_tokens: list[str] | None = None


@dataclass
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    load_optim: bool = True                   # not --no-load-optim
    load_rng: bool = True                     # not --no-load-rng
    save_optim: bool = True                   # not --no-save-optim
    finetune: bool = False
    exit_on_missing_checkpoint: bool = False
    ckpt_step: int | None = None
    ckpt_format: str = "torch"                # the format saves write: torch or torch_dist
    auto_detect_ckpt_format: bool = False     # --load reads whichever format the directory holds
    async_save: bool = False                  # --async-save: write in the background
    overwrite_checkpoints: bool = False       # an existing iteration in --save is moved aside, not refused
    allow_tokenizer_change: bool = False      # resume with a tokenizer whose content differs from the saved one
    trust_checkpoint_code: bool = False       # unpickle checkpoint files that are not plain data (may run code)
    allow_unverified_checkpoint: bool = False  # load a checkpoint without a usable content-hash manifest
    checkpoint_signing_key: str | None = None  # a file holding the HMAC key that signs and checks manifests
    save_retain_interval: int | None = None   # keep only these multiples (and the newest) of the persistent saves
    non_persistent_save_interval: int | None = None  # frequent saves to the non-persistent directory
    non_persistent_ckpt_type: str | None = None      # "global" (the only one here) or None
    non_persistent_global_ckpt_dir: str | None = None  # default: <save>/non_persistent


@dataclass
class LoggingConfig:
    """Logging and evaluation."""

    log_interval: int = 100
    tensorboard_dir: str | None = None
    eval_interval: int | None = None
    eval_iters: int = 100
    eval_global_batch_size: int | None = None  # --eval-global-batch-size (None: the global batch)
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_throughput: bool = False
    log_timers_to_tensorboard: bool = False
    timing_log_level: int = 0                 # --timing-log-level: Squinch reduction phase timers (2: per bucket)
    log_validation_ppl_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = True
    log_params_norm: bool = False             # --log-params-norm: params norm in the log line and TensorBoard
    log_num_zeros_in_grad: bool = False       # --log-num-zeros-in-grad
    log_memory_to_tensorboard: bool = False   # --log-memory-to-tensorboard: the mem-* tags
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_entity: str | None = None
    profile: bool = False                     # torch.profiler trace of [profile_step_start, profile_step_end)
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=list)  # empty: every rank
    megatron_no_op_flags: list[str] = field(default_factory=list)  # given, accepted, without effect here
    megatron_notes: list[str] = field(default_factory=list)  # one start-up line per Megatron-LM flag mapped
    logging_level: int | None = None          # --logging-level: the Python root logger's level


@dataclass
class DistillConfig:
    """Knowledge distillation: offline (``samples``) or online (``teacher_load``); off when neither."""

    samples: str | None = None                # --distill-samples
    teacher_load: str | None = None           # --distill-teacher-load
    alpha: float = 0.5
    temperature: float = 1.0
    estimator: str = "priority"
    k: int = 32

    @property
    def enabled(self) -> bool:
        return bool(self.samples or self.teacher_load)

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        if self.samples and self.teacher_load:
            raise ArgumentError("use either --distill-samples (offline) or --distill-teacher-load (online), not both")
        if not 0.0 <= self.alpha <= 1.0:
            raise ArgumentError(f"--distill-alpha must be in [0, 1], got {self.alpha}")
        if not self.temperature > 0:
            raise ArgumentError(f"--distill-temperature must be > 0, got {self.temperature}")
        if self.k < 1:
            raise ArgumentError(f"--distill-k must be >= 1, got {self.k}")
        if self.estimator == "full" and not self.teacher_load:
            raise ArgumentError("--distill-estimator full needs the whole teacher distribution: use it with "
                                "--distill-teacher-load (online); stored samples support priority|self-normalized|"
                                "topk")


@dataclass
class TrainConfig:
    model: GPTConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    flags: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dicts (JSON-serialisable apart from non-JSON leaf values, which json's default=str
        handles); the form saved in checkpoints."""
        return dataclasses.asdict(self)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model.hidden_size": 256, "model.qat.fmt": "none", ...}`` of a nested dict."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and k != "flags":
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _json_normalise(v: Any) -> Any:
    """Values as they come back from JSON (tuples become lists), so saved and live configs compare."""
    if isinstance(v, tuple):
        return [_json_normalise(x) for x in v]
    if isinstance(v, list):
        return [_json_normalise(x) for x in v]
    return v


def config_diff(saved: dict[str, Any], current: dict[str, Any], *, skip: tuple[str, ...] = ("flags",)
                ) -> list[tuple[str, Any, Any]]:
    """``[(field, saved value, current value)]`` for every field (dotted name) that differs, including
    fields present on one side only (shown as ``<absent>``). Top-level sections in ``skip`` are ignored."""
    a = {k: v for k, v in flatten(saved).items() if k.split(".")[0] not in skip}
    b = {k: v for k, v in flatten(current).items() if k.split(".")[0] not in skip}
    out = []
    for name in sorted(set(a) | set(b)):
        va, vb = _json_normalise(a.get(name, "<absent>")), _json_normalise(b.get(name, "<absent>"))
        if va != vb:
            out.append((name, va, vb))
    return out


def format_config(config: TrainConfig) -> str:
    """Megatron-style start-up listing: one dotted ``name ... value`` line per field."""
    lines = ["------------------------ configuration ------------------------"]
    for name, value in flatten(config.to_dict()).items():
        if name == "flags":
            continue
        lines.append(f"  {name} {'.' * max(2, 48 - len(name))} {value}")
    lines.append("-------------------- end of configuration ---------------------")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ flag ranges
@dataclass(frozen=True)
class Range:
    """The values a numeric flag takes: ``lo``/``hi`` bounds (None: unbounded), each open or closed."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def admits(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def describe(self) -> str:
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi:g}")
        return "finite and " + " and ".join(parts) if parts else "finite"


_AT_LEAST_1, _AT_LEAST_0 = Range(1), Range(0)
_POSITIVE = Range(0, lo_open=True)
_FRACTION, _DROPOUT = Range(0, 1), Range(0, 1, hi_open=True)

# Every numeric flag of the parser (a test checks that none is missing), by its argparse ``dest``.
FLAG_RANGES: dict[str, Range] = {
    # Mixture of Experts (training/flags/moe.py)
    **dict.fromkeys(["expert_tensor_parallel_size", "moe_ffn_hidden_size", "moe_router_num_groups",
                     "moe_router_group_topk", "moe_shared_expert_intermediate_size"], _AT_LEAST_1),
    **dict.fromkeys(["moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_router_bias_update_rate"],
                    _AT_LEAST_0),
    **dict.fromkeys(["moe_expert_capacity_factor", "moe_router_topk_scaling_factor"], _POSITIVE),
    # multi-latent attention (training/flags/kaiju.py)
    **dict.fromkeys(["q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"], _AT_LEAST_1),
    **dict.fromkeys(["rotary_scaling_factor", "mscale"], _POSITIVE), "mscale_all_dim": _AT_LEAST_0,
    **dict.fromkeys(["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "kv_channels", "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
                     "window_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "num_layers_per_virtual_pipeline_stage", "ddp_bucket_size", "ranks_per_node",
                     "micro_batch_size", "global_batch_size", "train_samples", "distill_k", "vocab_size",
                     "save_interval", "log_interval", "tensorboard_log_interval", "tensorboard_queue_size",
                     "profile_step_end", "exit_interval", "loss_scale_window", "hysteresis", "lr_decay_samples",
                     "spiky_loss_window", "fp8_amax_history_len", "fp8_interval", "num_experts", "moe_router_topk",
                     "expert_model_parallel_size", "context_parallel_size", "num_distributed_optimizer_instances",
                     "rotary_seq_len_interpolation_factor", "num_virtual_stages_per_pipeline_rank",
                     "microbatch_group_size_per_virtual_pipeline_stage", "non_persistent_save_interval",
                     "save_retain_interval", "eval_global_batch_size", "eval_micro_batch_size",
                     "padded_vocab_size", "check_weight_hash_across_dp_replicas_interval"], _AT_LEAST_1),
    **dict.fromkeys(["recompute_num_layers", "train_iters", "lr_warmup_iters", "lr_decay_iters", "seed",
                     "manual_gc_interval", "num_workers", "ckpt_step", "eval_interval", "eval_iters",
                     "profile_step_start", "profile_ranks", "rampup_batch_size", "tiktoken_num_special_tokens",
                     "lr_warmup_samples", "lr_wsd_decay_samples", "lr_wsd_decay_iters",
                     "max_consecutive_skipped_iterations", "fp8_margin", "local_rank", "empty_unused_memory_level",
                     "timing_log_level", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                     "mtp_num_layers", "attention_zreg_coeff", "output_zreg_coeff", "lr", "min_lr",
                     "weight_decay", "clip_grad", "lr_warmup_init", "decoupled_lr", "decoupled_min_lr",
                     "start_weight_decay", "end_weight_decay", "logging_level", "error_injection_rate"], _AT_LEAST_0),
    **dict.fromkeys(["rotary_base", "norm_epsilon", "init_method_std", "distributed_timeout_minutes", "adam_eps",
                     "qat_clamp_alpha", "qat_static_clamp", "distill_temperature", "exit_duration_in_mins",
                     "loss_scale", "initial_loss_scale", "min_loss_scale", "rope_scaling_factor"], _POSITIVE),
    **dict.fromkeys(["hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2", "sgd_momentum"], _DROPOUT),
    **dict.fromkeys(["lr_warmup_fraction", "distill_alpha"], _FRACTION),
    **dict.fromkeys(["fim_rate", "fim_spm_rate", "fim_fragment_rate"], _FRACTION),  # training/flags/fim.py
    **dict.fromkeys(["diloco_islands", "diloco_fragments", "diloco_outer_bits"], _AT_LEAST_1),
    **dict.fromkeys(["diloco_inner_steps", "diloco_overlap_steps"], _AT_LEAST_0),
    "diloco_outer_lr": _POSITIVE, "diloco_outer_momentum": _DROPOUT, "diloco_local_weight": _FRACTION,
    "mup_base_hidden_size": _AT_LEAST_1, "mup_attn_scale_power": _AT_LEAST_0,  # training/flags/mup.py
    **dict.fromkeys(["mup_base_head_dim", "mup_embedding_mult", "mup_output_mult"], _POSITIVE),
    "rotary_percent": Range(0, 1, lo_open=True),
    "spiky_loss_factor": Range(1, lo_open=True),
}


def flag_range_problems(args: Any) -> list[str]:
    """Every numeric flag against :data:`FLAG_RANGES`, ``--split`` and the ``--data-path`` weights: one
    message per flag out of range, naming the flag, the value and the range."""
    from ..core.datasets.utils import get_blend_from_list, parse_and_normalize_split

    out, given = [], dict(vars(args))
    for dest, rng in FLAG_RANGES.items():
        value = given.get(dest)
        bad = [v for v in (value if isinstance(value, list) else [value])
               if v is not None and not isinstance(v, bool) and not rng.admits(v)]
        if bad:
            out.append(f"--{dest.replace('_', '-')} {bad[0]}: out of range, must be {rng.describe()}")
    try:
        if given.get("split") is not None:
            parse_and_normalize_split(re.sub(r"[\"' ]", "", str(given["split"])))
    except ValueError as e:
        out.append(str(e))
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        try:
            if given.get(flag):
                get_blend_from_list(given[flag])
        except ValueError as e:
            out.append(str(e) if str(e).startswith("--") else f"--{flag.replace('_', '-')}: {e}")
    return out

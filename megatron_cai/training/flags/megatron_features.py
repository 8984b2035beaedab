"""Megatron-LM flag groups beyond the core ones in ``arguments.py``: fp16 loss scaling, batch-size schedules,
tokenizers and LR schedules (Megatron's numerics), and Megatron-LM features mapped onto this codebase's
engines (Megatron-FSDP onto FSDP2 / the distributed optimizer / DDP, ``--ckpt-format fsdp_dtensor`` onto
``torch_dist``, ``--transformer-impl transformer_engine`` without FP8 onto the local implementation).

Each mapping adds one start-up line (``megatron_notes``) saying what runs instead.
"""
from __future__ import annotations

import argparse

from ...core.num_microbatches_calculator import NumMicroBatchesCalculator, parse_rampup, parse_step_schedule
from ...core.optimizer.grad_scaler import LossScaleConfig, build_grad_scaler
from ..config import ArgumentError
from .report import FlagProblems

SHARDING_STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
# --data-parallel-sharding-strategy under --use-megatron-fsdp -> what runs here
_FSDP_MAPPING = {"optim_grads_params": "PyTorch FSDP2 (--use-torch-fsdp2: parameters, gradients and optimizer "
                                       "state sharded over DP)",
                 "optim_grads": "the distributed optimizer (--use-distributed-optimizer: gradients reduce-scattered, "
                                "optimizer state sharded)",
                 "optim": "the distributed optimizer (--use-distributed-optimizer: optimizer state sharded)",
                 "no_shard": "data parallelism without sharding (DDP)"}


def add_megatron_numerics(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's fp16 loss scaling, batch-size schedules, tokenizers and LR-schedule flags (its names and
    defaults); extends the choices of --tokenizer-type and --lr-decay-style defined in arguments.py."""
    from ...core.optimizer.config import LR_DECAY_STYLES, LR_WSD_DECAY_STYLES
    from ..tokenizer import TOKENIZER_TYPES

    for action in p._actions:
        if action.dest == "tokenizer_type":
            action.choices = list(dict.fromkeys([*action.choices, *TOKENIZER_TYPES]))
        elif action.dest == "lr_decay_style":
            action.choices = list(dict.fromkeys([*action.choices, *LR_DECAY_STYLES]))
    g = p.add_argument_group("Megatron-LM numerics: fp16, batch schedules, tokenizers, LR schedules")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 autocast with loss scaling; fp32 master weights and grads")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale (a positive power of 2 helps convergence); default: dynamic scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32, help="initial dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="minimum dynamic loss scale")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="clean iterations before the dynamic loss scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows before the dynamic loss scale halves")
    g.add_argument("--rampup-batch-size", nargs="*", type=int, default=None,
                   help="START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over SAMPLES "
                        "samples (Megatron's num-microbatches calculator)")
    g.add_argument("--step-batch-size-schedule", nargs="+", default=None,
                   help="'THRESHOLD:BATCH ...' (e.g. '0:768 250B:1536'): the global batch from each threshold of "
                        "consumed tokens on (K/M/B/T suffixes; thresholds / --seq-length = samples), as "
                        "megatron-core's StepBatchsizeNumMicroBatchesCalculator. The last batch is the global batch; "
                        "--global-batch-size, which Megatron-LM refuses with a schedule, is taken when it equals it. "
                        "The entries may also come as separate words (Megatron-LM takes one string only)")
    g.add_argument("--decrease-batch-size-if-needed", action="store_true",
                   help="shrink the global batch to a multiple of micro batch x DP when it is not one")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--tiktoken-pattern", default=None, help="TikTokenizer: v1 or v2 (the pre-tokenizer regex)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids reserved for special tokens below the BPE ranks")
    g.add_argument("--tiktoken-special-tokens", nargs="+", default=None,
                   help="TikTokenizer: special tokens (default <unk> <s> </s>)")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warmup")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="warmup length with --train-samples")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="decay length with --train-samples (default: --train-samples)")
    g.add_argument("--lr-wsd-decay-style", choices=LR_WSD_DECAY_STYLES, default="exponential",
                   help="WSD: the shape of the final anneal")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="WSD anneal length with --train-samples")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD anneal length with --train-iters")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="a separate peak learning rate for the input embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="a separate minimum learning rate for the input embedding and output layer")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, the LR schedule's values come from the flags (the step count from the "
                        "checkpoint); this is also what happens here without the flag (Megatron-LM: an error when "
                        "they differ), and the differences are logged")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, the LR schedule's values (peak and minimum LR, warmup, decay length and style) "
                        "come from the checkpoint, not from the flags")


def add_megatron_features(p: argparse.ArgumentParser) -> None:
    """Megatron-LM features that run on this codebase's own engines (see the module docstring)."""
    g = p.add_argument_group("Megatron-LM features mapped onto this codebase (one start-up line each)")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron-FSDP; here by --data-parallel-sharding-strategy: optim_grads_params -> FSDP2 "
                        "(--use-torch-fsdp2), optim_grads and optim -> the distributed optimizer, no_shard -> DDP")
    g.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES, default="optim_grads_params",
                   help="with --use-megatron-fsdp (see there)")
    g.add_argument("--logging-level", type=int, default=None,
                   help="the Python root logger's level (as Megatron-LM's setup_logging); our log lines are printed")


def check_megatron_numerics(args: argparse.Namespace, problems: FlagProblems) -> None:
    """Cross-flag checks of the ``add_megatron_numerics`` flags (Megatron's rules)."""
    if args.fp16 and args.bf16:
        problems.conflict("set at most one of --fp16 and --bf16")
    ramp = args.rampup_batch_size is not None or args.step_batch_size_schedule is not None
    if args.attention_zreg_coeff and (args.fp16 or ramp):
        problems.conflict("--attention-zreg-coeff injects a gradient that follows neither the fp16 loss scale nor "
                          "a changing micro-batch count: not with --fp16, --rampup-batch-size or "
                          "--step-batch-size-schedule")
    sample_flags = {"--lr-decay-samples": args.lr_decay_samples is not None,
                    "--lr-warmup-samples": args.lr_warmup_samples != 0,
                    "--lr-wsd-decay-samples": args.lr_wsd_decay_samples is not None}
    # --rampup-batch-size counts consumed samples either way, so it is taken with --train-iters too (Megatron-LM
    # refuses that combination, yet its own GPT-3 175B example script uses it)
    if args.train_samples is None:
        for flag, is_set in sample_flags.items():
            if is_set:
                problems.conflict(f"{flag} needs sample-based training (--train-samples), as in Megatron-LM")
    elif args.lr_wsd_decay_iters is not None:
        problems.conflict("--lr-wsd-decay-iters needs --train-iters; use --lr-wsd-decay-samples")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        problems.conflict("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler: choose one "
                          "(Megatron-LM's rule)")
    _check_step_schedule(args, problems)


def _schedule(args: argparse.Namespace) -> str | None:
    """--step-batch-size-schedule as one string (its words joined, as the word-split GPT-3 example passes it)."""
    value = args.step_batch_size_schedule
    return " ".join(value) if isinstance(value, list) else value


def _check_step_schedule(args: argparse.Namespace, problems: FlagProblems) -> None:
    if args.step_batch_size_schedule is None:
        return
    for flag, given in (("--rampup-batch-size", args.rampup_batch_size is not None),
                        ("--decrease-batch-size-if-needed", args.decrease_batch_size_if_needed)):
        if given:
            problems.conflict(f"--step-batch-size-schedule and {flag}: choose one (Megatron-LM's rule)")
    try:
        schedule = parse_step_schedule(_schedule(args), args.seq_length)
    except ValueError as e:
        problems.invalid(str(e))
        return
    last = schedule[-1][1]
    if args.global_batch_size is not None and args.global_batch_size != last:
        problems.conflict(f"--global-batch-size {args.global_batch_size} differs from the last batch size of "
                          f"--step-batch-size-schedule ({last}): drop --global-batch-size (Megatron-LM refuses both)")


def step_schedule_global_batch(args: argparse.Namespace) -> int | None:
    """The global batch size a --step-batch-size-schedule ends at (None without one, or when it is invalid)."""
    if args.step_batch_size_schedule is None:
        return None
    try:
        return parse_step_schedule(_schedule(args), args.seq_length)[-1][1]
    except ValueError:
        return None


def loss_scale_config(args: argparse.Namespace) -> LossScaleConfig | None:
    """The --fp16 loss scaler's settings (None without --fp16)."""
    if not args.fp16:
        return None
    cfg = LossScaleConfig(loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
                          min_loss_scale=args.min_loss_scale, loss_scale_window=int(args.loss_scale_window),
                          hysteresis=args.hysteresis)
    try:
        build_grad_scaler(cfg)  # its own checks, with the flag names
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    return cfg


def batch_schedule(args: argparse.Namespace, global_batch_size: int, micro_batch_size: int,
                   data_parallel_size: int) -> NumMicroBatchesCalculator:
    """The --rampup-batch-size / --step-batch-size-schedule calculator; every batch size of the schedule
    checked against micro batch x DP."""
    try:
        step = None
        if args.step_batch_size_schedule is not None:
            step = tuple(parse_step_schedule(_schedule(args), args.seq_length))
        calc = NumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                         parse_rampup(args.rampup_batch_size), args.decrease_batch_size_if_needed,
                                         step_schedule=step)
        calc.check_ramp()
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    return calc


def resolve_megatron_features(args: argparse.Namespace, problems: FlagProblems) -> list[str]:
    """Apply the mappings to ``args`` (a private copy); return their start-up lines."""
    notes = []
    if args.use_megatron_fsdp:
        strategy = args.data_parallel_sharding_strategy
        if args.use_torch_fsdp2:
            problems.conflict("--use-megatron-fsdp and --use-torch-fsdp2: choose one")
        notes.append(f" > --use-megatron-fsdp --data-parallel-sharding-strategy {strategy}: runs as "
                     f"{_FSDP_MAPPING[strategy]}")
        if strategy == "optim_grads_params":
            # Megatron-FSDP implies its distributed optimizer and overlaps by itself; FSDP2 shards the optimizer
            # state and prefetches the next unit's all-gather
            args.use_torch_fsdp2, args.use_distributed_optimizer, args.overlap_param_gather = True, False, False
        elif strategy in ("optim", "optim_grads"):
            args.use_distributed_optimizer = True
    if args.ckpt_format == "fsdp_dtensor":
        args.ckpt_format = "torch_dist"
        notes.append(" > --ckpt-format fsdp_dtensor: read as torch_dist (torch.distributed.checkpoint, which "
                     "saves FSDP2's DTensor shards and loads into any layout)")
    notes += _transformer_impl(args)
    return notes


def _transformer_impl(args: argparse.Namespace) -> list[str]:
    """--transformer-impl transformer_engine: Transformer Engine runs the FP8 GEMMs where it is installed
    (CUDA); otherwise, and for every other precision, the local implementation runs (one line)."""
    if args.transformer_impl != "transformer_engine":
        return []
    from ...core.quantization.gemm_backends import transformer_engine_available

    if args.qat == "fp8" and transformer_engine_available() and args.device != "cpu":
        return []
    args.transformer_impl = "local"
    if args.qat == "fp8":
        why = ("Transformer Engine is not installed" if not transformer_engine_available()
               else "Transformer Engine runs on CUDA only")
        return [f" > --transformer-impl transformer_engine: {why}; FP8 training runs our fake-quantized FP8 QAT "
                f"(--transformer-impl local)"]
    precision = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
    return [f" > --transformer-impl transformer_engine: the local implementation runs ({precision}: PyTorch's GEMMs, "
            f"the same math; Transformer Engine is used here for FP8 GEMMs only)"]

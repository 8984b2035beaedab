"""Megatron-LM's aliases, value rules and cross-flag checks, each recorded in a :class:`FlagProblems` collector
so that one report lists every problem of a command line (``report.py``)."""
from __future__ import annotations

import argparse
import importlib.util
import math
import re

from ..config import ArgumentError
from ..features.determinism import check_deterministic_flags
from . import mup, optimizer_and_fp8
from . import rerun as rerun_flags
from .megatron_compat import attention_backend_for, check_compat, mapped_messages
from .megatron_features import resolve_megatron_features
from .pipeline_split import virtual_pipeline_size
from .report import FlagProblems


def normalize_split(value: str) -> str:
    """``--split`` as Megatron reads it (the numbers in the string, in order), e.g. "'99,1,0'" -> "99,1,0"."""
    numbers = re.findall(r"[.0-9]+", value)
    leftover = re.sub(r"[.0-9]+", "", value)
    if not numbers or len(numbers) > 3 or set(leftover) - set(",/ '\""):
        raise ArgumentError(f"--split {value!r}: expected up to 3 comma-separated weights, e.g. 99,1,0")
    return ",".join(numbers)


def resolve_megatron_flags(flags: argparse.Namespace, problems: FlagProblems | None = None) -> argparse.Namespace:
    """A copy of the parsed flags with Megatron-LM's aliases, value rules and mappings applied (``flags`` is not
    modified; applying it twice gives the same result). The no-op flags given are listed in
    ``megatron_no_op_flags`` (flags/megatron_compat.py), the mappings' start-up lines in ``megatron_notes``.

    Refused, invalid and conflicting flags are recorded in ``problems``; without a collector, they raise one
    ArgumentError (``FlagProblemsError``) that lists them all."""
    own = problems is None
    problems = FlagProblems() if own else problems
    args = argparse.Namespace(**vars(flags))
    args.megatron_no_op_flags = check_compat(args, problems)
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.no_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"
    args.activation = _activation(args, problems)
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    _resolve_recompute(args, problems)
    if not 0.0 < args.rotary_percent <= 1.0:
        problems.invalid(f"--rotary-percent {args.rotary_percent}: must be in (0, 1]")
    _resolve_data_paths(args, problems)
    if args.fp8_format is not None:
        if args.qat == "int8":
            problems.conflict(f"--fp8-format {args.fp8_format} (FP8 training) conflicts with --qat int8")
        args.qat = "fp8"
    elif args.qat == "fp8":
        args.fp8_format = "hybrid"
    optimizer_and_fp8.resolve_fp8_recipe(args, problems)
    args.megatron_notes = resolve_megatron_features(args, problems) + mapped_messages(args)
    if args.ckpt_format not in ("torch", "torch_dist"):
        problems.add("refused", f"--ckpt-format {args.ckpt_format}: the formats here are torch and torch_dist "
                                f"(torch.distributed.checkpoint, Megatron-LM's default)")
    _check_non_persistent(args, problems)
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        problems.conflict("--overlap-param-gather needs --use-distributed-optimizer (Megatron-LM's rule)")
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        problems.conflict(f"--profile-step-start {args.profile_step_start} must be < --profile-step-end "
                          f"{args.profile_step_end}")
    if args.apply_layernorm_1p and args.qat_clamp == "weight-rms":
        problems.conflict("--apply-layernorm-1p with --qat-clamp weight-rms is not supported (the RMS "
                          "prediction reads the norm weights as gamma); use --qat-clamp rms")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        problems.missing("--wandb-project needs the wandb package, which is not installed: "
                         "pip install wandb (or pip install -e '.[wandb]')")
    check_deterministic_flags(args, problems)
    rerun_flags.check(args, problems)
    if args.manual_gc_interval < 0:
        problems.invalid(f"--manual-gc-interval {args.manual_gc_interval}: must be >= 0")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:  # Megatron's validate_args: a warning
        args.sequence_parallel = False
        args.megatron_notes.append(" > warning: Disabling sequence parallelism because tensor model parallelism is "
                                   "disabled")
    if own:
        problems.raise_if_any()
    return args


def _check_non_persistent(args: argparse.Namespace, problems: FlagProblems) -> None:
    """Megatron-LM's non-persistent checkpoints: ``global`` is implemented; ``local`` and ``in_memory`` are
    refused by name; an interval needs a type (Megatron-LM asserts it when it first saves)."""
    kind = args.non_persistent_ckpt_type
    if kind in ("local", "in_memory"):
        problems.add("refused", f"--non-persistent-ckpt-type {kind}: only global non-persistent checkpoints are "
                                f"implemented here (a normal checkpoint in --non-persistent-global-ckpt-dir, default "
                                f"<save>/non_persistent); use --non-persistent-ckpt-type global")
    if args.non_persistent_save_interval is not None and kind is None:
        problems.conflict(f"--non-persistent-save-interval {args.non_persistent_save_interval} needs "
                          f"--non-persistent-ckpt-type global")


# --activation and Megatron-LM's switches -> GPTConfig.activation; Megatron-LM's MLP is GeLU without a switch
_ACTIVATION_FLAGS = {"--swiglu": "swiglu", "--squared-relu": "relu2", "--openai-gelu": "gelu_tanh"}
_ACTIVATION_NAMES = {"gelu": "gelu_erf", "gelu_tanh": "gelu_tanh", "relu2": "relu2", "swiglu": "swiglu"}


def _activation(args: argparse.Namespace, problems: FlagProblems) -> str:
    """The MLP activation: --activation, or Megatron-LM's switches, or Megatron-LM's default (erf GeLU)."""
    chosen = {f: a for f, a in _ACTIVATION_FLAGS.items() if vars(args)[f[2:].replace("-", "_")]}
    if args.activation is not None:
        chosen[f"--activation {args.activation}"] = _ACTIVATION_NAMES[args.activation]
    if len(set(chosen.values())) > 1:
        problems.conflict(f"{' and '.join(chosen)}: choose one MLP activation")
    return next(iter(chosen.values()), "gelu_erf")


def _resolve_recompute(args: argparse.Namespace, problems: FlagProblems) -> None:
    if args.recompute_granularity == "selective" and args.recompute_method is not None:
        problems.conflict("--recompute-method applies to --recompute-granularity full, not selective")
    if args.recompute_method is not None and args.recompute_granularity is None:
        problems.conflict("--recompute-method needs --recompute-granularity full")
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            args.recompute_method = "uniform"
        if args.recompute_num_layers is None:
            args.recompute_num_layers = 1 if args.recompute_method == "uniform" else args.num_layers
        if args.recompute_num_layers < 0 or (args.recompute_method == "uniform" and args.recompute_num_layers < 1):
            problems.invalid(f"--recompute-num-layers {args.recompute_num_layers}: must be >= 1 (uniform) or >= 0 "
                             f"(block)")


def _resolve_data_paths(args: argparse.Namespace, problems: FlagProblems) -> None:
    if args.split is not None:
        try:
            args.split = normalize_split(args.split)
        except ArgumentError as e:
            problems.invalid(str(e))
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if any(p is not None for p in per_split):
        if args.data_path is not None:
            problems.conflict("--data-path and --train-data-path/--valid-data-path/--test-data-path are "
                              "exclusive (Megatron-LM's rule)")
        if args.train_data_path is None:
            problems.conflict("--valid-data-path / --test-data-path need --train-data-path")
    elif args.data_path is not None and args.split is None:
        args.split = "969,30,1"  # Megatron-LM's legacy default when --data-path comes without --split


def check_flags(args: argparse.Namespace, vocab_size: int | None, problems: FlagProblems) -> None:
    """Cross-flag checks that no single component config can make."""
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp > 1 and args.seq_length % tp != 0:
        problems.conflict(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by TP {tp}")
    max_pos = args.max_position_embeddings
    if max_pos is not None and args.seq_length > max_pos:  # as Megatron: for every position embedding type
        problems.conflict(f"--seq-length {args.seq_length} is larger than --max-position-embeddings {max_pos}; "
                          f"raise --max-position-embeddings to at least {args.seq_length} or lower --seq-length")
    if args.squinch_hierarchical and not args.squinch:
        problems.conflict("--squinch-hierarchical needs --squinch")
    if args.data_path is None and args.train_data_path is None and not args.mock_data:
        problems.missing("set --data-path (or --train-data-path) with preprocessed prefixes, or --mock-data")
    if args.mock_data and args.vocab_size is None and args.tokenizer_model is None:
        problems.missing("--mock-data needs --vocab-size (or a --tokenizer-model)")
    elif vocab_size is None:
        problems.missing("the vocabulary size is unknown: pass the tokenizer's (build_config(..., vocab_size=)) "
                         "or set --vocab-size")
    if args.save_interval is not None and args.save is None:
        problems.conflict("--save-interval needs --save DIR")
    if args.check_weight_hash_across_dp_replicas_interval is not None and args.use_torch_fsdp2:
        problems.conflict("--check-weight-hash-across-dp-replicas-interval does not run with --use-torch-fsdp2: its "
                          "data-parallel ranks hold shards, not replicas (megatron-core's rule for Megatron-FSDP)")
    if args.use_torch_fsdp2 and args.save and args.ckpt_format != "torch_dist":
        problems.conflict("--use-torch-fsdp2 saves only --ckpt-format torch_dist: FSDP2 parameters are DTensor "
                          f"shards; the per-rank torch format is refused (got --ckpt-format {args.ckpt_format})")
    if args.use_torch_fsdp2 and args.load and args.ckpt_format != "torch_dist" and not args.auto_detect_ckpt_format:
        problems.conflict("--use-torch-fsdp2 loads only torch_dist checkpoints: pass --ckpt-format torch_dist (or "
                          "--auto-detect-ckpt-format)")
    if args.padded_vocab_size is not None and vocab_size is not None and args.padded_vocab_size < vocab_size:
        problems.conflict(f"--padded-vocab-size {args.padded_vocab_size} is smaller than the vocabulary ({vocab_size})")
    _check_model_flags(args, problems)
    _check_eval_batch(args, problems)
    _check_context_parallel(args, problems)
    optimizer_and_fp8.check(args, virtual_pipeline_size(args), problems)
    mup.check(args, problems)


CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def _check_cp_comm_type(args: argparse.Namespace, problems: FlagProblems) -> None:
    """--cp-comm-type and --hierarchical-context-parallel-sizes: Megatron's values and rules (mapped: the same
    exchange runs for every value)."""
    kinds = args.cp_comm_type
    bad = [k for k in kinds if k not in CP_COMM_TYPES]
    if bad:
        problems.invalid(f"--cp-comm-type {' '.join(bad)}: each value must be one of {', '.join(CP_COMM_TYPES)}")
    if len(kinds) not in (1, args.num_layers):
        problems.invalid(f"--cp-comm-type: one value, or one per layer ({args.num_layers}); got {len(kinds)}")
    sizes = args.hierarchical_context_parallel_sizes
    if "a2a+p2p" in kinds and sizes is None:
        problems.conflict("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (Megatron-LM's rule)")
    if sizes is not None and math.prod(sizes) != args.context_parallel_size:
        problems.conflict(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: their product must be "
                          f"--context-parallel-size {args.context_parallel_size}")


def _check_context_parallel(args: argparse.Namespace, problems: FlagProblems) -> None:
    """What --context-parallel-size > 1 needs from the other flags."""
    _check_cp_comm_type(args, problems)
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp < 1:
        problems.invalid(f"--context-parallel-size {cp}: must be >= 1")
    if cp <= 1:
        return
    if args.seq_length % (2 * cp) != 0:
        problems.conflict(f"--context-parallel-size {cp} needs --seq-length {args.seq_length} divisible by 2 x CP = "
                          f"{2 * cp} (the sequence is cut into 2 x CP chunks or more)")
    elif args.sequence_parallel and tp > 1 and (args.seq_length // cp) % tp != 0:
        problems.conflict(f"--sequence-parallel with --context-parallel-size {cp} needs --seq-length / CP = "
                          f"{args.seq_length // cp} divisible by TP {tp}")
    if attention_backend_for(args.attention_backend) == "flex":
        problems.conflict(f"--attention-backend flex does not run with --context-parallel-size {cp}: use triton "
                          f"(CUDA) or blocked (CPU), or leave it unset")


def _check_model_flags(args: argparse.Namespace, problems: FlagProblems) -> None:
    if args.padded_vocab_size is not None and args.padded_vocab_size % args.tensor_model_parallel_size:
        problems.conflict(f"--padded-vocab-size {args.padded_vocab_size} is not divisible by "
                          f"--tensor-model-parallel-size {args.tensor_model_parallel_size}")
    if args.use_rope_scaling and args.position_embedding_type != "rope":
        problems.conflict("--use-rope-scaling needs rotary position embeddings (--position-embedding-type rope)")
    if args.rope_scaling_factor <= 0:
        problems.invalid(f"--rope-scaling-factor {args.rope_scaling_factor}: must be > 0")


def _check_eval_batch(args: argparse.Namespace, problems: FlagProblems) -> None:
    if args.eval_micro_batch_size is not None and args.eval_micro_batch_size != args.micro_batch_size:
        problems.add("refused", f"--eval-micro-batch-size {args.eval_micro_batch_size}: evaluation runs the training "
                                f"micro-batch (--micro-batch-size {args.micro_batch_size}) here")


def check_machine(args: argparse.Namespace, problems: FlagProblems) -> None:
    """What the flags need from this machine: the distributed backend, the device, and the files they name
    (dataset prefixes, GPT-2 BPE files); recorded in ``problems`` beside the flag problems (one report)."""
    import os

    import torch.distributed as dist

    from ...core.device import cuda_available
    from ..features.determinism import check_deterministic_environment

    if args.distributed_backend == "nccl" and not (dist.is_available() and dist.is_nccl_available()):
        problems.missing("--distributed-backend nccl: this PyTorch has no NCCL (\"Distributed package doesn't have "
                         "NCCL built in\"); use --distributed-backend gloo, or leave it unset")
    check_deterministic_environment(args, os.environ, problems)
    if args.device == "cuda" and not cuda_available():
        problems.missing("--device cuda: no CUDA device is available here; use --device cpu, or leave it unset")
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        for prefix in vars(args)[flag[2:].replace("-", "_")] or []:
            if _is_number(prefix):  # a blend weight
                continue
            absent = [f"{prefix}{ext}" for ext in (".idx", ".bin") if not os.path.isfile(f"{prefix}{ext}")]
            if absent:
                problems.missing(f"{flag} {prefix}: {' and '.join(absent)} not found (a dataset prefix names "
                                 f"<prefix>.idx and <prefix>.bin, e.g. what tools/preprocess_data.py writes)")
    for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
        if path is not None and not os.path.isfile(path):
            problems.missing(f"{flag} {path}: file not found")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

"""Command-line flags (named as in Megatron-LM wherever Megatron has the concept) and the one pure
function, :func:`build_config`, that turns the parsed flags into a typed :class:`TrainConfig`.

Adding a flag: ``add_argument`` it in its group below (or its topic's module in ``flags/``: checkpointing,
pipeline split, FIM, MoE, ...), add a field to the component config that uses
it (``training/config.py``, ``core/models/gpt/config.py``, ``core/distributed/config.py``,
``core/optimizer/config.py``), and one line in that component's ``_..._config`` builder here.
"""
from __future__ import annotations

import argparse

from ..core.diloco import DilocoConfig
from ..core.distributed.config import DDPConfig, SquinchConfig
from ..core.models.gpt.config import GPTConfig
from ..core.optimizer.config import OptimizerConfig, SchedulerConfig
from ..core.quantization.qat_config import QATConfig
from . import divergence
from .config import (
    ArgumentError,
    DataConfig,
    DistillConfig,
    LoggingConfig,
    ParallelConfig,
    TokenizerConfig,
    TrainConfig,
    TrainingConfig,
    flag_range_problems,
)
from .flags import checkpoint_flags, fim, kaiju, mup, optimizer_and_fp8, pipeline_split
from .flags.diloco import add_diloco_arguments, diloco_config
from .flags.layout import Layout
from .flags.megatron_compat import add_compat_arguments, attention_backend_for
from .flags.megatron_features import (
    add_megatron_features,
    add_megatron_numerics,
    check_megatron_numerics,
    loss_scale_config,
)
from .flags.moe import add_moe_arguments, expert_sizes, moe_config
from .flags.report import FlagProblems, parse_collecting
from .flags.rules import check_flags, check_machine, normalize_split, resolve_megatron_flags
from .tokenizer import vocab_size_with_padding

# Megatron-LM's --attention-backend names, then ours.
ATTENTION_BACKENDS = ["auto", "flash", "fused", "unfused", "local", "eager", "blocked", "cpu", "flex", "triton"]

__all__ = ["ArgumentError", "build_config", "build_parser", "normalize_split", "parse_args", "parse_config",
           "resolve_megatron_flags"]


def _model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4, help="Megatron-LM: required; a small demo model here")
    g.add_argument("--hidden-size", type=int, default=256, help="Megatron-LM: required; a small demo model here")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4, help="Megatron-LM: required; a small demo model here")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1, help="KV heads with --group-query-attention")
    g.add_argument("--kv-channels", type=int, default=None, help="head dim; default hidden / heads")
    g.add_argument("--seq-length", type=int, default=256, help="Megatron-LM: required; a small demo model here")
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
                   default="learned_absolute")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="same as --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_true", help="same as --position-embedding-type none")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="fraction of each head's dims rotated by RoPE")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x RoPE frequency scaling (megatron-core's: low/high frequency factors 1 and 4, "
                        "original context 8192)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="the factor of --use-rope-scaling")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE rotates pairs of even and odd dimensions (RoFormer), not the two halves of each head")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="multiply the attention output by sigmoid of a per-head gate projected from the layer input "
                        "(megatron-core's gated attention, Qwen3-Next)")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (same as --activation swiglu)")
    g.add_argument("--activation", choices=["gelu", "gelu_tanh", "relu2", "swiglu"], default=None,
                   help="MLP activation (a flag of ours); without it, Megatron-LM's: GeLU (erf) unless --swiglu, "
                        "--squared-relu or --openai-gelu (tanh GeLU)")
    g.add_argument("--squared-relu", action="store_true", help="same as --activation relu2")
    g.add_argument("--openai-gelu", action="store_true", help="same as --activation gelu_tanh (tanh approximation)")
    g.add_argument("--qk-layernorm", action="store_true", help="normalize queries and keys per head (--normalization)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred norm weights: the norms scale by (1 + weight), weight initialised to 0")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the query/key/value projections even with --disable-bias-linear (Qwen2)")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="embedding and output rows, instead of the vocabulary rounded up to a multiple of "
                        "--make-vocab-size-divisible-by x TP")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="core attention kernel. Megatron-LM's names: auto, flash and fused (the device's fused "
                        "flash-style kernel: Triton on CUDA, the blocked kernel on CPU), unfused and local (the "
                        "eager reference); ours: eager, blocked (= cpu), flex, triton")
    g.add_argument("--attention-zreg-coeff", type=float, default=0.0,
                   help="Attention Z-Reg: inject the gradient of w * mean(lse^2) (no loss term)")
    g.add_argument("--output-zreg-coeff", type=float, default=0.0,
                   help="z-loss on the output logits, injected as a gradient in the cross entropy")
    g.add_argument("--window-size", type=int, default=None, help="sliding attention window (in positions)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full: recompute whole transformer layers in backward (see --recompute-method); "
                        "selective: recompute only the core attention")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full recompute: uniform checkpoints groups of --recompute-num-layers layers; block "
                        "recomputes the first --recompute-num-layers layers of each pipeline stage")
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-activations", action="store_true", help="same as --recompute-granularity selective")


def _parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    pipeline_split.add_arguments(g)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence over this many ranks (layout TP, CP, DP, PP as Megatron-LM's; "
                        "gradients reduce over DP x CP); attention moves and computes only the key/value "
                        "chunks some query can see (docs/context-parallel.md)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="global ranks enumerate TP, CP, PP, then DP (megatron-core's order tp-cp-ep-pp-dp); default "
                        "TP, CP, DP, then PP")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="fully sharded data parallel on PyTorch FSDP2 (parameters, gradients and optimizer "
                        "state sharded over DP); composes with TP, SP, PP and --squinch")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="distributed optimizer: all-gather the updated parameter shards in the background and "
                        "wait for each bucket just before its first use in the next forward")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: max(40M, 1M x DP) with --overlap-grad-reduce)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl on CUDA, gloo on CPU (Megatron-LM: nccl; NCCL cannot run on CPU)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="every process group's collective timeout (fractions allowed); a rank that stops "
                        "answering makes the others exit after this long")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node for hierarchical reduction (default: LOCAL_WORLD_SIZE); "
                        "set it to simulate nodes on one machine")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="the same losses and weights run to run (CPU: always): Megatron-LM's NCCL_ALGO=Ring, "
                        "CUBLAS_WORKSPACE_CONFIG=:4096:8, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 where unset, and "
                        "torch.use_deterministic_algorithms (megatron_cai/training/features/determinism.py)")
    s = p.add_argument_group("squinch gradient compression")
    s.add_argument("--squinch", action="store_true", help="6-bit Squinch compression of DP gradients")
    s.add_argument("--squinch-error-feedback", dest="squinch_error_feedback", action="store_true", default=True)
    s.add_argument("--no-squinch-error-feedback", dest="squinch_error_feedback", action="store_false")
    s.add_argument("--squinch-stochastic-rounding", action="store_true")
    s.add_argument("--squinch-hierarchical", action="store_true",
                   help="uncompressed reduce-scatter inside a node, Squinch across nodes")


def _training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4, help="Megatron-LM: required; 4 for a quick demo")
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x DP")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--lr", type=float, default=3e-4, help="Megatron-LM: required; 3e-4 for a quick demo")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="weight decay on the query / key layernorms' parameters too (other 1-D parameters: none)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true", help="bf16 autocast; fp32 master weights and grads")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss is the sum over all loss tokens of the global batch divided by their number "
                        "(default: the mean over micro-batches of each micro-batch's token mean)")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="adam: AdamW (decoupled weight decay, as Megatron-LM's adam); sgd: SGD with momentum")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0,
                   help="empty the CUDA caching allocator: 1 after each training step, 2 also after each "
                        "forward-backward and evaluation")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic garbage collection; collect every --manual-gc-interval steps")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="0: collect only at the end of training")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="every N iterations, check that the data-parallel replicas hold bit-identical weights "
                        "(stops with the ranks that differ); not with --use-torch-fsdp2")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (inductor; off by default, as in torchtitan)")
    q = p.add_argument_group("quantization-aware training")
    q.add_argument("--qat", choices=["none", "int8", "fp8"], default="none")
    q.add_argument("--qat-clamp", choices=["absmax", "static", "rms", "weight-rms"], default="rms")
    q.add_argument("--qat-clamp-alpha", type=float, default=None,
                   help="c = alpha x RMS for rms / weight-rms (default: 12 for int8, 32 for fp8)")
    q.add_argument("--qat-granularity", choices=["tensor", "row", "block"], default="tensor",
                   help="one activation clamp per tensor, per token (row) or per 128 elements (block)")
    q.add_argument("--qat-static-clamp", type=float, default=None,
                   help="c for --qat-clamp static (default: calibrated once, the absmax of the first batch)")
    q.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="FP8 training, as in Megatron-LM: turns on --qat fp8 with this format (e4m3: E4M3 for "
                        "forward and backward; hybrid: E4M3 forward, E5M2 gradients); with --qat fp8 alone, "
                        "hybrid")
    q.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="local here because Transformer Engine is optional (Megatron-LM: transformer_engine). "
                        "transformer_engine: with --qat fp8 on CUDA, the linears' GEMMs run in Transformer "
                        "Engine under its FP8 autocast (TE's scaling, not the clamp rules)")
    d = p.add_argument_group("distillation")
    d.add_argument("--distill-samples", default=None, help="teacher-sample sidecar (tools/dump_teacher_samples.py)")
    d.add_argument("--distill-teacher-load", default=None, help="online distillation from this checkpoint")
    d.add_argument("--distill-alpha", type=float, default=0.5)
    d.add_argument("--distill-temperature", type=float, default=1.0)
    d.add_argument("--distill-estimator", choices=["priority", "self-normalized", "topk", "full"],
                   default="priority")
    d.add_argument("--distill-k", type=int, default=32, help="samples per position for online distillation")


def _data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="a prefix, several prefixes, or weight-prefix pairs (W1 P1 W2 P2 ...)")
    g.add_argument("--split", default=None,
                   help="train,valid,test weights, e.g. 99,1,0 (quotes around the value are ignored, as Megatron's "
                        "number scan ignores them); with --data-path and no --split, Megatron's legacy 969,30,1")
    g.add_argument("--train-data-path", nargs="*", default=None, help="prefixes (or weight-prefix pairs) for train")
    g.add_argument("--valid-data-path", nargs="*", default=None, help="prefixes for validation")
    g.add_argument("--test-data-path", nargs="*", default=None, help="prefixes for test")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens, no files")
    g.add_argument("--allow-data-change", action="store_true",
                   help="resume although a data file's content fingerprint differs from the one the checkpoint "
                        "recorded (by default an error naming the file; each changed file is then a warning)")
    g.add_argument("--tokenizer-type", default=None,
                   help="default: GPT2BPETokenizer when --vocab-file and --merge-file are given (as Megatron-LM's GPT "
                        "example scripts), else SentencePieceTokenizer (what tools/train_tokenizer.py makes)",
                   choices=["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for NullTokenizer / mock data")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="packed documents cannot attend to each other (visibility intervals)")
    g.add_argument("--data-format", choices=["auto", "plain", "tree"], default="auto",
                   help="tree: tree-structured documents (tools/preprocess_data.py --tree), packed whole with "
                        "visibility intervals; auto: tree when the prefix has a .tree sidecar")
    g.add_argument("--tree-loss-weighting", choices=["token", "branch"], default="token",
                   help="tree data: every predicted token weighs 1 (token), or its fraction of the tree's "
                        "branches (branch: each tree's loss = the token mean of its flattened branches)")


def _logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--eval-interval", type=int, default=None, help="default: no periodic evaluation")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="batches per evaluation; after training (unless an exit flag or signal ended it), the "
                        "validation and test sets are evaluated once more, as in Megatron-LM (0: never)")
    g.add_argument("--skip-train", action="store_true",
                   help="no training loop: evaluate the validation and test sets (of --load's model) and exit; "
                        "nothing is saved or written to TensorBoard")
    g.add_argument("--eval-global-batch-size", type=int, default=None,
                   help="samples per evaluation iteration (default: the global batch)")
    g.add_argument("--eval-micro-batch-size", type=int, default=None,
                   help="taken when it equals --micro-batch-size (evaluation runs the training micro-batch here)")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    # gradient-reduction phase timers (core/distributed/comm_timing.py)
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="1: per-phase time of the Squinch gradient reduction every --log-interval; "
                        "2: also per bucket, and the backward timeline (when each bucket is handed to the reducer; "
                        "the step-time model's input, bench/squinch_scale.py)")
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="write Megatron's TensorBoard scalars (this iteration's values) at iterations divisible "
                        "by this")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-throughput", action="store_true", help="log model TFLOP/s per GPU (Megatron's formula)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write iteration-time (and throughput with --log-throughput, and the gradient-reduction "
                        "phase timers with --timing-log-level) to TensorBoard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
                   dest="log_loss_scale_to_tensorboard",
                   action="store_false", default=True)
    g.add_argument("--log-params-norm", action="store_true",
                   help="the L2 norm of all parameters (each distinct element once) in the log line and TensorBoard")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="the number of zero gradient elements in the log line and TensorBoard")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="Megatron's mem-* tags: CUDA allocator statistics (on CPU: the process's resident bytes)")
    g.add_argument("--wandb-project", default=None, help="log to Weights & Biases (pip install wandb)")
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--wandb-entity", default=None)
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler trace of steps [--profile-step-start, --profile-step-end) on "
                        "--profile-ranks, written for TensorBoard to --tensorboard-dir (else ./profile)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[], help="default: every rank")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", dest="exit_signal_handler", action="store_true", default=True,
                   help="on by default here (Megatron-LM: off), so that Slurm preemption saves a checkpoint; "
                        "see --no-exit-signal-handler")
    g.add_argument("--no-exit-signal-handler", dest="exit_signal_handler", action="store_false", default=True,
                   help="by default SIGTERM/SIGUSR1 save a checkpoint and exit cleanly")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="megatron-cai GPT pretraining", allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add in (_model, _parallel, _training, _data, checkpoint_flags.add_arguments, _logging, add_megatron_numerics,
                add_megatron_features, divergence.add_arguments, add_moe_arguments, add_diloco_arguments,
                kaiju.add_arguments, fim.add_arguments, mup.add_arguments):
        add(p)
    add_compat_arguments(p)
    return p


def parse_args(argv: list[str] | None = None, machine: bool = False) -> argparse.Namespace:
    """The parsed flags, as given (nothing derived, nothing validated: see :func:`build_config`).

    Unknown flags and values a flag cannot take raise one :class:`FlagProblemsError` that lists them all,
    together with the refused and conflicting flags among the rest (never argparse's usage dump).
    ``machine``: also check what the flags need from this machine (backend, device, files: ``check_machine``),
    in the same report."""
    import sys

    args, problems = parse_collecting(build_parser(), sys.argv[1:] if argv is None else list(argv))
    if machine:
        check_machine(args, problems)
    if problems:
        resolve_megatron_flags(args, problems)  # the refused and conflicting flags too, in the same report
        problems.raise_if_any()
    return args


def parse_config(argv: list[str] | None = None, world_size: int | None = None,
                 vocab_size: int | None = None) -> TrainConfig:
    """``build_config(parse_args(argv), world_size, vocab_size)``; the world size defaults to the
    launcher's (torchrun / Slurm environment)."""
    if world_size is None:
        from .initialize import discover_env

        world_size = discover_env().world_size
    return build_config(parse_args(argv), world_size, vocab_size=vocab_size)


# ------------------------------------------------------------------------------------------ builder
def _qat_config(args: argparse.Namespace) -> QATConfig:
    if args.qat == "none":
        return QATConfig()
    return QATConfig(
        fmt=args.qat,
        clamp=args.qat_clamp,
        alpha=args.qat_clamp_alpha,
        static_value=args.qat_static_clamp,
        granularity=args.qat_granularity,
        fp8_format=args.fp8_format or "hybrid",  # None unless --fp8-format or --qat fp8
        weight_granularity="tensor" if args.fp8_recipe == "tensorwise" else "row",  # per-tensor current scaling
        gemm_backend="transformer_engine" if args.transformer_impl == "transformer_engine" else "fake",
    )


def _model_config(args: argparse.Namespace, layout: Layout, vocab_size: int) -> GPTConfig:
    tp = args.tensor_model_parallel_size
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        padded_vocab_size=args.padded_vocab_size or vocab_size_with_padding(vocab_size,
                                                                            args.make_vocab_size_divisible_by, tp),
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=layout.num_query_groups,
        kv_channels=args.kv_channels,
        seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        rotary_interleaved=args.rotary_interleaved,
        attention_output_gate=args.attention_output_gate,
        qk_layernorm=args.qk_layernorm,
        apply_layernorm_1p=args.apply_layernorm_1p,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        activation=args.activation,  # resolved: --activation, --swiglu, --squared-relu, --openai-gelu or GeLU
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        sequence_parallel=args.sequence_parallel and tp > 1,
        attention_backend=attention_backend_for(args.attention_backend),
        attention_zreg_coeff=args.attention_zreg_coeff,
        attention_zreg_scale=1.0 / layout.num_microbatches,
        output_zreg_coeff=args.output_zreg_coeff,
        window_size=args.window_size,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        qat=_qat_config(args),
        moe=moe_config(args),
        **kaiju.model_fields(args), **mup.model_fields(args),
        **pipeline_split.model_fields(args),
    )


def _expert_sizes(args: argparse.Namespace, world_size: int) -> dict:
    ep, etp = expert_sizes(args, world_size)
    return {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}


def _parallel_config(args: argparse.Namespace, layout: Layout) -> ParallelConfig:
    return ParallelConfig(
        world_size=layout.world_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=layout.data_parallel_size,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        virtual_pipeline_model_parallel_size=layout.vpp,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_virtual_pipeline_stage,
        sequence_parallel=args.sequence_parallel,
        distributed_backend=args.distributed_backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        ranks_per_node=args.ranks_per_node,
        device=args.device,
        deterministic_mode=args.deterministic_mode,
        use_tp_pp_dp_mapping=args.use_tp_pp_dp_mapping,
        **_expert_sizes(args, layout.world_size),
    )


def _training_config(args: argparse.Namespace, layout: Layout) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=args.micro_batch_size,
        global_batch_size=layout.global_batch_size,
        num_microbatches=layout.num_microbatches,
        train_iters=layout.train_iters,
        train_samples=args.train_samples,
        seed=args.seed,
        bf16=args.bf16,
        fp16=args.fp16,
        loss_scale=loss_scale_config(args),
        rampup_batch_size=layout.microbatches.rampup,
        step_batch_size_schedule=layout.microbatches.step_schedule,
        decrease_batch_size_if_needed=args.decrease_batch_size_if_needed,
        exit_interval=args.exit_interval,
        exit_duration_in_mins=args.exit_duration_in_mins,
        exit_signal_handler=args.exit_signal_handler,
        divergence=divergence.DivergenceConfig.from_args(args),
        calculate_per_token_loss=args.calculate_per_token_loss,
        empty_unused_memory_level=args.empty_unused_memory_level,
        manual_gc=args.manual_gc,
        manual_gc_interval=args.manual_gc_interval,
        compile=args.compile,
        skip_train=args.skip_train,
        check_weight_hash_across_dp_replicas_interval=args.check_weight_hash_across_dp_replicas_interval,
    )


def _ddp_config(args: argparse.Namespace) -> DDPConfig:
    reducer = "squinch" if args.squinch else ("reducescatter" if args.use_distributed_optimizer else "allreduce")
    return DDPConfig(
        reducer=reducer,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        bucket_size=args.ddp_bucket_size,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        use_torch_fsdp2=args.use_torch_fsdp2,
        squinch=SquinchConfig(
            error_feedback=args.squinch_error_feedback,
            stochastic_rounding=args.squinch_stochastic_rounding,
            hierarchical=args.squinch_hierarchical,
        ),
    )


def _optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        lr=args.lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer, optimizer=args.optimizer,
        sgd_momentum=args.sgd_momentum, overlap_param_gather=args.overlap_param_gather,
        apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm or args.no_weight_decay_cond_type is not None,
        **mup.optimizer_fields(args),
    )


def _scheduler_config(args: argparse.Namespace, layout: Layout) -> SchedulerConfig:
    """Megatron's get_optimizer_param_scheduler: lengths in samples, from --lr-*-iters x global batch size with
    --train-iters, or from the --lr-*-samples flags with --train-samples."""
    if args.train_samples is not None:
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warmup = args.lr_warmup_samples
        wsd = args.lr_wsd_decay_samples
    else:
        gbs = layout.global_batch_size
        decay = (args.lr_decay_iters if args.lr_decay_iters is not None else layout.train_iters) * gbs
        warmup = args.lr_warmup_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return SchedulerConfig(
        lr=args.lr,
        min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style,
        lr_warmup_samples=warmup,
        lr_decay_samples=decay,
        lr_warmup_init=args.lr_warmup_init,
        lr_wsd_decay_samples=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr, **mup.scheduler_fields(args),
        use_checkpoint_values=args.use_checkpoint_opt_param_scheduler,
    )


def _data_config(args: argparse.Namespace) -> DataConfig:
    return DataConfig(
        data_path=list(args.data_path) if args.data_path is not None else None,
        train_data_path=list(args.train_data_path) if args.train_data_path is not None else None,
        valid_data_path=list(args.valid_data_path) if args.valid_data_path is not None else None,
        test_data_path=list(args.test_data_path) if args.test_data_path is not None else None,
        split=args.split,
        data_cache_path=args.data_cache_path,
        mock_data=args.mock_data,
        allow_data_change=args.allow_data_change,
        num_workers=args.num_workers,
        eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        data_format=args.data_format,
        tree_loss_weighting=args.tree_loss_weighting,
        fim=fim.settings(args),
    )


def tokenizer_type(args: argparse.Namespace) -> str:
    """--tokenizer-type, or its default: GPT2BPETokenizer with --vocab-file and --merge-file, else
    SentencePieceTokenizer."""
    if args.tokenizer_type is not None:
        return args.tokenizer_type
    return "GPT2BPETokenizer" if args.vocab_file and args.merge_file else "SentencePieceTokenizer"


def _tokenizer_config(args: argparse.Namespace) -> TokenizerConfig:
    return TokenizerConfig(
        tokenizer_type=tokenizer_type(args),
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tiktoken_special_tokens=args.tiktoken_special_tokens,
    )


def _logging_config(args: argparse.Namespace) -> LoggingConfig:
    return LoggingConfig(
        log_interval=args.log_interval,
        tensorboard_dir=args.tensorboard_dir,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        eval_global_batch_size=args.eval_global_batch_size,
        timing_log_level=args.timing_log_level,
        tensorboard_log_interval=args.tensorboard_log_interval,
        tensorboard_queue_size=args.tensorboard_queue_size,
        log_throughput=args.log_throughput,
        log_timers_to_tensorboard=args.log_timers_to_tensorboard,
        log_validation_ppl_to_tensorboard=args.log_validation_ppl_to_tensorboard,
        log_world_size_to_tensorboard=args.log_world_size_to_tensorboard,
        log_loss_scale_to_tensorboard=args.log_loss_scale_to_tensorboard,
        log_params_norm=args.log_params_norm,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        log_memory_to_tensorboard=args.log_memory_to_tensorboard,
        wandb_project=args.wandb_project,
        wandb_exp_name=args.wandb_exp_name,
        wandb_save_dir=args.wandb_save_dir,
        wandb_entity=args.wandb_entity,
        profile=args.profile,
        profile_step_start=args.profile_step_start,
        profile_step_end=args.profile_step_end,
        profile_ranks=list(args.profile_ranks),
        megatron_no_op_flags=list(args.megatron_no_op_flags),
        megatron_notes=list(args.megatron_notes),
        logging_level=args.logging_level,
    )


def _distill_config(args: argparse.Namespace) -> DistillConfig:
    return DistillConfig(
        samples=args.distill_samples,
        teacher_load=args.distill_teacher_load,
        alpha=args.distill_alpha,
        temperature=args.distill_temperature,
        estimator=args.distill_estimator,
        k=args.distill_k,
    )


def build_config(args: argparse.Namespace, world_size: int, vocab_size: int | None = None) -> TrainConfig:
    """The run's :class:`TrainConfig` from the parsed flags and the world size; validated.

    Pure: ``args`` is not modified, so building twice from the same flags gives equal configs, and a
    config can be rebuilt for another world size (``rebuild_for_world_size``). ``vocab_size``: the
    tokenizer's vocabulary (default ``--vocab-size``). Raises :class:`ArgumentError` naming the flag.
    """
    flags = args
    problems = FlagProblems()
    for message in flag_range_problems(flags):
        problems.invalid(message)
    problems.raise_if_any()  # values out of range first: the checks below would trip over them
    args = resolve_megatron_flags(flags, problems)
    vocab = vocab_size if vocab_size is not None else args.vocab_size
    check_flags(args, vocab, problems)
    fim.check(args, problems)
    check_megatron_numerics(args, problems)
    try:
        layout = Layout(args, world_size)
        optimizer_and_fp8.check_instances(args, layout.data_parallel_size * args.context_parallel_size, problems)
    except ArgumentError as e:
        problems.record(e)
    diloco: DilocoConfig = diloco_config(args, world_size, problems)
    problems.raise_if_any()  # every problem found so far, in one report
    try:
        config = TrainConfig(
            model=_model_config(args, layout, vocab),
            parallel=_parallel_config(args, layout),
            training=_training_config(args, layout),
            ddp=_ddp_config(args),
            optimizer=_optimizer_config(args),
            scheduler=_scheduler_config(args, layout),
            data=_data_config(args),
            tokenizer=_tokenizer_config(args),
            checkpoint=checkpoint_flags.checkpoint_config(args),
            logging=_logging_config(args),
            distill=_distill_config(args),
            diloco=diloco,
            flags=dict(vars(flags)),
        )
    except ArgumentError:
        raise
    except ValueError as e:  # a component config's own check; its message names the flag
        raise ArgumentError(str(e)) from None
    return config


def rebuild_for_world_size(config: TrainConfig, world_size: int) -> TrainConfig:
    """The same flags built for another world size (e.g. when the launcher's differs from a guess)."""
    return build_config(argparse.Namespace(**config.flags), world_size, vocab_size=config.model.vocab_size)

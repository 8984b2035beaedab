"""Command-line flags, named as in Megatron-LM wherever Megatron has the concept."""
from __future__ import annotations

import argparse
import math

from ..core.parallel_state import ParallelLayoutError, check_layout


def _model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1, help="KV heads with --group-query-attention")
    g.add_argument("--kv-channels", type=int, default=None, help="head dim; default hidden / heads")
    g.add_argument("--seq-length", type=int, default=256)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default="rope")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (same as --activation swiglu)")
    g.add_argument("--activation", choices=["relu2", "swiglu", "gelu"], default="relu2",
                   help="MLP activation; relu2 (squared ReLU) is the default")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--attention-backend", default=None,
                   help="core attention backend: eager | cpu | flex | triton (default: best for the device)")
    g.add_argument("--attention-zreg-coeff", type=float, default=0.0,
                   help="Attention Z-Reg: inject the gradient of w * mean(lse^2) (no loss term)")
    g.add_argument("--output-zreg-coeff", type=float, default=0.0,
                   help="z-loss on the output logits, injected as a gradient in the cross entropy")
    g.add_argument("--window-size", type=int, default=None, help="sliding attention window (in positions)")
    g.add_argument("--recompute-granularity", choices=["full"], default=None,
                   help="recompute each transformer layer in backward to save activation memory")


def _parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: max(40M, 1M x DP) with --overlap-grad-reduce)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl on CUDA, gloo on CPU")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node for hierarchical reduction (default: LOCAL_WORLD_SIZE); "
                        "set it to simulate nodes on one machine")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    s = p.add_argument_group("squinch gradient compression")
    s.add_argument("--squinch", action="store_true", help="6-bit Squinch compression of DP gradients")
    s.add_argument("--squinch-error-feedback", dest="squinch_error_feedback", action="store_true", default=True)
    s.add_argument("--no-squinch-error-feedback", dest="squinch_error_feedback", action="store_false")
    s.add_argument("--squinch-stochastic-rounding", action="store_true")
    s.add_argument("--squinch-hierarchical", action="store_true",
                   help="uncompressed reduce-scatter inside a node, Squinch across nodes")


def _training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x DP")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true", help="bf16 autocast; fp32 master weights and grads")
    g.add_argument("--seed", type=int, default=1234)
    q = p.add_argument_group("quantization-aware training")
    q.add_argument("--qat", choices=["none", "int8", "fp8"], default="none")
    q.add_argument("--qat-clamp", choices=["absmax", "static", "rms", "weight-rms"], default="rms")
    q.add_argument("--qat-clamp-alpha", type=float, default=None,
                   help="c = alpha x RMS for rms / weight-rms (default: 12 for int8, 32 for fp8)")
    q.add_argument("--qat-granularity", choices=["tensor", "row", "block"], default="tensor",
                   help="one activation clamp per tensor, per token (row) or per 128 elements (block)")
    q.add_argument("--qat-static-clamp", type=float, default=None,
                   help="c for --qat-clamp static (default: calibrated once, the absmax of the first batch)")
    q.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default="hybrid")
    q.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="transformer_engine: with --qat fp8 on CUDA, the linears' GEMMs run in Transformer "
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
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens, no files")
    g.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                   choices=["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"])
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for NullTokenizer / mock data")
    g.add_argument("--num-workers", type=int, default=0)
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


def _checkpoint(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only; start at iteration 0")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")


def _logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--no-exit-signal-handler", dest="exit_signal_handler", action="store_false", default=True,
                   help="by default SIGTERM/SIGUSR1 save a checkpoint and exit cleanly")


def _megatron_numerics(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's fp16 loss scaling, batch-size ramp-up, tokenizers and LR-schedule flags (its names and
    defaults); extends the choices of --tokenizer-type and --lr-decay-style defined above."""
    from ..core.optimizer.lr_scheduler import DECAY_STYLES, WSD_DECAY_STYLES
    from .tokenizer import TOKENIZER_TYPES

    for action in p._actions:
        if action.dest == "tokenizer_type":
            action.choices = list(dict.fromkeys([*action.choices, *TOKENIZER_TYPES]))
        elif action.dest == "lr_decay_style":
            action.choices = list(dict.fromkeys([*action.choices, *DECAY_STYLES]))
    g = p.add_argument_group("Megatron-LM numerics: fp16, batch ramp-up, tokenizers, LR schedules")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 autocast with loss scaling; fp32 master weights and grads")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale (a positive power of 2 helps convergence); default: dynamic scaling")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32, help="initial dynamic loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="minimum dynamic loss scale")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="clean iterations before the dynamic loss scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows before the dynamic loss scale halves")
    g.add_argument("--rampup-batch-size", nargs="*", default=None,
                   help="START INCREMENT SAMPLES: grow the global batch from START by INCREMENT over SAMPLES "
                        "samples (Megatron's num-microbatches calculator)")
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
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential",
                   help="WSD: the shape of the final anneal")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="WSD anneal length with --train-samples")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD anneal length with --train-iters")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="a separate peak learning rate for the input embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="a separate minimum learning rate for the input embedding and output layer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="megatron-cai GPT pretraining",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add in (_model, _parallel, _training, _data, _checkpoint, _logging, _megatron_numerics):
        add(p)
    return p


def parse_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if world_size is None:
        from .initialize import discover_env

        world_size = discover_env().world_size
    validate_args(args, world_size)
    return args


class ArgumentError(ValueError):
    """A flag value that cannot work; the message names the flag."""


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Fill derived values and reject impossible combinations with one clear message."""
    if args.swiglu:
        args.activation = "swiglu"
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    args.world_size = world_size
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp_guess = max(world_size // max(tp * pp, 1), 1)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp_guess
    try:
        args.data_parallel_size = check_layout(
            world_size, tp, pp, num_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups, global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size, vpp_layers=args.num_layers_per_virtual_pipeline_stage)
    except ParallelLayoutError as e:
        raise ArgumentError(str(e)) from None
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if pp < 2:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
        vpp = args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
        if vpp > 1:
            args.virtual_pipeline_model_parallel_size = vpp
            if args.num_microbatches % pp != 0:
                raise ArgumentError(f"interleaved pipelining needs micro-batches per iteration "
                                    f"({args.num_microbatches}) divisible by pipeline-model-parallel-size {pp}")
    if args.sequence_parallel and tp > 1 and args.seq_length % tp != 0:
        raise ArgumentError(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by TP {tp}")
    if (args.train_iters is None) == (args.train_samples is None):
        raise ArgumentError("set exactly one of --train-iters and --train-samples")
    if args.train_iters is None:
        args.train_iters = math.ceil(args.train_samples / args.global_batch_size)
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.train_iters)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.squinch_hierarchical and not args.squinch:
        raise ArgumentError("--squinch-hierarchical needs --squinch")
    if args.data_path is None and not args.mock_data:
        raise ArgumentError("set --data-path (preprocessed prefixes) or --mock-data")
    if args.mock_data and args.vocab_size is None and args.tokenizer_model is None:
        raise ArgumentError("--mock-data needs --vocab-size (or a --tokenizer-model)")
    if args.save_interval is not None and args.save is None:
        raise ArgumentError("--save-interval needs --save DIR")
    if args.transformer_impl == "transformer_engine":
        from ..core.quantization.gemm_backends import transformer_engine_available

        if args.qat != "fp8":
            raise ArgumentError(f"--transformer-impl transformer_engine runs the linears in FP8 through "
                                f"Transformer Engine: use it with --qat fp8 (got --qat {args.qat})")
        if not transformer_engine_available():
            raise ArgumentError("--transformer-impl transformer_engine needs Transformer Engine "
                                "(pip install transformer_engine[pytorch]), which is not installed; use "
                                "--transformer-impl local for fake-quantized FP8 QAT")
        if args.device == "cpu":
            raise ArgumentError("--transformer-impl transformer_engine runs on CUDA only, not --device cpu")
    if args.distill_samples and args.distill_teacher_load:
        raise ArgumentError("use either --distill-samples (offline) or --distill-teacher-load (online), not both")
    if args.distill_samples or args.distill_teacher_load:
        from .distill import validate_distill_args

        try:
            validate_distill_args(args)
        except ValueError as e:
            raise ArgumentError(str(e)) from None
    _validate_megatron_numerics(args)
    return args


def _validate_megatron_numerics(args: argparse.Namespace) -> None:
    """Checks of the ``_megatron_numerics`` flags (Megatron's rules); sets the ramp-up train_iters."""
    from ..core.num_microbatches_calculator import NumMicroBatchesCalculator, parse_rampup

    if args.fp16 and args.bf16:
        raise ArgumentError("set at most one of --fp16 and --bf16")
    if args.loss_scale is not None and args.loss_scale <= 0:
        raise ArgumentError(f"--loss-scale must be positive, got {args.loss_scale}")
    if args.fp16 and args.loss_scale is None and not 0 < args.min_loss_scale <= args.initial_loss_scale:
        raise ArgumentError(f"--min-loss-scale {args.min_loss_scale} must be positive and at most "
                            f"--initial-loss-scale {args.initial_loss_scale}")
    if args.fp16 and (args.hysteresis < 1 or args.loss_scale_window < 1):
        raise ArgumentError("--hysteresis and --loss-scale-window must be at least 1")
    sample_flags = {"--lr-decay-samples": args.lr_decay_samples is not None,
                    "--lr-warmup-samples": args.lr_warmup_samples != 0,
                    "--lr-wsd-decay-samples": args.lr_wsd_decay_samples is not None,
                    "--rampup-batch-size": args.rampup_batch_size is not None}
    if args.train_samples is None:
        for flag, is_set in sample_flags.items():
            if is_set:
                raise ArgumentError(f"{flag} needs sample-based training (--train-samples), as in Megatron-LM")
    elif args.lr_wsd_decay_iters is not None:
        raise ArgumentError("--lr-wsd-decay-iters needs --train-iters; use --lr-wsd-decay-samples")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        raise ArgumentError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    try:
        rampup = parse_rampup(args.rampup_batch_size)
        calc = NumMicroBatchesCalculator(args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
                                         rampup, args.decrease_batch_size_if_needed)
        calc.check_ramp()
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    args.rampup_batch_size = rampup
    if rampup is not None:
        args.train_iters = calc.train_iters(args.train_samples)
        if args.lr_warmup_fraction is not None:
            args.lr_warmup_iters = 0


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad the embedding rows to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)

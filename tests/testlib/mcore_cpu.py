"""The real megatron-core 0.19.2 (installed with --no-deps) on CPU, for tests that check our output against it.

Megatron-LM's own argument parser (``parse_args`` + ``validate_args``) turns Megatron-LM flags into its ``args``;
``core_transformer_config_from_args`` and megatron-core's ``GPTModel`` with the local layer spec build the model
from them, as Megatron-LM's GPT builder does; ``load_args_from_checkpoint`` and ``load_checkpoint`` (strict) read a
checkpoint as ``pretrain_gpt.py --load DIR --use-checkpoint-args`` would.

CPU shims (test only, in the calling process): ``torch.cuda.current_device`` and megatron-core's CUDA RNG state
get/set functions; the causal mask is passed explicitly (its default one is allocated on CUDA); Megatron-LM's
tracker reader (it all-reduces the iteration in a CUDA tensor) is replaced by a plain read of the file.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import typing

import torch

from . import ROOT, TOOLS


class CpuTorch:
    """``torch`` for megatron-core modules (assign it to their ``torch``): ``device='cuda'`` tensors made on the
    CPU, and a ``cuda`` namespace with a CPU current device and fixed allocator statistics."""

    class cuda:  # noqa: N801 - stands for torch.cuda
        @staticmethod
        def current_device():
            return "cpu"

        @staticmethod
        def memory_stats(*a, **k):
            return {"reserved_bytes.all.current": 1, "allocated_bytes.all.current": 2,
                    "allocated_bytes.all.peak": 3, "allocation.all.current": 4}

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu(kw):
        if str(kw.get("device", "")).startswith("cuda"):
            kw["device"] = "cpu"
        return kw

    def tensor(self, *a, **kw):
        return torch.tensor(*a, **self._cpu(kw))

    def zeros(self, *a, **kw):
        return torch.zeros(*a, **self._cpu(kw))


def shim_cpu() -> None:
    if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
        typing.override = lambda f: f
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.current_stream = lambda *a, **k: None  # read, not used, by megatron DDP's grad sync (no overlap)
    for p in (ROOT, TOOLS):
        if p not in sys.path:
            sys.path.insert(0, p)


def clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's clip_grad_by_total_norm_fp32 without its CUDA type assertion: the same scaling."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(clip_coeff)


def shim_cpu_optimizer() -> None:
    """megatron-core's optimizer, gradient clipping and schedules on CPU: the scalars they make on 'cuda'
    (loss scale, norms, token count) made on the CPU, and clipping without its CUDA type assertion."""
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as moptim
    import megatron.core.utils as mutils
    from megatron.core.pipeline_parallel import schedules

    cpu_torch = CpuTorch()
    moptim.torch = mclip.torch = schedules.torch = mutils.torch = cpu_torch
    moptim.clip_grad_by_total_norm_fp32 = clip_by_total_norm


def megatron_args(argv: list[str], world: int, padded_vocab: tuple[int, int, int] | None = None,
                  before_validation=None):
    """Megatron-LM's args for ``pretrain_gpt.py argv`` through its own parser and validate_args.
    ``padded_vocab``: (vocabulary, make_vocab_size_divisible_by, TP) to set ``padded_vocab_size`` as its
    tokenizer builder would; ``before_validation(args) -> args``: what initialize_megatron does between the two
    (load_args_from_checkpoint with --use-checkpoint-args)."""
    import megatron.training.arguments as margs
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    margs.get_device_arch_version = lambda: 9  # validate_args asks the (absent) GPU
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    saved = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = margs.parse_args()
            args.world_size = world
            if before_validation is not None:
                args = before_validation(args)
            margs.validate_args(args, {})
    finally:
        sys.argv = saved
    if padded_vocab is not None:
        args.padded_vocab_size = calculate_padded_vocab_size(*padded_vocab, logging_enabled=False)
    return args


def megatron_model(args, pre_process: bool = True, post_process: bool = True):
    """megatron-core's GPTModel as Megatron-LM's GPT builder makes it (local spec; with --num-experts its
    decoder block spec, which places the MoE layers by --moe-layer-freq)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.training.argument_utils import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    tied = not args.untie_embeddings_and_output_weights
    return GPTModel(config, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process, parallel_output=True,
                    share_embeddings_and_output_weights=tied,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
                    rope_scaling_factor=args.rope_scaling_factor)


def megatron_logits(model, tokens: torch.Tensor, pos: torch.Tensor, labels=None) -> torch.Tensor:
    seq = tokens.shape[1]
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]  # True: masked out
    return model(tokens, pos, mask, labels=labels)


def read_tracker(path: str) -> tuple[int, bool]:
    text = open(path).read().strip()
    return (0, True) if text == "release" else (int(text), False)


def args_from_checkpoint(args):
    """Megatron-LM's load_args_from_checkpoint (--use-checkpoint-args), with its tracker read on CPU."""
    import megatron.training.checkpointing as mckpt
    from megatron.core.safe_globals import register_safe_globals

    mckpt.read_metadata = read_tracker  # its own all-reduces the iteration in a CUDA tensor
    register_safe_globals()  # as Megatron-LM's initialisation does: args is an argparse.Namespace
    with contextlib.redirect_stdout(io.StringIO()):
        return mckpt.load_args_from_checkpoint(args)[0]


def megatron_lm_load(argv: list[str], world: int):
    """A fresh megatron-core model loaded by Megatron-LM's own ``load_checkpoint`` (strict) after its
    ``load_args_from_checkpoint`` read the checkpoint's args, for ``pretrain_gpt.py argv`` (which holds
    ``--load DIR --use-checkpoint-args``). Returns (model, args, (iteration, consumed_train_samples))."""
    import megatron.training.checkpointing as mckpt
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training import global_vars

    torch.cuda.synchronize = lambda *a, **k: None
    model_parallel_cuda_manual_seed(99)  # another initialisation: everything must come from the file
    # as initialize_megatron: parse, load_args_from_checkpoint (--use-checkpoint-args), then validate_args
    args = megatron_args(argv, world, before_validation=args_from_checkpoint)
    with contextlib.redirect_stdout(io.StringIO()):
        global_vars._GLOBAL_ARGS = None
        global_vars.set_args(args)
        destroy_num_microbatches_calculator()
        init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1)
        fresh = megatron_model(args).eval()
        iteration, _ = mckpt.load_checkpoint([fresh], None, None, strict=True)
    return fresh, args, (iteration, args.consumed_train_samples)

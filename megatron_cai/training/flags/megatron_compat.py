"""Megatron-LM flags that are accepted without effect (no-ops) or refused with a reason.

Every flag of megatron-core 0.19.2's ``megatron/training/arguments.py`` that a dense GPT pretraining
script commonly sets is one of: implemented (in ``arguments.py``), listed in ``NO_OP_FLAGS`` (parsed,
named once at start-up as "accepted for Megatron-LM compatibility, no effect here"), or listed in
``REFUSED_FLAGS`` (parsed, then refused, naming the flag and the reason, unless its value is one that means
the same thing here; every refused flag of a command line is listed in one report, training/flags/report.py).
Types, choices and defaults follow megatron-core's.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .report import FlagProblems


@dataclass(frozen=True)
class CompatFlag:
    """One Megatron-LM flag: ``nargs=0`` is a switch, anything else takes a value."""

    flag: str
    reason: str
    nargs: int | str | None = 0
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple | None = None
    allowed: tuple = ()  # refused flags: values that mean what they mean here (accepted silently)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def given(self, args: argparse.Namespace) -> bool:
        value = vars(args)[self.dest]
        return value != (False if self.nargs == 0 else self.default)


def _switches(reason: str, *flags: str) -> list[CompatFlag]:
    return [CompatFlag(f, reason) for f in flags]


_FUSION = "a kernel-fusion / launch switch of Megatron's CUDA kernels; the same math runs here either way"
_TE_FP8 = ("a Transformer Engine delayed-scaling knob; --fp8-format runs our FP8 QAT (dynamic clamps), "
           "which has no amax history")
_DIST_CKPT = "a Megatron-LM dist_checkpointing knob; --ckpt-format torch_dist here is torch.distributed.checkpoint"
_FSDP = ("a Megatron-FSDP tuning knob (buffers, NCCL registration, meta-device init); --use-megatron-fsdp runs on "
         "PyTorch FSDP2 here, which manages its own buffers")

NO_OP_FLAGS: list[CompatFlag] = [
    CompatFlag("--use-mcore-models", "Megatron's default model class; it is the only model here"),
    *_switches(_FUSION, "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
               "--cross-entropy-loss-fusion", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
               "--no-persist-layer-norm", "--tp-comm-overlap", "--no-align-grad-reduce",
               "--defer-embedding-wgrad-compute", "--te-rng-tracker"),
    CompatFlag("--cross-entropy-fusion-impl", _FUSION, None, str, "native", ("native", "te")),
    CompatFlag("--use-flash-attn", "the attention kernel is chosen by --attention-backend"),
    CompatFlag("--no-create-attention-mask-in-dataloader",
               "no dense attention mask is ever built; causal / packed-document visibility is computed in-kernel"),
    CompatFlag("--no-mmap-bin-files", "the .bin files are always memory-mapped; results are the same"),
    CompatFlag("--use-cpu-initialization", "weights are initialised from the same seeded full tensors either way"),
    CompatFlag("--accumulate-allreduce-grads-in-fp32", "gradients always accumulate and reduce in fp32 "
               "(unless --grad-reduce-in-bf16)"),
    CompatFlag("--attention-softmax-in-fp32", "the softmax always runs in fp32"),
    CompatFlag("--apply-query-key-layer-scaling", "with an fp32 softmax the result is mathematically the same"),
    CompatFlag("--fp8-param-gather", "parameters are gathered in their training dtype"),
    CompatFlag("--fp8-amax-history-len", _TE_FP8, None, int, 1),
    CompatFlag("--fp8-amax-compute-algo", _TE_FP8, None, str, "most_recent", ("most_recent", "max")),
    CompatFlag("--fp8-margin", _TE_FP8, None, int, 0),
    CompatFlag("--fp8-interval", _TE_FP8, None, int, 1),
    CompatFlag("--use-pytorch-profiler", "--profile always uses torch.profiler here"),
    CompatFlag("--onnx-safe", "no ONNX export here", None, bool, None),
    CompatFlag("--local-rank", "ranks come from torchrun's / Slurm's environment variables", None, int, 0),
    CompatFlag("--ddp-average-in-collective", "gradients are averaged over data-parallel ranks either way"),
    CompatFlag("--use-dist-ckpt", "deprecated in Megatron-LM too; see --ckpt-format"),
    *_switches(_DIST_CKPT, "--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save",
               "--ckpt-fully-parallel-load", "--ckpt-assume-constant-structure"),
    CompatFlag("--dist-ckpt-strictness", _DIST_CKPT, None, str, "assume_ok_unexpected",
               ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                "return_unexpected", "return_all", "ignore_all")),
    CompatFlag("--timing-log-option", "no per-operation timers here", None, str, "minmax", ("max", "minmax", "all")),
    CompatFlag("--nccl-communicator-config-path", "NCCL communicator tuning is not applied", None, str, None),
    CompatFlag("--no-bias-swiglu-fusion", _FUSION),
    *_switches(_FSDP, "--init-model-with-meta-device", "--use-nccl-ub", "--fsdp-double-buffer",
               "--fsdp-manual-registration"),
    CompatFlag("--use-persistent-ckpt-worker", "--async-save writes from a background thread here; there is no "
               "worker process to keep"),
    CompatFlag("--trust-remote-code", "tokenizers load from their files (tokenizer.json, .model) here; no remote "
               "code is ever run"),
]

_NOT_YET = "not implemented here"

REFUSED_FLAGS: list[CompatFlag] = [
    CompatFlag("--use-checkpoint-args", "pass the model flags explicitly; they are checked against the checkpoint"),
    CompatFlag("--spec", "custom layer specs are not supported", "*", str, None),
    CompatFlag("--yaml-cfg", "YAML configuration is not supported; pass flags", None, str, None),
    CompatFlag("--data-args-path", "use --data-path or --train-data-path/--valid-data-path/--test-data-path",
               None, str, None),
    CompatFlag("--per-split-data-args-path", "use --train-data-path/--valid-data-path/--test-data-path",
               None, str, None),
    CompatFlag("--dataloader-type", "only Megatron's 'single' sampler is implemented", None, str, None,
               ("single", "cyclic", "external"), allowed=("single",)),
    CompatFlag("--num-distributed-optimizer-instances", "one distributed-optimizer instance only", None, int, 1,
               allowed=(1,)),
    CompatFlag("--main-grads-dtype", "main gradients are fp32 (or bf16 for the reduction with "
               "--grad-reduce-in-bf16)", None, str, "fp32", ("fp32", "bf16"), allowed=("fp32",)),
    CompatFlag("--main-params-dtype", "main parameters are fp32", None, str, "fp32", ("fp32", "fp16"),
               allowed=("fp32",)),
    CompatFlag("--exp-avg-dtype", "Adam moments are fp32", None, str, "fp32", ("fp32", "fp16", "bf16", "fp8"),
               allowed=("fp32",)),
    CompatFlag("--exp-avg-sq-dtype", "Adam moments are fp32", None, str, "fp32", ("fp32", "fp16", "bf16", "fp8"),
               allowed=("fp32",)),
    CompatFlag("--use-precision-aware-optimizer", "Adam moments and main parameters are fp32 here"),
    CompatFlag("--weight-decay-incr-style", "weight decay is constant here", None, str, "constant",
               ("constant", "linear", "cosine"), allowed=("constant",)),
    CompatFlag("--start-weight-decay", "weight decay is constant (--weight-decay)", None, float, None),
    CompatFlag("--end-weight-decay", "weight decay is constant (--weight-decay)", None, float, None),
    CompatFlag("--rotary-seq-len-interpolation-factor", "RoPE position interpolation is " + _NOT_YET,
               None, int, None, allowed=(1,)),
    CompatFlag("--distribute-saved-activations", "distributing recomputed-layer inputs over TP is " + _NOT_YET),
    CompatFlag("--recompute-modules", "selective recompute covers core attention only", "+", str, None,
               allowed=(["core_attn"],)),
    CompatFlag("--num-virtual-stages-per-pipeline-rank", "use --num-layers-per-virtual-pipeline-stage",
               None, int, None),
    CompatFlag("--microbatch-group-size-per-virtual-pipeline-stage", _NOT_YET, None, int, None),
    CompatFlag("--decoder-first-pipeline-num-layers", "uneven pipeline stages are " + _NOT_YET, None, int, None),
    CompatFlag("--decoder-last-pipeline-num-layers", "uneven pipeline stages are " + _NOT_YET, None, int, None),
    CompatFlag("--account-for-embedding-in-pipeline-split", "uneven pipeline stages are " + _NOT_YET),
    CompatFlag("--account-for-loss-in-pipeline-split", "uneven pipeline stages are " + _NOT_YET),
    CompatFlag("--pretrained-checkpoint", "use --load with --finetune", None, str, None),
    CompatFlag("--no-save-rng", "the RNG state is always saved (resume is bit-exact)"),
    CompatFlag("--data-parallel-random-init", "all data-parallel ranks start from the same weights here"),
    CompatFlag("--record-memory-history", _NOT_YET),
    CompatFlag("--deterministic-mode", "bit-exact determinism on GPU is not guaranteed here"),
    CompatFlag("--init-method-xavier-uniform", _NOT_YET),
    CompatFlag("--qk-l2-norm", _NOT_YET + "; --qk-layernorm is"),
    CompatFlag("--mtp-num-layers", "multi-token prediction is " + _NOT_YET, None, int, None),
    CompatFlag("--overlap-param-gather-with-optimizer-step", _NOT_YET + "; --overlap-param-gather is"),
    CompatFlag("--ckpt-convert-format", "use tools/convert_checkpoint.py", None, str, None, ("torch", "torch_dist")),
    CompatFlag("--fp8-recipe", "only the default recipe name is accepted; our FP8 path is QAT with dynamic clamps",
               None, str, "delayed", ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
               allowed=("delayed",)),
]


def add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the no-op and refused flags (one argument group each)."""
    for title, table in (("Megatron-LM flags accepted without effect", NO_OP_FLAGS),
                         ("Megatron-LM flags refused (the help says why)", REFUSED_FLAGS)):
        group = parser.add_argument_group(title)
        for f in table:
            if f.nargs == 0:
                group.add_argument(f.flag, action="store_true", help=f.reason)
            else:
                group.add_argument(f.flag, nargs=f.nargs, type=f.type, default=f.default, choices=f.choices,
                                   help=f.reason)


def check_compat(args: argparse.Namespace, problems: FlagProblems) -> list[str]:
    """Record every refused flag given in ``problems``; return the no-op flags given (in table order)."""
    for f in REFUSED_FLAGS:
        if f.given(args) and vars(args)[f.dest] not in f.allowed:
            value = "" if f.nargs == 0 else f" {vars(args)[f.dest]}"
            problems.add("refused", f"{f.flag}{value}: {f.reason}")
    return [f.flag for f in NO_OP_FLAGS if f.given(args)]


# Megatron-LM's --attention-backend names onto ours. auto, flash and fused: the device's fused flash-style
# kernel (Triton on CUDA, the blocked kernel on CPU; what backend=None picks); unfused and local: the eager
# reference. All compute exact softmax attention; only the kernel differs.
_ATTENTION_BACKENDS = {"auto": None, "flash": None, "fused": None, "unfused": "eager", "local": "eager"}


def attention_backend_for(name: str | None) -> str | None:
    """Our core-attention backend for an --attention-backend value (ours pass through)."""
    return _ATTENTION_BACKENDS.get(name, name) if name is not None else None


def no_op_message(flags: list[str]) -> str | None:
    """The one start-up line naming the no-op flags given (None when there are none)."""
    if not flags:
        return None
    return " > accepted for Megatron-LM compatibility, no effect here: " + ", ".join(flags)

"""megatron-core 0.19.2's own GPTModel on the model of a bench/gpu/train.py row: the performance anchor that
our Trainer step is timed beside (alternated, in the same process, on the same GPU).

What runs is what Megatron-LM builds for ``--transformer-impl local --bf16`` without Transformer Engine or
apex: ``GPTModel`` with the local layer spec (RMSNorm, SwiGLU, RoPE, no biases, untied output, unfused
attention), ``Float16Module``, its ``DistributedDataParallel`` (fp32 gradient buffer) and its distributed
optimizer (fp32 main parameters; torch's AdamW underneath, as megatron-core falls back to without TE and
apex), one forward, backward, gradient sync and update per iteration, and one host read (the loss).

The validation machine has no megatron-core: the wheel travels with the tree in ``bench/gpu/wheels/``
(git-ignored; bench/gpu/RUNBOOK.md says how) and is unpacked into a temporary folder on ``sys.path``.

CPU dry run: fp32, and megatron-core's plain optimizer instead of the distributed one (the distributed one
accepts only ``torch.cuda`` parameter types), with the CPU shims of ``tests/testlib/mcore_cpu.py``.
"""
from __future__ import annotations

import glob
import os
import sys
import tempfile
import typing
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from common import ROOT

VERSION = "0.19.2"
WHEELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wheels")


class McoreUnavailable(RuntimeError):
    """megatron-core 0.19.2 is neither installed nor carried as a wheel."""


def import_megatron_core() -> str:
    """Make ``megatron.core`` 0.19.2 importable; returns where it came from (installed, or the wheel)."""
    if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
        typing.override = lambda f: f
    try:
        import megatron.core

        source = os.path.dirname(megatron.core.__file__)
    except ImportError:
        wheels = sorted(glob.glob(os.path.join(WHEELS, f"megatron_core-{VERSION}-*.whl")))
        if not wheels:
            raise McoreUnavailable(f"megatron-core is not installed and no megatron_core-{VERSION} wheel is in "
                                   f"{WHEELS} (bench/gpu/RUNBOOK.md: carry it)") from None
        target = tempfile.mkdtemp(prefix="megatron_core_")
        with zipfile.ZipFile(wheels[-1]) as z:  # pure Python but one datasets helper, which is not imported
            z.extractall(target)
        sys.path.insert(0, target)
        import megatron.core

        source = wheels[-1]
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("megatron-core")
    except PackageNotFoundError:  # the unpacked wheel: its dist-info is on sys.path too
        found = None
    if found is not None and found != VERSION:
        raise McoreUnavailable(f"megatron-core {found} found at {source}; this row compares against {VERSION}")
    return source


@dataclass
class McoreRun:
    """One built megatron-core model and its optimizer: ``step()`` runs one training iteration."""

    step: Callable[[], float]
    n_params: int
    optimizer: str
    source: str


def _shim_cpu() -> None:
    """tests/testlib/mcore_cpu.py's CPU stand-ins for megatron-core's CUDA calls (dry run only)."""
    tests = os.path.join(ROOT, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from testlib import mcore_cpu

    mcore_cpu.shim_cpu()
    mcore_cpu.shim_cpu_optimizer()


_OWN_GROUP: list[bool] = [False]  # whether build() made the process group (teardown() then removes it)


def _init_distributed(device: torch.device) -> None:
    """A one-rank process group and megatron-core's parallel state (its DDP and optimizer need both)."""
    import megatron.core.parallel_state as mps

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             store=torch.distributed.HashStore(), rank=0, world_size=1)
        _OWN_GROUP[0] = True
    if not mps.model_parallel_is_initialized():
        mps.initialize_model_parallel()


def teardown() -> None:
    """Undo build()'s process state: megatron-core's parallel state and the process group it made, so
    the rows after it run our Trainer as before (one process, no process group)."""
    import megatron.core.parallel_state as mps

    mps.destroy_model_parallel()
    if _OWN_GROUP[0] and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        _OWN_GROUP[0] = False


def build(model_cfg, micro_batch: int, device: torch.device, bf16: bool, seed: int = 1234) -> McoreRun:
    """megatron-core's GPTModel for our GPTConfig ``model_cfg`` (RMSNorm / SwiGLU / RoPE / no biases /
    untied, as train.py's rows), its DDP and optimizer, and a fixed random batch of ``micro_batch``."""
    source = import_megatron_core()
    cpu = device.type != "cuda"
    if cpu:
        _shim_cpu()
    _init_distributed(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    if model_cfg.normalization != "RMSNorm" or model_cfg.activation != "swiglu" or model_cfg.add_bias_linear:
        raise ValueError("mcore_peer: the rows' model is RMSNorm / SwiGLU / no biases")
    model_parallel_cuda_manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads, num_query_groups=model_cfg.num_query_groups,
        ffn_hidden_size=model_cfg.ffn_hidden_size, kv_channels=model_cfg.kv_channels,
        normalization="RMSNorm", layernorm_epsilon=model_cfg.layernorm_epsilon, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=model_cfg.init_method_std, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=cpu, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, bias_activation_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=model_cfg.padded_vocab_size, max_sequence_length=model_cfg.seq_length,
                     parallel_output=True, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", rotary_base=int(model_cfg.rotary_base))
    n_params = sum(p.numel() for p in model.parameters())
    if bf16:
        model = Float16Module(config, model)
    distributed = not cpu
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-4, min_lr=1e-5, weight_decay=0.01, clip_grad=1.0, bf16=bf16, params_dtype=dtype,
        use_distributed_optimizer=distributed), [ddp])
    g = torch.Generator(device="cpu").manual_seed(0)
    seq = model_cfg.seq_length
    tokens = torch.randint(0, model_cfg.vocab_size, (micro_batch, seq + 1), generator=g).to(device)
    pos = torch.arange(seq, device=device).expand(micro_batch, -1)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]  # True: masked out

    def step() -> float:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(tokens[:, :-1], pos, mask, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = optimizer.step()
        if not ok:
            raise RuntimeError("megatron-core's optimizer skipped its step (non-finite gradients)")
        return loss.item()  # its one host read

    kind = ("distributed optimizer, " if distributed else "plain optimizer (CPU), ") + ("bf16" if bf16 else "fp32")
    return McoreRun(step=step, n_params=n_params, optimizer=kind, source=source)

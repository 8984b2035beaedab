"""Quantization-aware GEMMs: the GemmInputQuantizer that the parallel linears call.

A linear layer holds ``self.gemm_quantizer`` (None without QAT) and calls, just before its GEMM::

    y = self.gemm_quantizer.linear(x, w, bias, predicted_input_rms=predicted_input_rms)
    # or, keeping F.linear:  x, w = self.gemm_quantizer(x, w, predicted_input_rms=...)
    #                        y = self.gemm_quantizer.output(F.linear(x, w)) (+ bias)

``linear`` also routes to the real low-precision GEMMs (:mod:`.gemm_backends`) when configured and
applies the optional output-gradient quantization. The layer never needs to know the format.

Tensor parallelism: build the quantizer with the TP group and how the layer is split
(``weight_shard_dim=0`` for ColumnParallelLinear, ``1`` plus ``input_sharded=True`` for
RowParallelLinear; :func:`attach_gemm_quantizers` reads this from ``weight.tp_dim``). Then:

- "block" granularity is TP-invariant with no communication, provided each shard of K is a multiple of
  the block size (128);
- "row" is invariant for ColumnParallelLinear (its rows are whole on each rank, its input replicated);
  for RowParallelLinear the per-row statistics are all-reduced over TP (one small collective);
- "tensor" statistics are all-reduced over TP whenever the tensor is split (a scalar collective);
- "weight-rms" needs no reduction over the activation; the prediction is the caller's: a number or
  tensor, or a lazy prediction (:class:`.dynamic_clamp.NormOutputRMS`, :class:`.dynamic_clamp.FFNHiddenRMS`)
  that the quantizer calls with its granularity and TP group, so weight statistics of TP-sharded layers
  are all-reduced and every rank gets the prediction of the unsplit weights. Without a prediction the
  rule falls back to "rms" (``last_input_rule`` records which rule a forward used).

State: a "static" clamp keeps its value in the buffers ``input_static_c`` / ``weight_static_c`` (NaN
until calibrated from the first batch's absmax when no ``static_value`` is given), so checkpoints save
and restore it. Calibration takes the max over the TP shards and over ``calibration_group`` (the data-
parallel replicas, which see different batches), so every replica holds the same value. Quantizers must
be attached before a checkpoint is loaded.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import gemm_backends
from .dynamic_clamp import (
    _tp_active,
    compute_clamp,
    default_alpha,
    group_absmax,
    needs_group_reduction,
)
from .fake_quant import fake_quant, fake_quant_with_clamp
from .qat_config import FP8_FORMATS, GEMM_BACKENDS, QAT_FORMATS, QATConfig

__all__ = ["FP8_FORMATS", "GEMM_BACKENDS", "QAT_FORMATS", "GemmInputQuantizer", "QATConfig", "apply_qat",
           "attach_gemm_quantizers", "quantize_output_grad"]

# A weight-rms prediction: a number, a tensor broadcastable to the clamp statistic, or a lazy
# ``fn(granularity, block_size, tp_group) -> tensor`` (see dynamic_clamp.NormOutputRMS), or None.
Prediction = torch.Tensor | float | Callable[[str, int, object], torch.Tensor] | None


class _QuantizeOutputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, fmt: str) -> torch.Tensor:
        ctx.fmt = fmt
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return fake_quant(grad, ctx.fmt, clamp="absmax"), None


def quantize_output_grad(y: torch.Tensor, fmt: str = "fp8_e5m2") -> torch.Tensor:
    """Identity in forward; in backward the incoming gradient is fake-quantized (per-tensor absmax)."""
    return _QuantizeOutputGrad.apply(y, fmt)


class GemmInputQuantizer(nn.Module):
    """Fake-quantizes a linear layer's GEMM inputs (activation X and weight W) per a :class:`QATConfig`.

    ``tp_group``: the tensor-parallel group; ``weight_shard_dim``: the dim along which this rank holds a
    shard of the weight (0: column-parallel, 1: row-parallel, None: whole); ``input_sharded``: X is split
    along its last dim (row-parallel). These decide which statistics are all-reduced (module docstring).
    ``calibration_group``: the max of a calibrated static clamp is also taken over this group (DP).
    """

    def __init__(self, config: QATConfig | None, *, tp_group=None, weight_shard_dim: int | None = None,
                 input_sharded: bool = False, calibration_group=None) -> None:
        super().__init__()
        self.config = config = config or QATConfig()
        self.tp_group = tp_group
        self.calibration_group = calibration_group
        self.last_input_rule: str | None = None  # the activation clamp rule of the latest forward
        self._te_cache: dict = {}
        if weight_shard_dim not in (None, 0, 1, -1):
            raise ValueError(f"weight_shard_dim must be None, 0 or 1 for an (out, in) weight, "
                             f"got {weight_shard_dim}")
        self.weight_shard_dim = weight_shard_dim
        self.input_sharded = input_sharded
        self._input_group = tp_group if needs_group_reduction(
            config.granularity, sharded=input_sharded, sharded_along_last_dim=True) else None
        self._weight_group = tp_group if needs_group_reduction(
            config.weight_granularity, sharded=weight_shard_dim is not None,
            sharded_along_last_dim=weight_shard_dim in (1, -1)) else None
        # A static clamp is scalar and calibrated on the whole tensor: all-reduce its max whenever split.
        self._input_static_group = tp_group if input_sharded else None
        self._weight_static_group = tp_group if weight_shard_dim is not None else None
        self._calibrated = {"input": False, "weight": False}
        if config.enabled and config.clamp == "static":
            self.register_buffer("input_static_c", self._initial(config.static_value))
        if config.enabled and config.weight_clamp == "static":
            self.register_buffer("weight_static_c", self._initial(config.weight_static_value))
        self.register_load_state_dict_post_hook(self._after_load)
        self._warned_fallback = False

    @staticmethod
    def _initial(value: float | None) -> torch.Tensor:
        return torch.tensor(float("nan") if value is None else float(value), dtype=torch.float32)

    @staticmethod
    def _after_load(module: GemmInputQuantizer, incompatible_keys) -> None:
        module._calibrated = {"input": False, "weight": False}

    @torch.no_grad()
    def _static_c(self, which: str, x: torch.Tensor) -> torch.Tensor:
        buf = getattr(self, f"{which}_static_c")
        if not self._calibrated[which]:
            # A NaN buffer (never calibrated) takes this batch's absmax; the test runs on the device (no
            # host sync, no graph break), so the statistic is reduced on every rank whether or not it is used.
            group = self._input_static_group if which == "input" else self._weight_static_group
            amax = group_absmax(x, "tensor", group=group)
            if _tp_active(self.calibration_group):
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.calibration_group)
            buf.copy_(torch.where(torch.isnan(buf), amax.clamp_min(self.config.eps), buf))
            self._calibrated[which] = True
        return buf

    def input_clamp(self, x: torch.Tensor, predicted_input_rms: Prediction = None) -> tuple[torch.Tensor, str]:
        """(c, rule) for the activation X. "weight-rms" without a prediction falls back to "rms".

        A callable prediction is evaluated (``fn(granularity, block_size, tp_group)``) only under "weight-rms".
        """
        cfg = self.config
        rule = cfg.clamp
        if rule == "weight-rms" and callable(predicted_input_rms):
            predicted_input_rms = predicted_input_rms(cfg.granularity, cfg.block_size, self.tp_group)
        if rule == "weight-rms" and predicted_input_rms is None:
            rule = "rms"
        self.last_input_rule = rule
        static = self._static_c("input", x) if rule == "static" else None
        c = compute_clamp(x, rule, granularity=cfg.granularity, alpha=cfg.alpha, static_value=static,
                          predicted_rms=predicted_input_rms, fmt=cfg.operand_fmt, eps=cfg.eps,
                          block_size=cfg.block_size, group=self._input_group)
        return c, rule

    def weight_clamp(self, weight: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        static = self._static_c("weight", weight) if cfg.weight_clamp == "static" else None
        return compute_clamp(weight, cfg.weight_clamp, granularity=cfg.weight_granularity,
                             alpha=cfg.weight_alpha, static_value=static, fmt=cfg.operand_fmt, eps=cfg.eps,
                             block_size=cfg.block_size, group=self._weight_group)

    def _clip_possible(self, rule: str, alpha: float | None) -> bool:
        return not (rule == "absmax" and (alpha is None or alpha >= 1.0))

    def forward(self, x: torch.Tensor, weight: torch.Tensor, *,
                predicted_input_rms: Prediction = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fake-quantized ``(x_q, w_q)`` (STE backward); ``(x, weight)`` unchanged when QAT is off."""
        cfg = self.config
        if not cfg.enabled:
            return x, weight
        c_x, rule = self.input_clamp(x, predicted_input_rms)
        x_q = fake_quant_with_clamp(x, cfg.operand_fmt, c_x, granularity=cfg.granularity,
                                    block_size=cfg.block_size,
                                    clip_possible=self._clip_possible(rule, cfg.alpha))
        c_w = self.weight_clamp(weight)
        w_q = fake_quant_with_clamp(weight, cfg.operand_fmt, c_w, granularity=cfg.weight_granularity,
                                    block_size=cfg.block_size,
                                    clip_possible=self._clip_possible(cfg.weight_clamp, cfg.weight_alpha))
        return x_q, w_q

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """The GEMM output, with its gradient fake-quantized in backward when configured."""
        if self.config.output_grad_enabled:
            return quantize_output_grad(y, self.config.grad_fmt)
        return y

    def _use_real_gemm(self, x: torch.Tensor) -> bool:
        backend = self.config.gemm_backend
        if backend == "fake":
            return False
        ok = gemm_backends.real_gemm_available(self.config.operand_fmt, x.device,
                                               require_gpu=backend == "auto")
        if backend == "real" and not ok and not self._warned_fallback:
            warnings.warn(f"QAT gemm_backend 'real': no {self.config.operand_fmt} GEMM on {x.device}; "
                          "using fake quantization", stacklevel=3)
            self._warned_fallback = True
        return ok

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               predicted_input_rms: Prediction = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with quantized GEMM inputs (and output gradient when configured).

        The bias is added after the quantized GEMM in high precision.
        """
        cfg = self.config
        if not cfg.enabled:
            return F.linear(x, weight, bias)
        if cfg.gemm_backend == "transformer_engine":
            self.last_input_rule = "transformer_engine"
            y = gemm_backends.te_linear(x, weight, self._te_cache)
            return y if bias is None else y + bias
        if self._use_real_gemm(x):
            c_x, _ = self.input_clamp(x, predicted_input_rms)
            c_w = self.weight_clamp(weight)
            y = gemm_backends.quantized_linear(x, c_x, weight, c_w, cfg.operand_fmt,
                                               x_granularity=cfg.granularity,
                                               w_granularity=cfg.weight_granularity,
                                               block_size=cfg.block_size)
        else:
            x_q, w_q = self(x, weight, predicted_input_rms=predicted_input_rms)
            y = F.linear(x_q, w_q)
        y = self.output(y)
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        c = self.config
        if not c.enabled:
            return "fmt=none"
        alpha = default_alpha(c.operand_fmt, c.clamp) if c.alpha is None else c.alpha
        grad = c.grad_fmt if c.output_grad_enabled else "off"
        return (f"fmt={c.operand_fmt}, clamp={c.clamp}(alpha={alpha:g}), granularity={c.granularity}, "
                f"weight={c.weight_clamp}/{c.weight_granularity}, grad={grad}, backend={c.gemm_backend}, "
                f"weight_shard_dim={self.weight_shard_dim}, input_sharded={self.input_sharded}")


def attach_gemm_quantizers(model: nn.Module, config: QATConfig, *, tp_group=None, dp_group=None,
                           exclude: tuple[str, ...] = ()) -> int:
    """Set ``gemm_quantizer`` on every module that has that attribute and a ``weight``; return how many.

    The split is read from ``weight.tp_dim`` (0: column-parallel, 1: row-parallel, None: replicated).
    ``tp_group`` / ``dp_group`` default to parallel_state's TP / DP groups when larger than 1 (the DP
    group only makes calibrated static clamps agree over replicas). Modules whose qualified name contains
    any string in ``exclude`` are skipped. Does nothing when ``config.fmt == "none"``. Call before
    loading a checkpoint (static clamps live in the quantizers' buffers).
    """
    if not config.enabled:
        return 0
    from .. import parallel_state as ps

    if ps.model_parallel_is_initialized():
        if tp_group is None and ps.get_tensor_model_parallel_world_size() > 1:
            tp_group = ps.get_tensor_model_parallel_group()
        if dp_group is None and ps.get_data_parallel_world_size() > 1:
            dp_group = ps.get_data_parallel_group()
    n = 0
    for name, module in model.named_modules():
        if not hasattr(module, "gemm_quantizer") or getattr(module, "weight", None) is None:
            continue
        if any(e in name for e in exclude):
            continue
        tp_dim = getattr(module.weight, "tp_dim", None)
        module.gemm_quantizer = GemmInputQuantizer(config, tp_group=tp_group, weight_shard_dim=tp_dim,
                                                   input_sharded=tp_dim in (1, -1), calibration_group=dp_group)
        n += 1
    return n


def apply_qat(model: nn.Module, settings: dict | QATConfig, *, tp_group=None, dp_group=None,
              exclude: tuple[str, ...] = ("output_layer",)) -> int:
    """Attach quantizers from a settings dict (QATConfig field names, e.g. GPTConfig.qat) or a QATConfig.

    The LM head (``output_layer``) stays in high precision by default. Returns the number of layers.
    """
    config = settings if isinstance(settings, QATConfig) else QATConfig(**settings)
    return attach_gemm_quantizers(model, config, tp_group=tp_group, dp_group=dp_group, exclude=exclude)

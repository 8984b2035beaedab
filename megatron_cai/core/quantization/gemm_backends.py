"""Optional real low-precision GEMMs, tested against the fake-quant reference.

- int8: ``torch._int_mm`` (int8 x int8 -> int32), GPUs from SM80 (and torch's CPU kernel).
- FP8 E4M3: ``torch._scaled_mm`` with unit scales and fp32 output, GPUs from SM89 (and torch's CPU kernel).

Both multiply the *codes* of :func:`.fake_quant.quantize_codes` and apply the dequantization scales
afterwards in fp32, per output element: ``y[m, n] = sum_b s_x[m, b] * s_w[n, b] * (A_b @ B_b^T)[m, n]``
over K blocks ``b`` (one block unless a granularity is "block"). The result equals
``F.linear(x_q, w_q)`` of the fake-quant operands up to the accumulation order (exactly, for int8 with
K <= 1040 in fp32). The backward is the fake-quant one (high-precision GEMMs on the dequantized operands
with the straight-through masks), as in int8-forward / bf16-backward training.

Transformer Engine (``--transformer-impl transformer_engine``, CUDA only, ``--qat fp8``): the training
loop runs every forward under :func:`te_fp8_autocast` (TE's delayed-scaling recipe, E4M3 forward and, for
``--fp8-format hybrid``, E5M2 gradients), and each parallel linear's local GEMM is :func:`te_linear`: a
``te.Linear`` with no bias and no TP of its own (our layers do the TP communication) whose ``weight``
is this layer's parameter, so TE casts the weight and input to FP8 with its own amax-history scales
and autograd delivers the gradient to our parameter. TE's scaling state (amax history) is not part of
our checkpoints: it restarts on resume, so resumes under TE are not bit-exact. The clamp rules of this
package do not apply on that path.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
import torch.nn.functional as F

from .. import device as device_mod
from .dynamic_clamp import BLOCK_SIZE, to_groups
from .fake_quant import FP8_DTYPES, quantize_codes

_MIN_CAPABILITY = {"int8": (8, 0), "fp8_e4m3": (8, 9)}


@functools.cache
def _cpu_op_works(fmt: str) -> bool:
    try:
        a = torch.ones(32, 32)
        if fmt == "int8":
            torch._int_mm(a.to(torch.int8), a.to(torch.int8))
        else:
            one = torch.ones(())
            torch._scaled_mm(a.to(torch.float8_e4m3fn), a.to(torch.float8_e4m3fn).t(), one, one,
                             out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


def real_gemm_available(fmt: str, device: torch.device | str, *, require_gpu: bool = True) -> bool:
    """Whether a real ``fmt`` ("int8" | "fp8_e4m3") GEMM runs on ``device`` (CPU only if not require_gpu)."""
    device = torch.device(device)
    if fmt not in _MIN_CAPABILITY:
        return False
    if device.type == "cuda":
        return divmod(device_mod.device_capability(device), 10) >= _MIN_CAPABILITY[fmt]
    if device.type == "cpu" and not require_gpu:
        return _cpu_op_works(fmt)
    return False


def _pad(t: torch.Tensor, rows_to: int, cols_to: int) -> torch.Tensor:
    pr, pc = rows_to - t.shape[0], cols_to - t.shape[1]
    if pr == 0 and pc == 0:
        return t
    # F.pad does not support int8/fp8 everywhere: pad in a wider dtype, then narrow back (exact).
    return F.pad(t.float(), (0, pc, 0, pr)).to(t.dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def gemm_codes(a: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    """``a @ b.T`` in fp32 for code matrices a (M, K) and b (N, K) of dtype int8 or float8_e4m3fn.

    Zero-pads to the shape constraints of the kernels (M > 16 and K, N multiples of 8 for _int_mm;
    K, N multiples of 16 for _scaled_mm) and slices the result back. Runs as the custom op
    ``megatron_cai::gemm_codes``: the padding and the layout retry stay out of a ``torch.compile`` graph.
    """
    return _gemm_codes_op(a, b, fmt)


@torch.library.custom_op("megatron_cai::gemm_codes", mutates_args=())
def _gemm_codes_op(a: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    if fmt == "int8":
        mp, kp, np_ = max(_round_up(m, 8), 24), _round_up(k, 8), _round_up(n, 8)
        ap, bp = _pad(a, mp, kp), _pad(b, np_, kp)
        try:
            out = torch._int_mm(ap, bp.t())
        except RuntimeError:  # layouts the kernel rejects: give it a row-major (K, N)
            out = torch._int_mm(ap, bp.t().contiguous())
        return out[:m, :n].float()
    if fmt != "fp8_e4m3":
        raise ValueError(f"no real GEMM for format {fmt!r}; expected int8 or fp8_e4m3")
    mp, kp, np_ = _round_up(m, 16), _round_up(k, 16), _round_up(n, 16)
    ap, bp = _pad(a, mp, kp).contiguous(), _pad(b, np_, kp).contiguous()
    one = torch.ones((), device=a.device, dtype=torch.float32)
    out = torch._scaled_mm(ap, bp.t(), one, one, out_dtype=torch.float32, use_fast_accum=False)
    return out[:m, :n].contiguous()


@_gemm_codes_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)


def _normalize_clamp(c: torch.Tensor, lead_shape: tuple[int, ...], granularity: str, nb: int) -> torch.Tensor:
    """A clamp in any broadcastable statistic shape, as () / (R, 1) / (R, nb, 1) for a 2-D operand."""
    c = c.detach().float()
    if granularity == "tensor":
        return c.reshape(())
    if granularity == "row":
        return c.expand(*lead_shape, 1).reshape(-1, 1)
    return c.expand(*lead_shape, nb, 1).reshape(-1, nb, 1)


def _codes_and_scales(t2: torch.Tensor, cg: torch.Tensor, fmt: str, granularity: str, block_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a 2-D fp32 operand: (codes (R, K) fp32, per-(row, K-block) scales (R or 1, nb), STE mask)."""
    tg, restore = to_groups(t2, granularity, block_size)
    codes, s = quantize_codes(tg, cg, fmt)
    mask = tg.abs() <= cg
    scales = s.reshape(1, 1) if granularity == "tensor" else s.reshape(t2.shape[0], -1)
    return restore(codes), scales, restore(mask)


def _to_code_dtype(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    return codes.to(torch.int8) if fmt == "int8" else codes.to(FP8_DTYPES[fmt])


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, c_x, c_w, fmt, x_granularity, w_granularity, block_size):
        k = x.shape[-1]
        nb = -(-k // block_size)
        x2 = x.reshape(-1, k).float()
        cx = _normalize_clamp(c_x, tuple(x.shape[:-1]), x_granularity, nb)
        cw = _normalize_clamp(c_w, (weight.shape[0],), w_granularity, nb)
        codes_x, sx, mask_x = _codes_and_scales(x2, cx, fmt, x_granularity, block_size)
        codes_w, sw, mask_w = _codes_and_scales(weight.float(), cw, fmt, w_granularity, block_size)
        a, b = _to_code_dtype(codes_x, fmt), _to_code_dtype(codes_w, fmt)
        if x_granularity == "block" or w_granularity == "block":
            sx, sw = sx.expand(sx.shape[0], nb), sw.expand(sw.shape[0], nb)
            y = None
            for i in range(nb):
                sl = slice(i * block_size, min((i + 1) * block_size, k))
                part = gemm_codes(a[:, sl], b[:, sl], fmt) * sx[:, i:i + 1] * sw[:, i][None, :]
                y = part if y is None else y + part
        else:
            y = gemm_codes(a, b, fmt) * sx * sw.t()
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        # Dequantized operands and STE masks for the (fake-quant) backward.
        x_fq = (codes_x * _expand_scales(sx, x2.shape, block_size)).to(dtype)
        w_fq = (codes_w * _expand_scales(sw, weight.shape, block_size)).to(dtype)
        ctx.save_for_backward(x_fq, w_fq, mask_x, mask_w)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y.to(dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x_fq, w_fq, mask_x, mask_w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1]).to(x_fq.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = ((g2 @ w_fq) * mask_x).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = ((g2.t() @ x_fq) * mask_w).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None


def _expand_scales(s: torch.Tensor, shape: torch.Size | tuple[int, ...], block_size: int) -> torch.Tensor:
    """Per-(row, block) scales (R or 1, nb) expanded to one per element of a (rows, K) operand."""
    k = shape[-1]
    nb = s.shape[1]
    if nb == 1:
        return s
    return s.repeat_interleave(block_size, dim=1)[:, :k]


def quantized_linear(x: torch.Tensor, c_x: torch.Tensor, weight: torch.Tensor, c_w: torch.Tensor, fmt: str, *,
                     x_granularity: str = "tensor", w_granularity: str = "row",
                     block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """``F.linear(fake_quant(x), fake_quant(weight))`` computed with a real int8 / FP8 GEMM (no bias).

    ``c_x`` / ``c_w`` are the clamps (statistic shapes, :mod:`.dynamic_clamp`) of the two operands.
    """
    if fmt not in _MIN_CAPABILITY:
        raise ValueError(f"no real GEMM for format {fmt!r}; expected int8 or fp8_e4m3")
    return _QuantizedLinear.apply(x, weight, c_x, c_w, fmt, x_granularity, w_granularity, block_size)


# ---------------------------------------------------------------------------------------------------
# Transformer Engine (optional)
# ---------------------------------------------------------------------------------------------------

def transformer_engine_available() -> bool:
    """Whether transformer_engine.pytorch can be imported (never imports it on a machine without it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def te_fp8_recipe(fp8_format: str = "hybrid", *, amax_history_len: int = 16, reduce_amax: bool = True):
    """A TE delayed-scaling recipe for ``fp8_format`` "e4m3" or "hybrid" (E4M3 forward, E5M2 backward).

    ``reduce_amax=False``: each rank scales by its own amax (no collective at the end of the autocast).
    """
    if not transformer_engine_available():
        raise ImportError("--transformer-impl transformer_engine needs Transformer Engine "
                          "(pip install transformer_engine[pytorch]); it is not installed")
    from transformer_engine.common.recipe import DelayedScaling, Format

    fmt = {"e4m3": Format.E4M3, "hybrid": Format.HYBRID}.get(fp8_format)
    if fmt is None:
        raise ValueError(f"--fp8-format {fp8_format!r} is not one of e4m3, hybrid")
    return DelayedScaling(fp8_format=fmt, amax_history_len=amax_history_len, amax_compute_algo="max",
                          reduce_amax=reduce_amax)


def te_fp8_autocast(enabled: bool = True, fp8_format: str = "hybrid", *, recipe=None, fp8_group=None):
    """TE's FP8 autocast context for TE layers (a no-op context when ``enabled`` is False).

    ``fp8_group``: the group whose amax is shared (TP x DP in Megatron; the wrong group makes ranks
    disagree on scales).
    """
    if not enabled:
        return contextlib.nullcontext()
    recipe = recipe or te_fp8_recipe(fp8_format)
    import transformer_engine.pytorch as te

    if hasattr(te, "fp8_autocast"):
        return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=fp8_group)
    return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=fp8_group)


def te_linear(x: torch.Tensor, weight: torch.Tensor, cache: dict) -> torch.Tensor:
    """``F.linear(x, weight)`` computed by a Transformer Engine ``Linear`` (FP8 under :func:`te_fp8_autocast`).

    ``cache`` (one per layer) keeps the TE module between calls; it holds TE's FP8 scaling state and is
    not registered as a submodule, so it never enters state dicts. ``weight`` must be a CUDA parameter
    with both dimensions multiples of 16 (TE's FP8 GEMM constraint).
    """
    if not transformer_engine_available():
        raise ImportError("the transformer_engine GEMM backend needs Transformer Engine "
                          "(pip install transformer_engine[pytorch]); it is not installed")
    if weight.device.type != "cuda":
        raise RuntimeError(f"--transformer-impl transformer_engine runs on CUDA only; this weight is on "
                           f"{weight.device}")
    import transformer_engine.pytorch as te

    out_features, in_features = weight.shape
    key = (out_features, in_features, weight.dtype, weight.device)
    module = cache.get("module")
    if module is None or cache.get("key") != key:
        module = te.Linear(in_features, out_features, bias=False, params_dtype=weight.dtype, device=weight.device)
        cache["module"], cache["key"] = module, key
    if module.weight is not weight:
        del module.weight  # TE's own parameter; ours replaces it (gradients flow to ours)
        module.weight = weight
    lead = x.shape[:-1]
    return module(x.reshape(-1, in_features)).reshape(*lead, out_features)

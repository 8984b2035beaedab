"""Clamp ranges for fake quantization: per-group statistics, clamp rules and RMS predictions.

Granularity (the group one clamp value ``c`` covers):

- ``"tensor"``: the whole tensor; ``c`` has shape ``()``.
- ``"row"``: a slice along the last dimension, i.e. one ``c`` per ``x[i, j, ..., :]`` (per token for an
  activation, per output channel for an ``(out, in)`` weight); ``c`` has shape ``x.shape[:-1] + (1,)``.
- ``"block"``: ``block_size`` (128) consecutive elements of the last dimension; the last block of a
  row may be shorter. ``c`` has shape ``x.shape[:-1] + (n_blocks, 1)`` and applies to the blocked view
  ``(..., n_blocks, block_size)``.

Both row and block groups run along the last dimension, the GEMM contraction (K) dimension, so they
match row-wise and 1x128 block-wise scaled GEMMs.

Clamp rules (``c`` is always computed without gradient and floored at ``eps``):

- ``"absmax"``: ``c = alpha * max|x|`` over the group (alpha defaults to 1);
- ``"static"``: ``c = static_value`` (a fixed, typically calibrated-once value: the failure case once the
  tensor's scale drifts);
- ``"rms"``: ``c = alpha * RMS(x)`` over the group;
- ``"weight-rms"``: ``c = alpha * predicted_rms``, where ``predicted_rms`` is computed by the caller from
  the weights of the layer that produced ``x`` (see the ``*_rms`` prediction rules below), so there is no
  reduction over the activation at all.

Tensor parallelism: pass ``group`` when the tensor is split over the ranks of ``group`` along a dimension
that the statistic spans; the per-rank partial statistics (max, sum of squares and count) are then
all-reduced, so every rank gets the clamp of the unsplit tensor. Which groups need this is decided by
:func:`needs_group_reduction`.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

CLAMP_RULES = ("absmax", "static", "rms", "weight-rms")
GRANULARITIES = ("tensor", "row", "block")
BLOCK_SIZE = 128
# Far below any real activation, yet 1/c and c/fmt_max stay finite, normal fp32 numbers for every format.
DEFAULT_EPS = 1e-30
# alpha for the rms / weight-rms rules, chosen from the sweep in bench/qat_clamp.py: int8 error is
# lowest near 4 sigma for Gaussian inputs and near 14 RMS for ReLU^2 outputs; 12 serves both within
# ~3% relative RMSE. FP8 (e4m3) is flat for alpha >= 24, so a generous headroom costs nothing.
DEFAULT_ALPHA = {"int8": 12.0, "fp8": 32.0}
# Constant of the ReLU^2 prediction: for h ~ N(0, s^2), E[relu(h)^4] = 3 s^4 / 2.
RELU2_RMS_FACTOR = math.sqrt(1.5)


def format_family(fmt: str) -> str:
    """'int8' or 'fp8' for a fake-quant format name ('int8', 'fp8_e4m3', 'fp8_e5m2', 'fp8')."""
    if fmt == "int8":
        return "int8"
    if fmt.startswith("fp8"):
        return "fp8"
    raise ValueError(f"unknown quantization format {fmt!r}; expected int8, fp8_e4m3 or fp8_e5m2")


def default_alpha(fmt: str, rule: str) -> float:
    """Default clamp multiplier: 1 for absmax, DEFAULT_ALPHA[format family] for rms and weight-rms."""
    if rule == "absmax" or rule == "static":
        return 1.0
    return DEFAULT_ALPHA[format_family(fmt)]


def _check(rule: str | None, granularity: str, block_size: int) -> None:
    if rule is not None and rule not in CLAMP_RULES:
        raise ValueError(f"unknown clamp rule {rule!r}; expected one of {', '.join(CLAMP_RULES)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; expected one of {', '.join(GRANULARITIES)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def to_groups(x: torch.Tensor, granularity: str, block_size: int = BLOCK_SIZE
              ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """A view of ``x`` whose groups are reduced over the last dim (all dims for "tensor"), and its inverse.

    For "block" the last dimension is zero-padded to a multiple of ``block_size`` and split into
    ``(n_blocks, block_size)``; the inverse drops the padding. For "tensor" and "row" it is ``x`` itself.
    """
    _check(None, granularity, block_size)
    if granularity != "tensor" and x.dim() == 0:
        raise ValueError(f"{granularity} granularity needs a tensor with at least one dimension")
    if granularity != "block":
        return x, lambda y: y
    n = x.shape[-1]
    nb = -(-n // block_size)
    pad = nb * block_size - n
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xg = xp.reshape(*x.shape[:-1], nb, block_size)

    def restore(y: torch.Tensor) -> torch.Tensor:
        y = y.reshape(*x.shape[:-1], nb * block_size)
        return y[..., :n] if pad else y

    return xg, restore


def _reduce_dims(xg: torch.Tensor, granularity: str) -> tuple[int, ...]:
    return tuple(range(xg.dim())) if granularity == "tensor" else (-1,)


def _group_counts(x: torch.Tensor, granularity: str, block_size: int) -> torch.Tensor:
    """Number of real (unpadded) elements in each group, broadcastable to the statistic shape."""
    if granularity == "tensor":
        return torch.tensor(float(x.numel()), device=x.device)
    n = x.shape[-1] if x.dim() else 1
    if granularity == "row":
        return torch.tensor(float(n), device=x.device)
    nb = -(-n // block_size)
    counts = torch.full((nb, 1), float(block_size), device=x.device)
    counts[-1, 0] = float(n - (nb - 1) * block_size)
    return counts


def _tp_active(group) -> bool:
    return (group is not None and dist.is_available() and dist.is_initialized()
            and dist.get_world_size(group) > 1)


@torch.no_grad()
def group_absmax(x: torch.Tensor, granularity: str = "tensor", *, block_size: int = BLOCK_SIZE,
                 group=None) -> torch.Tensor:
    """max|x| per group (fp32, statistic shape; see module docstring); all-reduced over ``group``."""
    xg, _ = to_groups(x, granularity, block_size)
    amax = xg.detach().abs().float().amax(dim=_reduce_dims(xg, granularity), keepdim=granularity != "tensor")
    if _tp_active(group):
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


@torch.no_grad()
def group_rms(x: torch.Tensor, granularity: str = "tensor", *, block_size: int = BLOCK_SIZE,
              group=None) -> torch.Tensor:
    """sqrt(mean(x^2)) per group (fp32, statistic shape), over real elements only (block padding excluded).

    Under ``group`` the sums of squares and the element counts are all-reduced before dividing.
    """
    xg, _ = to_groups(x, granularity, block_size)
    sumsq = xg.detach().float().square().sum(dim=_reduce_dims(xg, granularity),
                                             keepdim=granularity != "tensor")
    counts = _group_counts(x, granularity, block_size)
    if _tp_active(group):
        both = torch.stack([sumsq, counts.expand_as(sumsq)])
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        sumsq, counts = both[0], both[1]
    return (sumsq / counts).sqrt()


def needs_group_reduction(granularity: str, *, sharded: bool, sharded_along_last_dim: bool) -> bool:
    """Whether the clamp statistic must be all-reduced over TP to equal the unsplit tensor's.

    - "tensor": whenever the tensor is split at all;
    - "row": only when it is split along the last dimension (RowParallelLinear's weight and input);
      rows split along another dimension (ColumnParallelLinear's weight) are whole on each rank;
    - "block": never, provided each shard of the last dimension is a multiple of ``block_size``
      (then the blocks of the shards are exactly the blocks of the full tensor).
    """
    if granularity == "tensor":
        return sharded
    if granularity == "row":
        return sharded and sharded_along_last_dim
    return False


@torch.no_grad()
def compute_clamp(x: torch.Tensor, rule: str, *, granularity: str = "tensor", alpha: float | None = None,
                  static_value: float | torch.Tensor | None = None,
                  predicted_rms: float | torch.Tensor | None = None, fmt: str = "int8",
                  eps: float = DEFAULT_EPS, block_size: int = BLOCK_SIZE, group=None) -> torch.Tensor:
    """The clamp range ``c`` (fp32, >= eps, no gradient) of ``x`` under ``rule`` at ``granularity``.

    ``alpha`` multiplies the statistic for absmax/rms/weight-rms (None: :func:`default_alpha` of ``fmt``).
    ``static_value`` is required for "static", ``predicted_rms`` for "weight-rms" (a scalar, or a tensor
    broadcastable to the statistic shape, e.g. ``(n_blocks, 1)`` for per-block predictions).
    """
    _check(rule, granularity, block_size)
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    a = default_alpha(fmt, rule) if alpha is None else float(alpha)
    if rule == "absmax":
        stat = group_absmax(x, granularity, block_size=block_size, group=group)
    elif rule == "rms":
        stat = group_rms(x, granularity, block_size=block_size, group=group)
    elif rule == "static":
        if static_value is None or (isinstance(static_value, float) and not math.isfinite(static_value)):
            raise ValueError(f"clamp rule 'static' needs a finite static_value (the fixed clamp range), "
                             f"got {static_value}")
        stat, a = torch.as_tensor(static_value, dtype=torch.float32, device=x.device).detach(), 1.0
    else:
        if predicted_rms is None:
            raise ValueError("clamp rule 'weight-rms' needs predicted_rms (the RMS of x predicted from the "
                             "weights that produced it; see dynamic_clamp.*_rms)")
        stat = torch.as_tensor(predicted_rms, device=x.device).detach().float()
    return (stat * a).clamp_min(eps)


# ----------------------------------------------------------------------------------------------------
# RMS prediction rules ("weight-rms"): predict an activation's RMS from weights, with no activation pass.
#
# Linear layer, h = W x (+ b), W of shape (out, d) with entries of RMS r_w, x of RMS r_x:
#   h_i = sum_j W_ij x_j.  Over output units i (rows of W drawn independently of x, zero mean),
#   E[h_i^2 | x] = sum_j E[W_ij^2] x_j^2 = r_w^2 * d * r_x^2, hence RMS(h) ~= r_w * sqrt(d) * r_x,
#   and a bias adds in quadrature: RMS(h)^2 ~= r_w^2 d r_x^2 + RMS(b)^2. Accurate while W is not
#   aligned with x (random init, and in practice for most trained layers); it is the same
#   fan-in-variance argument as Xavier/Kaiming initialisation.
# ReLU: for h ~ N(0, s^2), E[relu(h)^2] = s^2 / 2, so RMS(relu(h)) = s / sqrt(2).
# ReLU^2: E[relu(h)^4] = (1/2) E[h^4] = 3 s^4 / 2, so RMS(relu(h)^2) = s^2 sqrt(3/2). h is close to
#   Gaussian by the central limit theorem when d is large.
# RMSNorm output y = g * x / RMS(x): each row of x / RMS(x) has mean square exactly 1, so over the
#   coordinates of a row E[y_i^2] = E[g_i^2] and RMS(y) ~= RMS(g) (exact when g is constant);
#   LayerNorm with bias b: RMS(y)^2 ~= mean(g^2) + mean(b^2).
# ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def weight_rms(weight: torch.Tensor, *, group=None) -> torch.Tensor:
    """RMS of a (possibly TP-sharded) weight; with ``group``, of the full weight (sums all-reduced)."""
    return group_rms(weight, "tensor", group=group)


def linear_output_rms(weight_rms: float | torch.Tensor, fan_in: int, input_rms: float | torch.Tensor,
                      bias_rms: float | torch.Tensor = 0.0) -> torch.Tensor:
    """Predicted RMS of ``W x + b``: sqrt(r_w^2 * fan_in * r_x^2 + r_b^2)."""
    r_w, r_x, r_b = (torch.as_tensor(v, dtype=torch.float32) for v in (weight_rms, input_rms, bias_rms))
    return (r_w.square() * fan_in * r_x.square() + r_b.square()).sqrt()


def relu_rms(pre_rms: float | torch.Tensor) -> torch.Tensor:
    """Predicted RMS of relu(h) for h ~ N(0, pre_rms^2): pre_rms / sqrt(2)."""
    return torch.as_tensor(pre_rms, dtype=torch.float32) / math.sqrt(2.0)


def relu2_rms(pre_rms: float | torch.Tensor) -> torch.Tensor:
    """Predicted RMS of relu(h)^2 for h ~ N(0, pre_rms^2): sqrt(3/2) * pre_rms^2."""
    return torch.as_tensor(pre_rms, dtype=torch.float32).square() * RELU2_RMS_FACTOR


@torch.no_grad()
def post_norm_rms(norm_weight: torch.Tensor, norm_bias: torch.Tensor | None = None, *,
                  granularity: str = "tensor", block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Predicted RMS of an RMSNorm/LayerNorm output from its affine parameters, at ``granularity``.

    "tensor" and "row" give a scalar (every row has the same prediction); "block" gives the RMS of the
    norm weight over each block of the hidden dimension, shape ``(n_blocks, 1)``.
    """
    g2 = norm_weight.detach().float().square()
    if norm_bias is not None:
        g2 = g2 + norm_bias.detach().float().square()
    if granularity == "block":
        return group_rms(g2.sqrt(), "block", block_size=block_size)
    _check(None, granularity, block_size)
    return g2.mean().sqrt()


@torch.no_grad()
def predict_relu2_ffn_rms(fc1_weight: torch.Tensor, input_rms: float | torch.Tensor,
                          fc1_bias: torch.Tensor | None = None, *, group=None) -> torch.Tensor:
    """Predicted RMS of the fc2 input relu(fc1(x))^2, from fc1's weight (out, d) and RMS(x).

    Pass the TP group to use the RMS of the full (unsharded) fc1 weight on every rank.
    """
    r_w = weight_rms(fc1_weight, group=group)
    r_b = 0.0 if fc1_bias is None else weight_rms(fc1_bias, group=group)
    return relu2_rms(linear_output_rms(r_w, fc1_weight.shape[-1], input_rms, r_b))


# E[f(z)] for z ~ N(0, 1) by the trapezoid rule on a fine grid over [-12, 12]: spectrally accurate for
# smooth activations and, with a step of 0.005, still ~1e-6 for the kink of silu/gelu at large pre-RMS
# (where the kink is narrow in units of z); the Gaussian tails beyond 12 are below 1e-30.
_GRID_POINTS, _GRID_HALF_WIDTH = 4801, 12.0


@functools.cache
def _gaussian_grid() -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.linspace(-_GRID_HALF_WIDTH, _GRID_HALF_WIDTH, _GRID_POINTS, dtype=torch.float64)
    dz = 2 * _GRID_HALF_WIDTH / (_GRID_POINTS - 1)
    return z, torch.exp(-0.5 * z.square()) / math.sqrt(2.0 * math.pi) * dz


def gaussian_activation_rms(fn: Callable[[torch.Tensor], torch.Tensor],
                            pre_rms: float | torch.Tensor) -> torch.Tensor:
    """RMS of ``fn(h)`` for h ~ N(0, pre_rms^2), by numerical integration (fp32 scalar)."""
    s = torch.as_tensor(pre_rms).detach().double()
    z, w = (t.to(s.device) for t in _gaussian_grid())
    return (fn(z * s).square() @ w).sqrt().float()


FFN_ACTIVATIONS = ("relu2", "swiglu", "gelu_erf", "gelu_tanh")


@torch.no_grad()
def predict_ffn_rms(fc1_weight: torch.Tensor, input_rms: float | torch.Tensor, fc1_bias: torch.Tensor | None = None,
                    *, activation: str = "relu2", group=None) -> torch.Tensor:
    """Predicted RMS of the fc2 input act(fc1(x)), from fc1's weight (out, d), its bias and RMS(x).

    - relu2: ``relu2_rms`` of the fc1 output prediction (closed form);
    - gelu_erf / gelu_tanh: E[gelu(h)^2] for h ~ N(0, s^2) by numerical integration;
    - swiglu: fc1 holds [gate; up] (each rank: its shard of each); with independent Gaussian gate and up
      pre-activations, RMS(silu(g) * u) = RMS(silu(g)) * RMS(u), each from its own section's weights.

    ``group``: the TP group over which fc1's rows are split (the full weight's RMS on every rank).
    """
    if activation not in FFN_ACTIVATIONS:
        raise ValueError(f"unknown FFN activation {activation!r}; expected one of {', '.join(FFN_ACTIVATIONS)}")
    d = fc1_weight.shape[-1]

    def pre(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        r_b = 0.0 if b is None else weight_rms(b, group=group)
        return linear_output_rms(weight_rms(w, group=group), d, input_rms, r_b)

    if activation == "relu2":
        return relu2_rms(pre(fc1_weight, fc1_bias))
    if activation in ("gelu_erf", "gelu_tanh"):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        return gaussian_activation_rms(lambda h: torch.nn.functional.gelu(h, approximate=approximate),
                                       pre(fc1_weight, fc1_bias))
    w_gate, w_up = fc1_weight.chunk(2, dim=0)
    b_gate, b_up = fc1_bias.chunk(2, dim=0) if fc1_bias is not None else (None, None)
    return gaussian_activation_rms(torch.nn.functional.silu, pre(w_gate, b_gate)) * pre(w_up, b_up)


# ----------------------------------------------------------------------------------------------------
# Lazy predictions for the model. A transformer layer hands these to its linears as
# ``predicted_input_rms``; a quantizer with the "weight-rms" rule calls ``prediction(granularity,
# block_size, tp_group)`` and every other configuration ignores them, so the model pays nothing (no
# weight reductions, no TP collective) unless weight-rms QAT is on.
# ----------------------------------------------------------------------------------------------------

RMSPrediction = Callable[[str, int, object], torch.Tensor]


class NormOutputRMS:
    """weight-rms prediction of a LayerNorm / RMSNorm output: :func:`post_norm_rms` of its parameters.

    The norm's parameters are replicated over TP, so the prediction is TP-invariant without communication.
    """

    def __init__(self, norm: torch.nn.Module) -> None:
        self.norm = norm

    def __call__(self, granularity: str = "tensor", block_size: int = BLOCK_SIZE, group=None) -> torch.Tensor:
        return post_norm_rms(self.norm.weight, getattr(self.norm, "bias", None), granularity=granularity,
                             block_size=block_size)


class FFNHiddenRMS:
    """weight-rms prediction of the fc2 input of an MLP, from fc1's parameters (:func:`predict_ffn_rms`).

    ``input_rms``: the prediction for fc1's input (a :class:`NormOutputRMS` or a number); its per-tensor
    value is used whatever the granularity. The prediction is one scalar for every group.
    """

    def __init__(self, fc1: torch.nn.Module, activation: str, input_rms: RMSPrediction | float | torch.Tensor
                 ) -> None:
        self.fc1, self.activation, self.input_rms = fc1, activation, input_rms

    def __call__(self, granularity: str = "tensor", block_size: int = BLOCK_SIZE, group=None) -> torch.Tensor:
        r_x = self.input_rms("tensor", block_size, group) if callable(self.input_rms) else self.input_rms
        return predict_ffn_rms(self.fc1.weight, r_x, getattr(self.fc1, "bias", None),
                               activation=self.activation, group=group)

"""Attention Z-Reg: a *virtual* term ``w * mean(lse_i^2)`` whose gradient is injected in backward.

For a softmax row i with visible keys V(i), ``lse_i = log sum_{j in V(i)} exp(s_ij)``. The virtual term

    Omega = w * (1 / N) * sum_i lse_i^2,

with the mean over the N (batch, head, query) rows that see at least one key (fully masked rows,
``lse = -inf``, are excluded), has ``dOmega/dlse_i = 2 w lse_i / N`` and hence
``dOmega/ds_ij = (2 w / N) lse_i P_ij``. Nothing is added to the forward output or to the loss.

In a flash-style backward the term is one shift per row: with ``D_i = rowsum(dO_i * O_i)`` the
plain ``dS = P * (dP - D)`` becomes ``dS = P * (dP - (D_i - dlse_i))`` where ``dlse_i`` is the
gradient arriving at lse (from the caller, if lse is used) plus ``2 w lse_i / N``.
"""
from __future__ import annotations

import torch

__all__ = ["zreg_lse_grad", "inject_zreg", "lse_stats"]


def zreg_lse_grad(
    lse: torch.Tensor, coeff: float, grad_lse: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Total gradient at lse (fp32 or wider): ``grad_lse + 2 coeff lse / N`` on finite rows, 0 on masked ones.

    N (rows with a finite lse) is computed on the device, without a host sync. Returns ``grad_lse``
    unchanged (possibly None) when ``coeff == 0``, so that ``w = 0`` is bit-identical to no Z-Reg.
    """
    if coeff == 0.0:
        return grad_lse
    finite = torch.isfinite(lse)
    ct = torch.promote_types(lse.dtype, torch.float32)
    n_rows = finite.sum().clamp_min(1).to(ct)
    lse_c = lse.to(ct)
    extra = torch.where(finite, lse_c, torch.zeros_like(lse_c)) * (2.0 * coeff) / n_rows
    if grad_lse is None:
        return extra
    return torch.where(finite, grad_lse.to(ct), torch.zeros_like(lse_c)) + extra


class _InjectZReg(torch.autograd.Function):
    """Identity on (out, lse); backward adds the Z-Reg gradient to lse's incoming gradient."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, lse: torch.Tensor, coeff: float):
        ctx.save_for_backward(lse)
        ctx.coeff = coeff
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
        (lse,) = ctx.saved_tensors
        total = zreg_lse_grad(lse, ctx.coeff, grad_lse)
        return grad_out, total.to(lse.dtype), None


def inject_zreg(out: torch.Tensor, lse: torch.Tensor, coeff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Route ``(out, lse)`` through an identity whose backward adds ``2 w lse / N`` to lse's gradient.

    ``lse`` must be differentiable (connected to the scores) for the injected gradient to reach q/k.
    With ``coeff == 0`` (or no grad needed) the inputs are returned untouched.
    """
    if coeff == 0.0 or not torch.is_grad_enabled() or not (out.requires_grad or lse.requires_grad):
        return out, lse
    return _InjectZReg.apply(out, lse, float(coeff))


@torch.no_grad()
def lse_stats(lse: torch.Tensor) -> dict[str, float]:
    """``attention lse mean / max`` over rows with a finite lse (for TensorBoard logging)."""
    finite = lse[torch.isfinite(lse)].float()
    if finite.numel() == 0:
        return {"lse mean": 0.0, "lse max": 0.0}
    return {"lse mean": float(finite.mean()), "lse max": float(finite.max())}

"""Interval-attention kernels as ``torch.library`` custom ops, so ``torch.compile`` sees one opaque node.

The blocked (CPU) and Triton backends plan their tiles on the host or launch hand-written kernels; traced
by Dynamo, either would break the graph of the transformer layer that calls it (``--compile``). Each is
registered as a pair of custom ops, ``megatron_cai::<name>_fwd`` and ``megatron_cai::<name>_bwd``, with a
fake (meta) implementation and the autograd formula that joins them; eager calls take the same path.

Contract of a backend's two functions::

    forward(q, k, v, start, limit, position_ids, window, tile_q, tile_k) -> (out_c, lse_c)
    backward(grad_out, grad_lse, q, k, v, out_c, lse_c, start, limit, position_ids, window, coeff,
             tile_q, tile_k) -> (dq, dk, dv)

``out_c``/``lse_c`` are in the backend's compute precision (what its backward needs); the caller gets
``out_c`` cast to q's dtype and ``lse_c`` as fp32. Every output of both ops is contiguous, whatever the
strides of the inputs (a backend may compute on contiguous copies): the fake implementations say so,
and Inductor checks the real strides against them. ``coeff`` is the Attention Z-Reg weight, used only in
backward; ``tile_q``/``tile_k`` are the backend's tile sizes (0: its default).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["IntervalAttentionOp"]


class IntervalAttentionOp:
    """A backend's forward/backward pair registered as ``megatron_cai::{name}_fwd`` / ``_bwd``.

    ``out_dtype(q_dtype)`` and ``lse_dtype(q_dtype)`` give the compute dtypes of ``out_c``/``lse_c`` (for
    the fake implementation). Call the instance like the backends' public functions."""

    def __init__(self, name: str, forward: Callable, backward: Callable,
                 out_dtype: Callable[[torch.dtype], torch.dtype],
                 lse_dtype: Callable[[torch.dtype], torch.dtype]) -> None:
        fwd_op = torch.library.custom_op(f"megatron_cai::{name}_fwd", mutates_args=())(_fwd_signature(forward))
        bwd_op = torch.library.custom_op(f"megatron_cai::{name}_bwd", mutates_args=())(_bwd_signature(backward))

        @fwd_op.register_fake
        def _(q, k, v, start, limit, position_ids, window, coeff, tile_q, tile_k):
            out = q.new_empty(q.shape, dtype=out_dtype(q.dtype))
            return out, q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))

        @bwd_op.register_fake
        def _(grad_out, grad_lse, q, k, v, out_c, lse_c, start, limit, position_ids, window, coeff, tile_q,
              tile_k):
            return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous

        def setup_context(ctx, inputs, output) -> None:
            q, k, v, start, limit, position_ids, window, coeff, tile_q, tile_k = inputs
            ctx.save_for_backward(q, k, v, *output, start, limit, position_ids)
            ctx.window, ctx.coeff, ctx.tiles = window, coeff, (tile_q, tile_k)

        def backward(ctx, grad_out, grad_lse):
            q, k, v, out_c, lse_c, start, limit, position_ids = ctx.saved_tensors
            dq, dk, dv = bwd_op(grad_out, grad_lse, q, k, v, out_c, lse_c, start, limit, position_ids, ctx.window,
                                ctx.coeff, *ctx.tiles)
            return dq, dk, dv, None, None, None, None, None, None, None

        fwd_op.register_autograd(backward, setup_context=setup_context)
        self.forward_op, self.backward_op = fwd_op, bwd_op

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, start: Tensor, limit: Tensor,
                 position_ids: Tensor | None, window: int | None, coeff: float, tile_q: int = 0,
                 tile_k: int = 0) -> tuple[Tensor, Tensor]:
        """``(out in q.dtype, lse fp32)``; both differentiable (lse's gradient adds to Z-Reg's)."""
        out_c, lse_c = self.forward_op(q, k, v, start, limit, position_ids, window, float(coeff), int(tile_q),
                                       int(tile_k))
        return out_c.to(q.dtype), lse_c.to(torch.float32)


def _fwd_signature(forward: Callable) -> Callable:
    """``forward`` behind the typed signature that torch.library infers the op's schema from."""

    def fwd(q: Tensor, k: Tensor, v: Tensor, start: Tensor, limit: Tensor, position_ids: Tensor | None,
            window: int | None, coeff: float, tile_q: int, tile_k: int) -> tuple[Tensor, Tensor]:
        out_c, lse_c = forward(q, k, v, start, limit, position_ids, window, tile_q, tile_k)
        return out_c.contiguous(), lse_c.contiguous()

    return fwd


def _bwd_signature(backward: Callable) -> Callable:
    def bwd(grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, out_c: Tensor, lse_c: Tensor,
            start: Tensor, limit: Tensor, position_ids: Tensor | None, window: int | None, coeff: float,
            tile_q: int, tile_k: int) -> tuple[Tensor, Tensor, Tensor]:
        grads = backward(grad_out, grad_lse, q, k, v, out_c, lse_c, start, limit, position_ids, window, coeff,
                         tile_q, tile_k)
        return tuple(g.contiguous() for g in grads)

    return bwd

"""Cross entropy over vocabulary-parallel logits, with an optional injected output z-loss gradient.

Logits of padded vocabulary rows (ids >= ``vocab_size``) are excluded from the softmax, so padding
never changes the model's distribution and checkpoints can be re-padded for another TP size exactly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import parallel_state as ps


def _all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(x, op=op, group=ps.get_tensor_model_parallel_group())
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, vocab_size: int, zreg_coeff: float):
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        n_local = logits.shape[-1]
        if vocab_start + n_local > vocab_size:  # this shard holds padded rows
            pad = torch.arange(vocab_start, vocab_start + n_local, device=logits.device) >= vocab_size
            logits = logits.masked_fill(pad, float("-inf"))
        logits_max = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)
        exp = (logits - logits_max.unsqueeze(-1)).exp_()
        sum_exp = _all_reduce(exp.sum(dim=-1))
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= n_local)
        idx = local_target.masked_fill(outside, 0).unsqueeze(-1)
        target_logit = logits.gather(-1, idx).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = _all_reduce(target_logit)
        lse = sum_exp.log() + logits_max
        loss = lse - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, idx, outside, lse)
        ctx.zreg_coeff = zreg_coeff
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, outside, lse = ctx.saved_tensors
        grad = softmax
        if ctx.zreg_coeff:
            # d(w * lse^2)/dlogits = 2 w lse softmax, scaled like the token's loss (injected, not a loss term).
            grad = grad * (1.0 + 2.0 * ctx.zreg_coeff * lse).unsqueeze(-1)
        onehot_update = (~outside).to(grad.dtype).unsqueeze(-1)
        grad = grad.scatter_add(-1, idx, -onehot_update)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int | None = None,
                                 output_zreg_coeff: float = 0.0) -> torch.Tensor:
    """Per-token loss ``lse(logits) - logits[target]`` for logits split over TP along the last dim.

    ``vocab_size`` is the real vocabulary (rows beyond it are padding); ``output_zreg_coeff`` w adds the
    gradient of ``w * lse^2`` per token in backward (PaLM's z-loss, injected) without changing the loss.
    """
    n_local = logits.shape[-1]
    vocab_start = ps.get_tensor_model_parallel_rank() * n_local
    total = n_local * ps.get_tensor_model_parallel_world_size()
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, vocab_size or total,
                                            float(output_zreg_coeff))

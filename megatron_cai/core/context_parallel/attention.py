"""Context-parallel attention: local queries against the key sets a plan names, merged by log-sum-exp.

Forward (one autograd Function per layer call, so every CP rank runs the same collective sequence):

1. the local key set (this rank's own keys) through the per-chunk kernel -> ``(O, LSE)``;
2. for each exchange step of the plan (a ring schedule of direct transfers, :mod:`.plan`): the K/V of
   the keys a peer needs go to it and the keys this rank needs arrive (the next step's transfer is
   posted before the current key set is computed), the kernel runs on the received key set, and the
   partial ``(o, lse)`` merges: ``LSE' = logaddexp(LSE, lse)``, ``O' = O e^(LSE - LSE') + o e^(lse - LSE')``.

Backward, with the merged ``O`` and ``LSE`` saved (received K/V are not: they are fetched again, as in
Megatron-LM's ring attention, so activation memory stays that of the local tokens):
``D_i = rowsum(dO_i * O_i) - dlse_i`` once, then every key set's kernel backward with the merged ``LSE``
and ``D`` gives its exact share of dQ, dK, dV; the dK/dV of received keys go back to their owners along
the same step (and are added to the owner's own dK/dV).

Attention Z-Reg: ``dlse_i`` includes ``2 w CP lse_i / N`` with N the rows with a finite lse summed over
the CP group: each rank injects its rows' share of ``w * mean(lse^2)`` over the whole sequence, scaled by
CP because the DP x CP gradient mean divides by it. The sliding window and GQA/MQA are the kernels'.

Attention dropout (``dropout``, a :class:`PositionalDropout`): every key set runs the eager kernel with the
keep scale of its (global query position, global key position) pairs, recomputed from the seed in backward;
the dropped probabilities are exactly those a single process with the same seed drops.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..transformer.attention_dropout import PositionalDropout
from .exchange import CommStats, Peers, start_transfer
from .kernels import chunk_attention
from .plan import KeySetPlan, RankPlan

__all__ = ["context_parallel_attention", "lse_merge", "received_key_set"]

_TAG_FORWARD, _TAG_REFETCH, _TAG_GRAD = 0, 1 << 12, 2 << 12


def _pack(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``x [B, H, L, D]`` at (row, col) pairs -> ``[n, H, D]``."""
    return x.permute(0, 2, 1, 3)[rows, cols]


def received_key_set(recv: torch.Tensor, step: KeySetPlan, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Received ``[2, n, H, D]`` K/V into ``[B, H, slots + n_local, D]`` key tensors (placeholders zero)."""
    _, _, heads, dim = recv.shape
    bsz = step.start.shape[0]
    kv = recv.new_zeros(2, bsz, step.num_slots + n_local, heads, dim)
    kv[:, step.recv_rows, step.recv_slots] = recv
    kv = kv.permute(0, 1, 3, 2, 4)
    return kv[0], kv[1]


def lse_merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, part_lse: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a key set's ``(o, part_lse)`` into the running ``(out, lse)`` (rows with no visible key yet stay
    at 0 and -inf, without NaN)."""
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    a = torch.exp(lse - safe).unsqueeze(-1)
    b = torch.exp(part_lse - safe).unsqueeze(-1)
    return out * a + o.to(out.dtype) * b, new


def _keep_scale(dropout: PositionalDropout | None, q: torch.Tensor, plan: RankPlan, step: KeySetPlan | None):
    """The dropout keep scale of the local queries against one key set (the local one when ``step`` is None)."""
    if dropout is None:
        return None
    keys = plan.local_index.expand(q.shape[0], -1) if step is None else step.key_index
    return dropout.scale(q.shape[1], plan.local_index, keys)


def _fetch(peers: Peers, step: KeySetPlan, k, v, tag: int):
    """Post this step's K/V transfer: send the keys ``step.send_to`` needs, receive ours from ``recv_from``."""
    send = None
    if step.num_sent:
        send = torch.stack([_pack(k, step.send_rows, step.send_cols), _pack(v, step.send_rows, step.send_cols)])
    shape = (2, step.num_received, k.shape[1], k.shape[3]) if step.num_received else None
    transfer = start_transfer(peers, send, step.send_to, shape, step.recv_from, dtype=k.dtype, device=k.device,
                              tag=tag)
    return transfer, 0 if send is None else send.numel() * send.element_size()


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RankPlan, peers: Peers, stats: CommStats, backend: str, window, coeff: float,
                block, dropout: PositionalDropout | None):
        ctx.set_materialize_grads(False)
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        n_local = q.shape[2]
        kernel = chunk_attention(backend, q, k, v, plan.start, plan.limit, window=window,
                                 position_ids=plan.position_ids, block=block,
                                 dropout=_keep_scale(dropout, q, plan, None))
        out, lse = kernel.forward()
        out, lse = out.to(cd), lse.to(cd)
        pending = _fetch(peers, plan.steps[0], k, v, _TAG_FORWARD) if plan.steps else None
        for i, step in enumerate(plan.steps):
            transfer, sent = pending
            stats.forward_bytes += sent
            recv = transfer.wait()
            pending = _fetch(peers, plan.steps[i + 1], k, v, _TAG_FORWARD + i + 1) if i + 1 < len(plan.steps) else None
            if recv is None:
                continue
            ks, vs = received_key_set(recv, step, n_local)
            part = chunk_attention(backend, q, ks, vs, step.start, step.limit, window=window,
                                   position_ids=step.position_ids, block=block,
                                   dropout=_keep_scale(dropout, q, plan, step))
            out, lse = lse_merge(out, lse, *part.forward())
        n_rows = None
        if coeff:
            n_rows = torch.isfinite(lse).sum().to(torch.float64)
            dist.all_reduce(n_rows, group=peers.group)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, n_rows)
        ctx.plan, ctx.peers, ctx.stats, ctx.backend, ctx.window, ctx.coeff, ctx.block, ctx.dropout = (
            plan, peers, stats, backend, window, coeff, block, dropout)
        return out, lse.float()

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, n_rows = ctx.saved_tensors
        plan, peers, stats, backend, window = ctx.plan, ctx.peers, ctx.stats, ctx.backend, ctx.window
        cd = lse.dtype
        do = torch.zeros_like(out) if grad_out is None else grad_out
        delta = (do.to(cd) * out.to(cd)).sum(-1)
        finite = torch.isfinite(lse)
        if grad_lse is not None:
            delta = delta - torch.where(finite, grad_lse.to(cd), torch.zeros_like(delta))
        if ctx.coeff:
            zreg = 2.0 * ctx.coeff * plan.cp_size * lse / n_rows.clamp_min(1).to(cd)
            delta = delta - torch.where(finite, zreg, torch.zeros_like(delta))
        kernel = chunk_attention(backend, q, k, v, plan.start, plan.limit, window=window,
                                 position_ids=plan.position_ids, block=ctx.block,
                                 dropout=_keep_scale(ctx.dropout, q, plan, None))
        dq, dk, dv = (t.to(cd) for t in kernel.backward(do, lse, delta))
        n_local = q.shape[2]
        pending = _fetch(peers, plan.steps[0], k, v, _TAG_REFETCH) if plan.steps else None
        returns = []
        for i, step in enumerate(plan.steps):
            transfer, sent = pending
            stats.backward_bytes += sent
            recv = transfer.wait()
            nxt = i + 1 < len(plan.steps)
            pending = _fetch(peers, plan.steps[i + 1], k, v, _TAG_REFETCH + i + 1) if nxt else None
            grads = None
            if recv is not None:
                ks, vs = received_key_set(recv, step, n_local)
                part = chunk_attention(backend, q, ks, vs, step.start, step.limit, window=window,
                                       position_ids=step.position_ids, block=ctx.block,
                                       dropout=_keep_scale(ctx.dropout, q, plan, step))
                dq_s, dk_s, dv_s = part.backward(do, lse, delta)
                dq += dq_s.to(cd)
                grads = torch.stack([_pack(dk_s, step.recv_rows, step.recv_slots),
                                     _pack(dv_s, step.recv_rows, step.recv_slots)]).to(k.dtype)
                stats.backward_bytes += grads.numel() * grads.element_size()
            shape = (2, step.num_sent, k.shape[1], k.shape[3]) if step.num_sent else None
            returns.append((start_transfer(peers, grads, step.recv_from, shape, step.send_to, dtype=k.dtype,
                                           device=k.device, tag=_TAG_GRAD + i), step))
        dk_rows, dv_rows = dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)  # views [B, L, H, D]
        for transfer, step in returns:
            back = transfer.wait()
            if back is not None:
                dk_rows.index_put_((step.send_rows, step.send_cols), back[0].to(cd), accumulate=True)
                dv_rows.index_put_((step.send_rows, step.send_cols), back[1].to(cd), accumulate=True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RankPlan, peers: Peers,
                               stats: CommStats, *, backend: str = "blocked", window: int | None = None,
                               zreg_coeff: float = 0.0, block: int | None = None,
                               dropout: PositionalDropout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, T/CP, D] in q.dtype, lse [B, H, T/CP] fp32)`` of this rank's queries over every key
    of the sequence they can see (module docstring). Collective over the CP group."""
    return _ContextParallelAttention.apply(q, k, v, plan, peers, stats, backend, window, float(zreg_coeff), block,
                                           dropout)

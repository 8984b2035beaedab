"""A hand-written single-process DiLoCo over simulated islands: the oracle of the outer-loop tests.

Written from the algorithm (docs/diloco.md), sharing no code with megatron_cai.core.diloco: the islands'
pseudo-gradients are averaged with the wire format's arithmetic spelled out (Squinch through the torch
reference codec, megatron_cai.core.squinch.reference), and the outer step is Nesterov momentum written out.
"""
from __future__ import annotations

import torch

from megatron_cai.core.squinch import reference as squinch_ref


def inner_step(w: torch.Tensor, island: int, t: int) -> torch.Tensor:
    """A deterministic stand-in for an island's inner step (each island pulls towards its own target)."""
    g = torch.Generator().manual_seed(1000 * island + t)
    target = torch.full_like(w, float(island + 1))
    return w - 0.05 * (w - target) + 0.01 * torch.randn(w.shape, generator=g)


def _rows(x: torch.Tensor, world: int) -> tuple[list[torch.Tensor], int]:
    chunk = -(-x.numel() // world)
    padded = torch.nn.functional.pad(x, (0, chunk * world - x.numel()))
    return [padded[r * chunk:(r + 1) * chunk] for r in range(world)], chunk


def _squinch(v: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """decode(encode(v + residual)); the residual keeps the difference (padded to whole blocks)."""
    n = v.numel()
    padded = torch.nn.functional.pad(v, (0, residual.numel() - n))
    payload, _ = squinch_ref.encode_with_feedback(padded, residual)
    return squinch_ref.decode(payload, residual.numel())[:n]


def _bf16(v: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    total = v + residual
    q = total.to(torch.bfloat16).float()
    residual.copy_(total - q)
    return q


def mean_over_islands(deltas: list[torch.Tensor], bits: int, state: dict, key) -> torch.Tensor:
    """The islands' mean pseudo-gradient as the wire carries it: a reduce-scatter of per-owner rows, the
    fp32 sum at the owner in island order, the owner's re-encode, the gather."""
    world = len(deltas)
    if bits == 32:
        total = deltas[0].clone()
        for d in deltas[1:]:
            total = total + d
        return total / world if world > 1 else total
    blocks = (lambda m: -(-m // 8) * 8) if bits == 6 else (lambda m: m)
    codec = _squinch if bits == 6 else _bf16
    if world == 1 and bits == 6:
        res = state.setdefault((key, 0), torch.zeros(blocks(deltas[0].numel())))
        return codec(deltas[0], res)
    rows = [_rows(d, world) for d in deltas]
    chunk = rows[0][1]
    owners = []
    for owner in range(world):
        total = None
        for i in range(world):
            res = state.setdefault((key, i, owner), torch.zeros(blocks(chunk)))
            dec = codec(rows[i][0][owner], res)
            total = dec if total is None else total + dec
        if world == 1:
            owners.append(total)
            continue
        res = state.setdefault((key, "owner", owner), torch.zeros(blocks(chunk)))
        owners.append(codec(total, res))
    out = torch.cat(owners)[:deltas[0].numel()]
    return out / world if world > 1 else out


def diloco(w0: torch.Tensor, islands: int, steps: int, *, H: int, K: int = 1, tau: int = 0, lr: float = 0.7,
           mu: float = 0.9, bits: int = 32, alpha: float = 0.0, slices: int = 1,
           final_average: bool = False) -> list[torch.Tensor]:
    """Every island's final weights. ``slices``: DP x CP ranks per island, each averaging its own slice.
    ``final_average``: at the end the updates in flight land, then each fragment's anchor moves by the islands'
    mean pseudo-gradient (learning rate 1, no momentum) and every island takes it."""
    n = w0.numel()
    local = [w0.clone() for _ in range(islands)]
    anchor = w0.clone()
    cuts = [n * k // K for k in range(K + 1)]
    frags = list(zip(cuts, cuts[1:]))
    buf: dict[int, torch.Tensor] = {}
    residuals: dict = {}
    pending: dict[int, tuple[int, torch.Tensor]] = {}

    def average(f: int) -> torch.Tensor:
        lo, hi = frags[f]
        size = -(-(hi - lo) // slices)
        parts = []
        for s in range(slices):
            a, e = min(lo + s * size, hi), min(lo + (s + 1) * size, hi)
            deltas = [torch.nn.functional.pad(anchor[a:e] - local[i][a:e], (0, size - (e - a)))
                      for i in range(islands)]
            parts.append(mean_over_islands(deltas, bits, residuals, (f, s))[:e - a])
        return torch.cat(parts)

    def apply(f: int, mean: torch.Tensor) -> None:
        lo, hi = frags[f]
        step = mean
        if mu > 0:
            buf[f] = mean.clone() if f not in buf else buf[f].mul(mu).add(mean)
            step = mean.add(buf[f], alpha=mu)  # Nesterov: the gradient plus mu x the new momentum
        anchor[lo:hi] = anchor[lo:hi].add(step, alpha=-lr)  # torch's a + alpha * b (one rounding on the CPU)
        for i in range(islands):
            local[i][lo:hi] = alpha * local[i][lo:hi] + (1 - alpha) * anchor[lo:hi] if alpha else anchor[lo:hi]

    for t in range(1, steps + 1):
        local = [inner_step(local[i], i, t) for i in range(islands)]
        for f in [f for f, (at, _) in pending.items() if at == t]:
            apply(f, pending.pop(f)[1])
        for f in range(K):
            if t % H == (H * (f + 1) // K) % H:
                pending[f] = (t + tau, average(f))
                if tau == 0:
                    apply(f, pending.pop(f)[1])
    if final_average:
        for f in sorted(pending):
            apply(f, pending.pop(f)[1])
        for f, (lo, hi) in enumerate(frags):
            anchor[lo:hi] = anchor[lo:hi] - average(f)
            for i in range(islands):
                local[i][lo:hi] = anchor[lo:hi]
    return local

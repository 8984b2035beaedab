"""Independent references for the visibility / attention tests (no code shared with the library).

Trees are handled from ``parents`` alone: the ancestor relation, the DFS order, depths and leaf
counts are recomputed here by plain recursion, and attention is a textbook fp64 softmax.
"""
from __future__ import annotations

import math
import random

import torch


def random_forest(rng: random.Random, max_nodes: int = 8, max_len: int = 4, p_bidir: float = 0.2,
                  p_zero: float = 0.0, max_roots: int = 1):
    """Random forest with node indices in random order: (parents, node_lengths, bidirectional)."""
    n = rng.randint(1, max_nodes)
    labels = list(range(n))
    rng.shuffle(labels)
    parents = [-1] * n
    n_roots = rng.randint(1, min(max_roots, n))
    for i in range(n_roots, n):
        parents[labels[i]] = labels[rng.randrange(i)]
    lengths = [0 if rng.random() < p_zero else rng.randint(1, max_len) for _ in range(n)]
    bidir = [rng.random() < p_bidir for _ in range(n)]
    return parents, lengths, bidir


def ancestors(parents, n) -> set[int]:
    """Strict ancestors of node n."""
    out = set()
    p = parents[n]
    while p != -1:
        out.add(p)
        p = parents[p]
    return out


def dfs_order(parents) -> list[int]:
    """DFS preorder, roots and children in increasing index order (recursive)."""
    out: list[int] = []

    def visit(n):
        out.append(n)
        for c in range(len(parents)):
            if parents[c] == n:
                visit(c)

    for r in range(len(parents)):
        if parents[r] == -1:
            visit(r)
    return out


def tree_truth(parents, lengths, bidir):
    """Brute-force token table in DFS layout: node of each token and the T x T ancestor mask."""
    order = dfs_order(parents)
    node_of = [n for n in order for _ in range(lengths[n])]
    offset_in_node = [t for n in order for t in range(lengths[n])]
    total = len(node_of)
    mask = torch.zeros(total, total, dtype=torch.bool)
    for i in range(total):
        anc = ancestors(parents, node_of[i])
        for j in range(total):
            if node_of[j] in anc:
                mask[i, j] = True
            elif node_of[j] == node_of[i] and (j <= i or bidir[node_of[i]]):
                mask[i, j] = True
    depth = [sum(lengths[a] for a in ancestors(parents, node_of[i])) + offset_in_node[i]
             for i in range(total)]
    return order, node_of, mask, depth


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE on the last dim, positions ``pos`` broadcast over [..., seq, dim]."""
    dim = x.shape[-1]
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos.to(torch.float64).unsqueeze(-1) * inv
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_attention(q, k, v, mask):
    """fp64 softmax attention with a bool mask [B, Tq, Tk] (or [Tq, Tk]); returns (out, lse).

    GQA by repeating kv heads; fully masked rows give out 0 and lse -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    m = mask if mask.dim() == 4 else (mask.unsqueeze(0) if mask.dim() == 2 else mask).unsqueeze(1)
    s = s.masked_fill(~m, float("-inf"))
    seen = m.any(-1, keepdim=True)
    s_safe = torch.where(seen, s, torch.zeros_like(s))
    lse = torch.logsumexp(s_safe, -1, keepdim=True)
    p = torch.where(seen, torch.exp(s_safe - lse), torch.zeros_like(s))
    lse = torch.where(seen, lse, torch.full_like(lse, float("-inf")))
    return p @ v, lse.squeeze(-1)


def interval_mask(start, limit, window=None, pos=None):
    """Brute-force [B, T, T] mask by the definition: i sees j iff start[j] <= i < limit[j] (+ window)."""
    bsz, seq = start.shape
    mask = torch.zeros(bsz, seq, seq, dtype=torch.bool)
    for b in range(bsz):
        s, lim = start[b].tolist(), limit[b].tolist()
        p = pos[b].tolist() if pos is not None else list(range(seq))
        for i in range(seq):
            for j in range(seq):
                mask[b, i, j] = s[j] <= i < lim[j] and (window is None or abs(p[i] - p[j]) < window)
    return mask


def explicit_loss(q, k, v, mask, dout, w, lse_weight=None):
    """sum(out * dout) + w * mean over rows that see a key of lse^2 (+ sum(lse * lse_weight)), fp64.

    Written out from the definition: no library code.
    """
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ ke.transpose(-1, -2) / math.sqrt(q.shape[-1])
    m = mask.unsqueeze(1).expand_as(s)
    rows = m.any(-1)
    s = torch.where(m, s, torch.full_like(s, -1e300))
    smax = s.amax(-1, keepdim=True).detach()
    z = (torch.exp(s - smax) * m).sum(-1)
    lse = torch.log(torch.where(rows, z, torch.ones_like(z))) + smax.squeeze(-1)
    p = torch.exp(s - lse.unsqueeze(-1)) * m
    out = p @ ve
    loss = (out * dout).sum() + w * (lse[rows] ** 2).sum() / rows.sum()
    if lse_weight is not None:
        loss = loss + (lse[rows] * lse_weight[rows]).sum()
    return loss

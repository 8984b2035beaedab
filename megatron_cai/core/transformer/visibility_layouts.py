"""Visibility-interval layouts: the data-side builders of ``(start, limit)`` per token.

Key j is visible to query i iff ``start[j] <= i < limit[j]`` (the semantics are documented in
:mod:`megatron_cai.core.transformer.visibility`). Datasets and inference build their intervals here;
the attention kernels consume them through :mod:`megatron_cai.core.transformer.attention_tiling`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

INDEX_DTYPE = torch.int32

__all__ = [
    "INDEX_DTYPE",
    "TreeLayout",
    "from_document_lengths",
    "document_position_ids",
    "prefix_lm",
    "from_tree",
    "concat_layouts",
    "pad",
    "batch",
    "validate",
]


def _as_int_list(x: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    vals = x.tolist() if isinstance(x, torch.Tensor) else list(x)
    for i, v in enumerate(vals):
        if int(v) != v:
            raise ValueError(f"{name}[{i}] = {v!r} is not an integer")
    return [int(v) for v in vals]


def _flags(flags: Sequence[bool] | None, n: int, name: str) -> list[bool]:
    if flags is None:
        return [False] * n
    flags = [bool(f) for f in flags]
    if len(flags) != n:
        raise ValueError(f"{name} has {len(flags)} entries, expected {n}")
    return flags


def from_document_lengths(
    lengths: Sequence[int] | torch.Tensor, bidirectional: Sequence[bool] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Intervals for documents packed back to back: each causal, or bidirectional where flagged.

    Returns 1-D ``(start, limit)`` of length ``sum(lengths)`` (int32).
    """
    lens = _as_int_list(lengths, "lengths")
    bidir = _flags(bidirectional, len(lens), "bidirectional")
    if any(n < 0 for n in lens):
        raise ValueError(f"document lengths must be >= 0, got {lens}")
    total = sum(lens)
    idx = torch.arange(total, dtype=torch.int64)
    lt = torch.tensor(lens, dtype=torch.int64)
    ends = torch.cumsum(lt, 0)
    begins = ends - lt
    doc_end = torch.repeat_interleave(ends, lt)
    doc_begin = torch.repeat_interleave(begins, lt)
    is_bidir = torch.repeat_interleave(torch.tensor(bidir, dtype=torch.bool), lt)
    start = torch.where(is_bidir, doc_begin, idx)
    return start.to(INDEX_DTYPE), doc_end.to(INDEX_DTYPE)


def document_position_ids(lengths: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 in each packed document (int64, for RoPE)."""
    lt = torch.tensor(_as_int_list(lengths, "lengths"), dtype=torch.int64)
    total = int(lt.sum())
    begins = torch.cumsum(lt, 0) - lt
    return torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(begins, lt)


def prefix_lm(
    prefix_len: int | Sequence[int], total_len: int | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix-LM: a bidirectional prefix followed by causal tokens, per document.

    Scalars describe one document; equal-length sequences describe packed documents, document d
    having ``total_len[d]`` tokens of which the first ``prefix_len[d]`` form the bidirectional prefix.
    Prefix keys get (doc_start, doc_end); the others (j, doc_end).
    """
    scalar = isinstance(prefix_len, int) and isinstance(total_len, int)
    prefixes = [prefix_len] if scalar else _as_int_list(prefix_len, "prefix_len")
    totals = [total_len] if scalar else _as_int_list(total_len, "total_len")
    if len(prefixes) != len(totals):
        raise ValueError(f"prefix_len has {len(prefixes)} entries but total_len has {len(totals)}")
    starts, limits, offset = [], [], 0
    for d, (p, n) in enumerate(zip(prefixes, totals)):
        if not 0 <= p <= n:
            raise ValueError(f"document {d}: prefix_len {p} must be in [0, total_len={n}]")
        j = torch.arange(offset, offset + n, dtype=torch.int64)
        starts.append(torch.where(j < offset + p, torch.full_like(j, offset), j))
        limits.append(torch.full_like(j, offset + n))
        offset += n
    return torch.cat(starts).to(INDEX_DTYPE), torch.cat(limits).to(INDEX_DTYPE)


@dataclass
class TreeLayout:
    """A tree laid out in DFS preorder (children in index order), each node's tokens contiguous.

    All tensors are 1-D over the ``num_tokens`` laid-out tokens unless noted.
    """

    order: torch.Tensor  # [num_nodes] node indices in layout order (int64)
    start: torch.Tensor  # visibility_start (int32)
    limit: torch.Tensor  # visibility_limit (int32)
    position_ids: torch.Tensor  # token index along the root-to-token path (int64), drives RoPE
    branch_weight: torch.Tensor  # fraction of the tree's leaves below the token's node (float32)
    node_of_token: torch.Tensor  # node index of each token (int64)
    node_start: torch.Tensor  # [num_nodes] first layout position of each node, by node index
    subtree_end: torch.Tensor  # [num_nodes] end of each node's DFS subtree, by node index
    parents: torch.Tensor  # [num_nodes] parent node index (-1 for a root), by node index
    leaves: torch.Tensor  # leaf node indices in layout order

    @property
    def num_tokens(self) -> int:
        return int(self.start.numel())

    def branch_tokens(self, node: int) -> torch.Tensor:
        """Layout positions of the tokens on the root-to-``node`` path (ancestors first, in order)."""
        path = []
        n = int(node)
        while n >= 0:
            path.append(n)
            n = int(self.parents[n])
        pieces = [
            torch.nonzero(self.node_of_token == m, as_tuple=False).flatten() for m in reversed(path)
        ]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def from_tree(
    parents: Sequence[int] | torch.Tensor,
    node_lengths: Sequence[int] | torch.Tensor,
    bidirectional: Sequence[bool] | None = None,
) -> TreeLayout:
    """Lay out a forest given ``parents[n]`` (-1 for a root) and ``node_lengths[n]`` (tokens per node).

    Nodes go in DFS preorder with children (and roots) in index order. Key j of node n gets
    ``(j, subtree_end(n))``, or ``(node_start(n), subtree_end(n))`` when ``bidirectional[n]``.
    ``position_ids`` count tokens along the root-to-token path; ``branch_weight`` is the fraction of
    leaves (nodes without children) below the token's node, counting the node itself if it is a leaf.
    """
    par = _as_int_list(parents, "parents")
    lens = _as_int_list(node_lengths, "node_lengths")
    n_nodes = len(par)
    if len(lens) != n_nodes:
        raise ValueError(f"parents has {n_nodes} entries but node_lengths has {len(lens)}")
    bidir = _flags(bidirectional, n_nodes, "bidirectional")
    children: list[list[int]] = [[] for _ in range(n_nodes)]
    roots = []
    for n, p in enumerate(par):
        if lens[n] < 0:
            raise ValueError(f"node_lengths[{n}] = {lens[n]} must be >= 0")
        if p == -1:
            roots.append(n)
        elif 0 <= p < n_nodes and p != n:
            children[p].append(n)
        else:
            raise ValueError(f"parents[{n}] = {p} is not -1 or a node index in [0, {n_nodes})")

    order: list[int] = []
    depth_tokens = [0] * n_nodes  # tokens on the path above the node
    stack = list(reversed(roots))
    while stack:
        n = stack.pop()
        order.append(n)
        for c in reversed(children[n]):
            depth_tokens[c] = depth_tokens[n] + lens[n]
            stack.append(c)
    if len(order) != n_nodes:
        missing = sorted(set(range(n_nodes)) - set(order))
        raise ValueError(f"parents has a cycle: nodes {missing[:5]} are not reachable from a root")

    node_start = [0] * n_nodes
    pos = 0
    for n in order:
        node_start[n] = pos
        pos += lens[n]
    subtree_end = [0] * n_nodes
    n_leaves = [0] * n_nodes
    for n in reversed(order):  # children come after their parent in preorder
        subtree_end[n] = node_start[n] + lens[n]
        n_leaves[n] = 0 if children[n] else 1
        for c in children[n]:
            subtree_end[n] = max(subtree_end[n], subtree_end[c])
            n_leaves[n] += n_leaves[c]
    root_of = list(range(n_nodes))
    for n in order:
        if par[n] >= 0:
            root_of[n] = root_of[par[n]]

    order_t = torch.tensor(order, dtype=torch.int64)
    lens_o = torch.tensor([lens[n] for n in order], dtype=torch.int64)
    node_of_token = torch.repeat_interleave(order_t, lens_o)
    total = int(lens_o.sum())
    j = torch.arange(total, dtype=torch.int64)
    ns = torch.tensor(node_start, dtype=torch.int64)[node_of_token]
    se = torch.tensor(subtree_end, dtype=torch.int64)[node_of_token]
    bd = torch.tensor(bidir, dtype=torch.bool)[node_of_token]
    start = torch.where(bd, ns, j)
    pos_ids = torch.tensor(depth_tokens, dtype=torch.int64)[node_of_token] + (j - ns)
    leaves_per_root = torch.tensor([n_leaves[root_of[n]] for n in range(n_nodes)], dtype=torch.float64)
    weight = (torch.tensor(n_leaves, dtype=torch.float64) / leaves_per_root.clamp_min(1))[node_of_token]
    leaves = [n for n in order if not children[n]]
    return TreeLayout(
        order=order_t,
        start=start.to(INDEX_DTYPE),
        limit=se.to(INDEX_DTYPE),
        position_ids=pos_ids,
        branch_weight=weight.to(torch.float32),
        node_of_token=node_of_token,
        node_start=torch.tensor(node_start, dtype=torch.int64),
        subtree_end=torch.tensor(subtree_end, dtype=torch.int64),
        parents=torch.tensor(par, dtype=torch.int64),
        leaves=torch.tensor(leaves, dtype=torch.int64),
    )


def concat_layouts(layouts: Sequence[TreeLayout]) -> TreeLayout:
    """Pack several tree layouts back to back into one row (node indices renumbered consecutively)."""
    if not layouts:
        raise ValueError("concat_layouts needs at least one layout")
    tok_off, node_off = 0, 0
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in TreeLayout.__dataclass_fields__}
    for lay in layouts:
        parts["order"].append(lay.order + node_off)
        parts["start"].append(lay.start + tok_off)
        parts["limit"].append(lay.limit + tok_off)
        parts["position_ids"].append(lay.position_ids)
        parts["branch_weight"].append(lay.branch_weight)
        parts["node_of_token"].append(lay.node_of_token + node_off)
        parts["node_start"].append(lay.node_start + tok_off)
        parts["subtree_end"].append(lay.subtree_end + tok_off)
        parts["parents"].append(torch.where(lay.parents >= 0, lay.parents + node_off, lay.parents))
        parts["leaves"].append(lay.leaves + node_off)
        tok_off += lay.num_tokens
        node_off += int(lay.parents.numel())
    return TreeLayout(**{k: torch.cat(v) for k, v in parts.items()})


def pad(
    start: torch.Tensor, limit: torch.Tensor, seq_len: int, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Right-pad 1-D intervals to ``seq_len``; padding token j gets (j, j + 1), position id 0.

    Returns ``(start, limit)`` or ``(start, limit, position_ids)`` when position ids are given.
    """
    n = int(start.numel())
    if n > seq_len:
        raise ValueError(f"cannot pad {n} tokens to seq_len {seq_len}: the layout is longer")
    j = torch.arange(n, seq_len, dtype=start.dtype)
    out = (torch.cat([start, j]), torch.cat([limit.to(start.dtype), j + 1]))
    if position_ids is None:
        return out
    return out + (torch.cat([position_ids, torch.zeros(seq_len - n, dtype=position_ids.dtype)]),)


def batch(rows: Sequence[Sequence[torch.Tensor]], seq_len: int | None = None) -> tuple[torch.Tensor, ...]:
    """Stack 1-D rows ``(start, limit[, position_ids])`` into ``[batch, seq]`` tensors, padding each."""
    if not rows:
        raise ValueError("batch needs at least one row")
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise ValueError("rows must all be (start, limit) or all (start, limit, position_ids)")
    seq_len = max(int(r[0].numel()) for r in rows) if seq_len is None else seq_len
    padded = [pad(r[0], r[1], seq_len, r[2] if width > 2 else None) for r in rows]
    return tuple(torch.stack([p[k] for p in padded]) for k in range(width))


def validate(start: torch.Tensor, limit: torch.Tensor) -> None:
    """Check ``0 <= start[j] <= j < limit[j] <= seq`` for every key j (any leading batch dims).

    Raises ValueError naming the first offending position.
    """
    if start.shape != limit.shape:
        raise ValueError(
            f"visibility_start {tuple(start.shape)} and visibility_limit {tuple(limit.shape)} differ in shape"
        )
    if start.dim() == 0:
        raise ValueError("visibility tensors need a sequence dimension")
    if start.dtype.is_floating_point or limit.dtype.is_floating_point:
        raise ValueError(f"visibility tensors must be integer, got {start.dtype} / {limit.dtype}")
    seq = start.shape[-1]
    j = torch.arange(seq, device=start.device)
    checks = [
        (start < 0, "visibility_start < 0"),
        (limit > seq, f"visibility_limit > seq_len ({seq})"),
        (start > j, "visibility_start > j: key j is not visible to itself"),
        (limit <= j, "visibility_limit <= j: key j is not visible to itself"),
    ]
    for bad, what in checks:
        if bool(bad.any()):
            idx = tuple(int(x) for x in torch.nonzero(bad, as_tuple=False)[0])
            raise ValueError(
                f"invalid visibility interval at position {idx}: {what} "
                f"(start={int(start[idx])}, limit={int(limit[idx])}, j={idx[-1]})"
            )

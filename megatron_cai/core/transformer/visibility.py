"""Visibility intervals: an O(T) attention mask for packed, bidirectional and tree-structured documents.

Semantics (key-side, see DESIGN.md "Key decisions"): every key token j carries two ints,
``start[j]`` and ``limit[j]``; query i may attend key j iff ``start[j] <= i < limit[j]``.

- causal packed document [a, b): key j -> (j, b);
- bidirectional document or span [a, b): key j -> (a, b);
- tree in DFS preorder: key j of node n -> (j, subtree_end(n)), or (node_start(n), subtree_end(n))
  for a bidirectional node, so a query sees exactly its ancestors' tokens and its own node's earlier
  (or, bidirectional, all) tokens;
- padding token j -> (j, j + 1): it sees (and is seen by) only itself.

Optional sliding window W, measured on ``position_ids`` (logical positions, e.g. depth along a
tree branch): query i may additionally only see key j when ``|pos[i] - pos[j]| < W``. Every
interval-visible key of a causal token sits at ``pos[j] <= pos[i]``, so this is the usual causal
window ``0 <= pos[i] - pos[j] < W``; inside a bidirectional span the window is symmetric.

Block summaries (:func:`block_map`) decide for each (query block, key block) whether it may hold a
visible pair and whether all its pairs are visible, from per-block min/max of start/limit/position
in O(T / block) memory per block row: the fast paths never evaluate T x T pairs.
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
    "dense_mask",
    "block_map",
    "block_indices",
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


def dense_mask(
    start: torch.Tensor,
    limit: torch.Tensor,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask ``[..., num_queries, seq]`` (True = visible) from the intervals; O(T x T) memory.

    ``queries`` selects query positions (default all). Reference and small-block use only.
    """
    seq = start.shape[-1]
    qi = torch.arange(seq, device=start.device) if queries is None else queries.to(start.device)
    s, lim = start.unsqueeze(-2), limit.unsqueeze(-2)
    q = qi.view(-1, 1)
    mask = (s <= q) & (q < lim)
    if window is not None:
        pos = _positions(start, position_ids)
        diff = pos[..., qi].unsqueeze(-1) - pos.unsqueeze(-2)
        mask &= diff.abs() < window
    return mask


def _positions(start: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    if position_ids is None:
        return torch.arange(start.shape[-1], device=start.device).expand(start.shape)
    if position_ids.shape[-1] != start.shape[-1]:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} do not match seq_len {start.shape[-1]}")
    return position_ids.expand(start.shape)


def _block_reduce(x: torch.Tensor, block: int, op: str, fill: int) -> torch.Tensor:
    """Per-block min or max over the last dim (padded with ``fill``): [..., ceil(T / block)]."""
    seq = x.shape[-1]
    nb = -(-seq // block)
    padded = torch.nn.functional.pad(x.to(torch.int64), (0, nb * block - seq), value=fill)
    blocks = padded.view(*x.shape[:-1], nb, block)
    return blocks.amin(-1) if op == "min" else blocks.amax(-1)


def block_map(
    start: torch.Tensor,
    limit: torch.Tensor,
    block_q: int,
    block_k: int,
    window: int | None = None,
    position_ids: torch.Tensor | None = None,
    num_queries: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query block, key block) tiles may hold a visible pair, and which are fully visible.

    ``start``/``limit`` are ``[batch, seq]``. The queries are the last ``num_queries`` positions
    (default all ``seq``; fewer when decoding past a cache), tiled from the first of them.
    Returns bool ``(any, full)`` of shape
    ``[batch, ceil(num_queries / block_q), ceil(T / block_k)]`` computed from per-key-block min/max of
    start/limit (and per-block min/max of positions with a window): O(T / block) work per tile row,
    never a T x T evaluation. ``any`` is conservative (it may flag a tile without visible pairs),
    ``full`` is exact-safe (every pair of a full tile is visible; the tiles at the ragged end count
    only their in-range pairs).
    """
    seq = start.shape[-1]
    big = 1 << 40
    min_s = _block_reduce(start, block_k, "min", big)
    max_s = _block_reduce(start, block_k, "max", -big)
    min_l = _block_reduce(limit, block_k, "min", big)
    max_l = _block_reduce(limit, block_k, "max", -big)
    n_queries = seq if num_queries is None else num_queries
    offset = seq - n_queries
    if not 0 <= offset <= seq:
        raise ValueError(f"num_queries ({num_queries}) must be in [0, seq_len={seq}]")
    nq = -(-n_queries // block_q)
    qs = torch.arange(nq, device=start.device, dtype=torch.int64) * block_q + offset
    qe = torch.clamp(qs + block_q, max=seq)  # exclusive, absolute positions
    qs_, qe_ = qs.view(-1, 1), qe.view(-1, 1)
    ms, xs = min_s.unsqueeze(-2), max_s.unsqueeze(-2)
    ml, xl = min_l.unsqueeze(-2), max_l.unsqueeze(-2)
    any_ = (ms < qe_) & (xl > qs_)
    full = (xs <= qs_) & (ml >= qe_)
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        pos = _positions(start, position_ids)
        kmin = _block_reduce(pos, block_k, "min", big).unsqueeze(-2)
        kmax = _block_reduce(pos, block_k, "max", -big).unsqueeze(-2)
        qmin = _block_reduce(pos[..., offset:], block_q, "min", big).unsqueeze(-1)
        qmax = _block_reduce(pos[..., offset:], block_q, "max", -big).unsqueeze(-1)
        # diff = pos_q - pos_k ranges over [qmin - kmax, qmax - kmin]; visible needs |diff| < window.
        any_ &= (qmin - kmax < window) & (qmax - kmin > -window)
        full &= (qmax - kmin < window) & (kmax - qmin < window)
    return any_, full & any_


def block_indices(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact a bool tile map ``[..., n_rows, n_cols]`` into ``(count [..., n_rows] int32,
    indices [..., n_rows, n_cols] int32)``: the flagged columns first, in increasing order."""
    n_cols = tiles.shape[-1]
    cols = torch.arange(n_cols, device=tiles.device, dtype=torch.int64)
    key = torch.where(tiles, cols, cols + n_cols)
    indices = torch.sort(key, dim=-1).values % n_cols
    return tiles.sum(-1).to(torch.int32), indices.to(torch.int32)

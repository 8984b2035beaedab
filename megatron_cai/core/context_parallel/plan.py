"""Which keys each CP rank needs from each peer, and the per-key-set intervals its kernels run on.

Every CP rank holds the whole micro-batch's intervals (the data path slices tokens, not intervals), so
each builds the same plan without communicating. A key j held by rank s is *needed* by rank r != s iff
some query i of r can see it: ``start[j] <= i < limit[j]`` (exact, from a prefix count of r's queries),
and with a sliding window some query block of r that overlaps ``[start[j], limit[j])`` lies within the
window of ``position_ids[j]`` (per-block min/max of the queries' positions; conservative). Keys no query
of r can see are never sent to r and never enter r's kernels.

The exchange follows a ring schedule of direct transfers: at step d (1 .. CP-1) rank r sends to
``r + d`` the keys that rank needs and receives from ``r - d`` the keys it needs; nothing is ever relayed
through a third rank. Within a key set the local queries' global positions ``g`` are increasing, so the
queries that see key j form one contiguous run of local rows, ``[searchsorted(g, start[j]),
searchsorted(g, limit[j]))``: the plan rewrites every interval into local-row coordinates, and the
ordinary kernels (queries = the last rows of the key sequence) run unchanged. A remote key set of ``n``
keys is laid out as ``n`` received keys followed by ``T / CP`` invisible placeholders (interval (0, 0)),
so that the local queries are its last rows and take their own positions for the window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .split import SequenceSplit, interval_needs

__all__ = ["KeySetPlan", "RankPlan", "build_rank_plan", "needed_keys"]

WINDOW_QUERY_BLOCK = 64  # query rows per block in the window test of needed_keys


@dataclass
class KeySetPlan:
    """One exchange step of one rank: what it sends to ``send_to`` and the key set from ``recv_from``.

    ``send_rows``/``send_cols``: batch row and local index of each key sent, in row-major order;
    ``recv_rows``/``recv_slots``: batch row and slot (``< num_slots``) of each key received;
    ``start``/``limit``/``position_ids``: ``[B, num_slots + T / CP]`` kernel intervals of the key set;
    ``key_index``: the same shape, each slot's global sequence position (what attention dropout hashes).
    """

    send_to: int
    recv_from: int
    send_rows: torch.Tensor
    send_cols: torch.Tensor
    recv_rows: torch.Tensor
    recv_slots: torch.Tensor
    num_slots: int
    start: torch.Tensor
    limit: torch.Tensor
    position_ids: torch.Tensor
    key_index: torch.Tensor

    @property
    def num_sent(self) -> int:
        return int(self.send_rows.numel())

    @property
    def num_received(self) -> int:
        return int(self.recv_rows.numel())


@dataclass
class RankPlan:
    """A CP rank's attention plan for one micro-batch: its own key set and one per exchange step."""

    rank: int
    cp_size: int
    local_index: torch.Tensor      # [T / CP] global positions of the local tokens (increasing)
    start: torch.Tensor            # [B, T / CP] local key set's intervals, in local-row coordinates
    limit: torch.Tensor
    position_ids: torch.Tensor     # [B, T / CP] the local tokens' positions (what a window measures)
    steps: list[KeySetPlan]


def _window_ok(split: SequenceSplit, rank: int, start, limit, pos, window: int) -> torch.Tensor:
    """``[B, T]``: some query block of ``rank`` overlapping key j's interval is within the window of j."""
    idx = split.token_index(rank).to(start.device)
    blocks = []
    for c in split.chunks_of(rank):
        a0 = c * split.chunk_length
        for a in range(a0, a0 + split.chunk_length, WINDOW_QUERY_BLOCK):
            blocks.append((a, min(a + WINDOW_QUERY_BLOCK, a0 + split.chunk_length)))
    a = torch.tensor([b[0] for b in blocks], device=start.device)
    e = torch.tensor([b[1] for b in blocks], device=start.device)
    local = split.local_position.to(start.device)
    qpos = pos[:, idx]  # [B, L]
    qmin = torch.stack([qpos[:, local[x]:local[y - 1] + 1].amin(-1) for x, y in zip(a.tolist(), e.tolist())], -1)
    qmax = torch.stack([qpos[:, local[x]:local[y - 1] + 1].amax(-1) for x, y in zip(a.tolist(), e.tolist())], -1)
    s, lim, p = start.unsqueeze(-1), limit.unsqueeze(-1), pos.unsqueeze(-1)  # [B, T, 1]
    hit = (s < e) & (lim > a) & (qmin.unsqueeze(1) - p < window) & (qmax.unsqueeze(1) - p > -window)
    return hit.any(-1)


def needed_keys(split: SequenceSplit, start: torch.Tensor, limit: torch.Tensor, *, window: int | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[CP, B, T]`` bool: rank r needs key j from the rank that holds it (never its own keys)."""
    need = interval_needs(split, start, limit)
    if window is not None:
        seq, bsz = split.seq_length, start.shape[0]
        s = start.to(torch.int64).clamp(0, seq)
        lim = limit.to(torch.int64).clamp(0, seq)
        pos = position_ids.to(torch.int64) if position_ids is not None else \
            torch.arange(seq, device=start.device).expand(bsz, seq)
        for r in range(split.cp_size):
            need[r] &= _window_ok(split, r, s, lim, pos, window)
    return need


def _local_rows(index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Positions ``values`` as local-row boundaries: how many of the increasing ``index`` lie below each."""
    return torch.searchsorted(index, values.to(torch.int64).contiguous())


def build_rank_plan(split: SequenceSplit, rank: int, start: torch.Tensor, limit: torch.Tensor,
                    position_ids: torch.Tensor | None, *, window: int | None = None) -> RankPlan:
    """Rank ``rank``'s :class:`RankPlan` from the whole micro-batch's ``[B, T]`` intervals."""
    device = start.device
    bsz, seq = start.shape
    if seq != split.seq_length:
        raise ValueError(f"the intervals have {seq} positions, the split {split.seq_length}")
    pos = position_ids.to(torch.int64) if position_ids is not None else \
        torch.arange(seq, device=device).expand(bsz, seq)
    pos = pos.expand(bsz, seq)
    need = needed_keys(split, start, limit, window=window, position_ids=pos)
    idx = split.token_index(rank).to(device)
    n_local = idx.numel()
    s_rows, l_rows = _local_rows(idx, start), _local_rows(idx, limit)  # [B, T] in local-row coordinates
    steps = []
    for d in range(1, split.cp_size):
        send_to, recv_from = (rank + d) % split.cp_size, (rank - d) % split.cp_size
        send_rows, send_keys = torch.nonzero(need[send_to][:, idx], as_tuple=True)
        recv_rows, recv_keys = torch.nonzero(need[rank] & (split.owner_of_token.to(device) == recv_from),
                                             as_tuple=True)
        per_row = torch.bincount(recv_rows, minlength=bsz)
        slots = torch.arange(recv_rows.numel(), device=device) - (per_row.cumsum(0) - per_row)[recv_rows]
        n_slots = int(per_row.max()) if recv_rows.numel() else 0
        width = n_slots + n_local
        st = torch.zeros(bsz, width, dtype=torch.int64, device=device)
        li = torch.zeros(bsz, width, dtype=torch.int64, device=device)
        ps_ = torch.zeros(bsz, width, dtype=torch.int64, device=device)
        key_index = torch.zeros(bsz, width, dtype=torch.int64, device=device)
        key_index[recv_rows, slots] = recv_keys
        key_index[:, n_slots:] = idx
        st[recv_rows, slots] = s_rows[recv_rows, recv_keys] + n_slots
        li[recv_rows, slots] = l_rows[recv_rows, recv_keys] + n_slots
        ps_[recv_rows, slots] = pos[recv_rows, recv_keys]
        ps_[:, n_slots:] = pos[:, idx]
        steps.append(KeySetPlan(send_to, recv_from, send_rows, send_keys, recv_rows, slots, n_slots, st, li, ps_,
                                key_index))
    return RankPlan(rank, split.cp_size, idx, s_rows[:, idx], l_rows[:, idx], pos[:, idx].contiguous(), steps)

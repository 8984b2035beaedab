"""How one sequence is split over the context-parallel (CP) ranks: equal chunks, balanced by visible work.

The sequence of ``T`` tokens is cut into ``C`` equal chunks (``C`` a multiple of CP); each CP rank owns
``C / CP`` of them and holds their tokens in sequence order, so every rank has ``T / CP`` tokens and
every pipeline, sequence-parallel and batch shape stays uniform.

*Work* is the number of visible (query, key) pairs of a query: for query i, the keys j with
``start[j] <= i < limit[j]`` (:func:`visible_keys_per_query`, O(T) from a difference array; a sliding
window is not counted). Chunks are dealt to ranks by longest-processing-time with equal counts: in order
of decreasing work (ties: the earlier chunk), each chunk goes to the least-loaded rank (ties: the lower
rank) that still has room. With ``C = 2 CP`` on a plain causal sequence this is exactly Megatron-LM's
zig-zag (rank r owns chunks r and 2 CP - 1 - r, :func:`zigzag_split`), whose pairs carry equal work.

:func:`balanced_split` scores the contiguous split (``C = CP``: the fewest documents cut) and the dealt
splits with ``C = 2 CP, 4 CP, 8 CP, ...`` (while chunks stay at least ``min_chunk`` tokens): among those
whose imbalance (max over mean of the ranks' work) is within ``tolerance``, it keeps the one whose busiest
rank puts the fewest key rows on the wire (:func:`exchange_keys`; the fewest chunks on ties), else the
most balanced. More, shorter chunks balance better but cut more documents, and every cut sends keys.
The split is a deterministic function of the batch (summed over its rows): every CP rank computes the
same one.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["SequenceSplit", "balanced_split", "exchange_keys", "imbalance", "interval_needs", "rank_work",
           "visible_keys_per_query", "zigzag_split"]


@dataclass(frozen=True)
class SequenceSplit:
    """``chunk_owner[c]``: the CP rank that holds chunk c (chunks of ``seq_length / len(chunk_owner)``)."""

    seq_length: int
    cp_size: int
    chunk_owner: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.chunk_owner)
        if n == 0 or self.seq_length % n != 0 or n % self.cp_size != 0:
            raise ValueError(f"{n} chunks must divide seq_length {self.seq_length} and be a multiple of "
                             f"context-parallel-size {self.cp_size}")
        counts = [self.chunk_owner.count(r) for r in range(self.cp_size)]
        if len(set(counts)) != 1:
            raise ValueError(f"every CP rank must own as many chunks; counts {counts}")

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_owner)

    @property
    def chunk_length(self) -> int:
        return self.seq_length // self.num_chunks

    @property
    def local_length(self) -> int:
        return self.seq_length // self.cp_size

    def chunks_of(self, rank: int) -> list[int]:
        return [c for c, r in enumerate(self.chunk_owner) if r == rank]

    @cached_property
    def _indices(self) -> tuple[torch.Tensor, ...]:
        base = torch.arange(self.chunk_length, dtype=torch.int64)
        return tuple(torch.cat([c * self.chunk_length + base for c in self.chunks_of(r)])
                     for r in range(self.cp_size))

    def token_index(self, rank: int) -> torch.Tensor:
        """Global positions of rank ``rank``'s tokens, increasing: ``[T / CP]`` int64."""
        return self._indices[rank]

    @cached_property
    def owner_of_token(self) -> torch.Tensor:
        """``[T]`` int64: the rank holding each token."""
        return torch.tensor(self.chunk_owner, dtype=torch.int64).repeat_interleave(self.chunk_length)

    @cached_property
    def local_position(self) -> torch.Tensor:
        """``[T]`` int64: each token's index inside its rank's local sequence."""
        out = torch.empty(self.seq_length, dtype=torch.int64)
        for r in range(self.cp_size):
            idx = self.token_index(r)
            out[idx] = torch.arange(idx.numel())
        return out


def zigzag_split(seq_length: int, cp_size: int) -> SequenceSplit:
    """Megatron-LM's causal split: ``2 CP`` chunks, rank r holds chunks r and ``2 CP - 1 - r``."""
    owner = [0] * (2 * cp_size)
    for r in range(cp_size):
        owner[r] = owner[2 * cp_size - 1 - r] = r
    return SequenceSplit(seq_length, cp_size, tuple(owner))


def visible_keys_per_query(start: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` int64: for each query i the number of keys j with ``start[j] <= i < limit[j]``."""
    seq = start.shape[-1]
    lead = start.shape[:-1]
    diff = torch.zeros(*lead, seq + 1, dtype=torch.int64, device=start.device)
    ones = torch.ones_like(start, dtype=torch.int64)
    diff.scatter_add_(-1, start.to(torch.int64).clamp(0, seq), ones)
    diff.scatter_add_(-1, limit.to(torch.int64).clamp(0, seq), -ones)
    return diff.cumsum(-1)[..., :seq]


def _deal(chunk_work: list[int], cp_size: int) -> tuple[int, ...]:
    """Longest-processing-time with equal counts (see the module docstring); deterministic."""
    per_rank = len(chunk_work) // cp_size
    load, count = [0] * cp_size, [0] * cp_size
    owner = [0] * len(chunk_work)
    for c in sorted(range(len(chunk_work)), key=lambda c: (-chunk_work[c], c)):
        r = min((r for r in range(cp_size) if count[r] < per_rank), key=lambda r: (load[r], r))
        owner[c] = r
        load[r] += chunk_work[c]
        count[r] += 1
    return tuple(owner)


def rank_work(work: torch.Tensor, split: SequenceSplit) -> list[int]:
    """Total work (``[T]`` or ``[B, T]``, summed over rows) of each rank's tokens under ``split``."""
    per_token = work.reshape(-1, work.shape[-1]).sum(0)
    return [int(per_token[split.token_index(r)].sum()) for r in range(split.cp_size)]


def imbalance(loads: list[int]) -> float:
    """Max over mean of the ranks' loads (1.0 is perfect)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _query_counts(split: SequenceSplit, device) -> torch.Tensor:
    """``[CP, T + 1]``: entry [r, x] = how many of rank r's queries lie before position x."""
    owner = split.owner_of_token.to(device)
    member = owner.unsqueeze(0) == torch.arange(split.cp_size, device=device).unsqueeze(1)
    return torch.nn.functional.pad(member.to(torch.int64).cumsum(-1), (1, 0))


def interval_needs(split: SequenceSplit, start: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``[CP, B, T]`` bool: some query of rank r lies in ``[start[j], limit[j])`` and another rank holds key j
    (exact; from a prefix count of each rank's queries, O(CP x B x T))."""
    seq = split.seq_length
    start, limit = start.reshape(-1, seq), limit.reshape(-1, seq)
    counts = _query_counts(split, start.device)
    s = start.to(torch.int64).clamp(0, seq)
    lim = limit.to(torch.int64).clamp(0, seq)
    cp, bsz = split.cp_size, start.shape[0]
    c = counts.unsqueeze(1).expand(cp, bsz, seq + 1)
    need = c.gather(-1, lim.unsqueeze(0).expand(cp, bsz, seq)) > c.gather(-1, s.unsqueeze(0).expand(cp, bsz, seq))
    owner = split.owner_of_token.to(start.device)
    return need & (owner.view(1, 1, -1) != torch.arange(cp, device=start.device).view(-1, 1, 1))


def exchange_keys(split: SequenceSplit, start: torch.Tensor, limit: torch.Tensor) -> list[int]:
    """Per rank, the key rows it puts on the wire for one attention call, forward and backward: the keys
    others need (twice: forward, and again in backward) plus the dK/dV of the keys it received."""
    need = interval_needs(split, start, limit)
    owner = split.owner_of_token.to(need.device)
    received = need.sum(dim=(1, 2))
    sent = torch.stack([(need & (owner == r)).sum() for r in range(split.cp_size)])
    return (2 * sent + received).tolist()


def balanced_split(start: torch.Tensor, limit: torch.Tensor, cp_size: int, *, tolerance: float = 1.05,
                   min_chunk: int = 64) -> SequenceSplit:
    """The split of ``[T]`` or ``[B, T]`` intervals that balances visible pairs (module docstring)."""
    seq = start.shape[-1]
    if seq % (2 * cp_size) != 0:
        raise ValueError(f"seq_length {seq} must be divisible by 2 x context-parallel-size = {2 * cp_size}")
    work = visible_keys_per_query(start, limit).reshape(-1, seq).sum(0)
    candidates = [SequenceSplit(seq, cp_size, tuple(range(cp_size)))]  # contiguous: the fewest cut documents
    n = 2 * cp_size
    while True:
        chunk_work = work.view(n, seq // n).sum(-1).tolist()
        candidates.append(SequenceSplit(seq, cp_size, _deal(chunk_work, cp_size)))
        if seq % (2 * n) != 0 or seq // (2 * n) < min_chunk:
            break
        n *= 2
    scored = [(imbalance(rank_work(work, c)), c) for c in candidates]
    balanced = [c for imb, c in scored if imb <= tolerance]
    if not balanced:
        return min(scored, key=lambda x: x[0])[1]
    return min(balanced, key=lambda c: max(exchange_keys(c, start, limit)))  # first (fewest chunks) on ties

"""The data path under context parallelism: a CP rank's share of a micro-batch (Megatron-LM's
``get_batch_on_this_cp_rank``), and the visibility object its attention layers receive.

Every CP rank of a data-parallel replica loads the same micro-batch. :func:`shard_batch` splits it
(:mod:`.split`: zig-zag for a plain causal batch, visible-work balanced for intervals) and keeps:

- ``tokens``, ``position_ids`` (each token keeps its own position: RoPE and windows are unchanged) and
  per-token targets (``labels``, ``loss_mask``, distillation samples): the rank's tokens, in sequence order;
- tree data (``label_positions``): a loss slot belongs to the rank holding the hidden state that predicts
  it, so the slots a rank keeps are those whose ``label_positions`` it holds (rows padded with masked slots
  to the longest), and their ``label_positions`` become local indices;
- ``loss_normalizer``: the whole micro-batch's loss-mask total divided by CP, so that each rank's
  ``sum(loss * mask) / loss_normalizer`` is its share of the sequence mean times CP (the DP x CP gradient
  mean then averages the shares into the mean);
- ``visibility``: a :class:`ContextParallelVisibility` holding the whole micro-batch's intervals, from
  which each layer's attention plan is built once per window (all layers share it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import parallel_state as ps
from ..transformer.attention_dropout import PositionalDropout
from .attention import context_parallel_attention
from .exchange import CommStats, Peers
from .plan import RankPlan, build_rank_plan
from .split import SequenceSplit, balanced_split, zigzag_split

__all__ = ["ContextParallelVisibility", "PER_TOKEN_KEYS", "get_batch_on_this_cp_rank", "shard_batch", "split_for"]

# Per-token tensors sliced like the tokens (besides tokens, position_ids, labels and loss_mask).
PER_TOKEN_KEYS = ("distill_ids", "distill_logits", "distill_kappa", "distill_lse")


@dataclass
class ContextParallelVisibility:
    """What attention needs under CP for one micro-batch: the split, this rank, its peers, the whole
    micro-batch's ``[B, T]`` intervals and positions, and the attention byte counters."""

    split: SequenceSplit
    rank: int
    peers: Peers
    start: torch.Tensor
    limit: torch.Tensor
    position_ids: torch.Tensor
    stats: CommStats = field(default_factory=CommStats)
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def local_index(self) -> torch.Tensor:
        """Global positions of this rank's tokens (increasing)."""
        return self.split.token_index(self.rank).to(self.start.device)

    def plan(self, window: int | None) -> RankPlan:
        if window not in self._plans:
            self._plans[window] = build_rank_plan(self.split, self.rank, self.start, self.limit, self.position_ids,
                                                  window=window)
        return self._plans[window]

    def attend(self, q, k, v, *, backend: str, zreg_coeff: float = 0.0, window: int | None = None,
               block: int | None = None, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Context-parallel attention of this rank's ``q`` over the sequence: ``(out, lse fp32)``.
        ``dropout_p > 0``: attention dropout with a mask of global positions (:class:`PositionalDropout`, its
        seed drawn from the current generator stream, which the CP ranks share)."""
        dropout = PositionalDropout.draw(dropout_p, q.device) if dropout_p > 0 else None
        return context_parallel_attention(q, k, v, self.plan(window), self.peers, self.stats, backend=backend,
                                          window=window, zreg_coeff=zreg_coeff, block=block, dropout=dropout)


def split_for(batch: dict, cp_size: int) -> SequenceSplit:
    """The micro-batch's split: zig-zag without intervals (plain causal), balanced by visible work with."""
    seq = batch["tokens"].shape[1]
    if seq % (2 * cp_size) != 0:
        raise ValueError(f"the sequence length {seq} must be divisible by 2 x context-parallel-size = {2 * cp_size}")
    if "visibility_start" not in batch:
        return zigzag_split(seq, cp_size)
    return balanced_split(batch["visibility_start"], batch["visibility_limit"], cp_size)


def _tree_slots(batch: dict, split: SequenceSplit, rank: int) -> dict[str, torch.Tensor]:
    """The loss slots whose predicting hidden state lives on ``rank`` (rows padded with masked slots)."""
    lp = batch["label_positions"].long()
    device = lp.device
    own = split.owner_of_token.to(device)[lp] == rank
    rows, cols = torch.nonzero(own, as_tuple=True)
    per_row = torch.bincount(rows, minlength=lp.shape[0])
    slot = torch.arange(rows.numel(), device=device) - (per_row.cumsum(0) - per_row)[rows]
    width = max(int(per_row.max()) if rows.numel() else 0, 1)
    out = {}
    for key, local_value in (("labels", batch["labels"]), ("loss_mask", batch["loss_mask"]),
                             ("label_positions", split.local_position.to(device)[lp])):
        t = torch.zeros(lp.shape[0], width, dtype=local_value.dtype, device=device)
        t[rows, slot] = local_value[rows, cols]
        out[key] = t
    return out


def shard_batch(batch: dict, rank: int, cp_size: int, peers: Peers) -> dict:
    """This CP rank's share of a whole micro-batch (module docstring); the input is not modified."""
    split = split_for(batch, cp_size)
    tokens = batch["tokens"]
    bsz, seq = tokens.shape
    device = tokens.device
    idx = split.token_index(rank).to(device)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, device=device).expand(bsz, seq)
    if "visibility_start" in batch:
        start, limit = batch["visibility_start"], batch["visibility_limit"]
    else:  # plain causal: key j is visible to every later query
        start = torch.arange(seq, device=device).expand(bsz, seq)
        limit = torch.full_like(start, seq)
    local = {"tokens": tokens[:, idx], "position_ids": pos[:, idx]}
    if "label_positions" in batch:
        local.update(_tree_slots(batch, split, rank))
    else:
        for key in ("labels", "loss_mask"):
            if key in batch:
                local[key] = batch[key][:, idx]
    for key in PER_TOKEN_KEYS:
        if key in batch:
            local[key] = batch[key][:, idx]
    for key, value in batch.items():  # per-sample values (e.g. distill_index) travel unchanged
        if key in local or key in ("visibility_start", "visibility_limit", "labels", "loss_mask"):
            continue
        if value.dim() >= 2 and value.shape[1] == seq:
            raise ValueError(f"context parallelism: the batch holds a per-token tensor {key!r} that it cannot split")
        local[key] = value
    if "loss_mask" in batch:
        local["loss_normalizer"] = batch["loss_mask"].float().sum().clamp(min=1.0) / cp_size
    local["visibility"] = ContextParallelVisibility(split, rank, peers, start, limit, pos)
    return local


def get_batch_on_this_cp_rank(batch: dict) -> dict:
    """Megatron-LM's name: this rank's share of ``batch`` under ``parallel_state``'s CP group (the batch
    itself when CP is 1)."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return batch
    peers = Peers(ps.get_context_parallel_group(), tuple(ps.get_context_parallel_global_ranks()))
    return shard_batch(batch, ps.get_context_parallel_rank(), cp, peers)

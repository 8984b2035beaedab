"""Documents of a packed row, as the visibility intervals define them, for the per-sequence aux loss.

Token j starts a new document when no earlier key is visible to it or to any later query: the running maximum
of ``limit`` over the keys before j is at most j. Causal packed documents ``(j, doc_end)`` split at their ends;
a tree row (DFS preorder, ``(j, subtree_end)``) stays one document per tree (its root's key is visible to the
whole tree); a row without resets is one document; each padding token ``(j, j + 1)`` is a document of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Documents:
    """Per token (megatron's ``[s, b]`` order, this rank's tokens): its document's global index ``key``
    (``row * seq + document``); per global index: ``lengths`` (tokens; 0 where unused) and their ``count``."""

    key: torch.Tensor
    lengths: torch.Tensor
    count: int


def document_index(limit: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` key-side visibility limits -> each token's document number in its row (0, 1, ...)."""
    before = torch.cummax(limit, dim=1).values[:, :-1]
    positions = torch.arange(1, limit.shape[1], device=limit.device)
    starts = torch.cat([torch.zeros_like(limit[:, :1]), (before <= positions).long()], dim=1)
    return torch.cumsum(starts, dim=1)


def documents(limit: torch.Tensor, local: slice) -> Documents:
    """The documents of ``[b, s]`` visibility limits, keyed for the tokens ``local`` of the sequence (this
    rank's slice under sequence parallelism), flattened sequence-major as the router sees them."""
    rows, seq = limit.shape
    key = document_index(limit) + torch.arange(rows, device=limit.device).unsqueeze(1) * seq
    lengths = torch.bincount(key.reshape(-1), minlength=rows * seq)
    return Documents(key[:, local].transpose(0, 1).reshape(-1), lengths, int((lengths > 0).sum()))

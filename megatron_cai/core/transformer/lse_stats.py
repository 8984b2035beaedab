"""An explicit collector of attention log-sum-exp statistics (for logging Attention Z-Reg's effect).

The training loop creates one :class:`LseStatsCollector`, hands it to the model's constructor
(``GPTModel(..., lse_stats=collector)``), which passes it down to every ``SelfAttention``. Each
attention call on the interval path records ``[mean, max]`` of its finite lse rows under its global
layer number; the loop calls :meth:`reset` at the start of a step and :meth:`per_layer` when it logs.
Nothing else is written into model modules: the collector is the one channel, and it is explicit.
"""
from __future__ import annotations

import torch


class LseStatsCollector:
    """Latest ``[lse mean, lse max]`` per global layer number (device tensors; no host sync to record)."""

    def __init__(self) -> None:
        self._stats: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        self._stats.clear()

    @torch.no_grad()
    def record(self, layer_number: int, lse: torch.Tensor) -> None:
        """Store ``[mean, max]`` over the rows of ``lse`` that are finite (rows that see some key)."""
        finite = torch.isfinite(lse)
        mean = torch.where(finite, lse, 0.0).sum() / finite.sum().clamp_min(1)
        self._stats[layer_number] = torch.stack([mean, torch.where(finite, lse, float("-inf")).amax()]).float()

    def per_layer(self) -> dict[int, torch.Tensor]:
        """``{layer_number: tensor([mean, max])}`` of the layers recorded since the last reset."""
        return dict(self._stats)

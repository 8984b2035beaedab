"""An explicit collector of attention log-sum-exp statistics (for logging Attention Z-Reg's effect).

The training loop creates one :class:`LseStatsCollector`, hands it to the model's constructor
(``GPTModel(..., lse_stats=collector)``), which passes it down to every ``SelfAttention``. Each
attention takes its layer's :meth:`slot` once, at construction, and every call on the interval path
records ``[mean, max]`` of its finite lse rows there; the loop calls :meth:`reset` at the start of a step
and :meth:`per_layer` when it logs. Nothing else is written into model modules: the collector is the one
channel, and it is explicit. (A slot object rather than the layer number as a key at record time: a
compiled layer (``--compile``) would otherwise specialise on its number and compile once per layer.)
"""
from __future__ import annotations

import torch


class LseSlot:
    """One layer's latest ``[lse mean, lse max]`` (a device tensor; no host sync to record)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    @torch.no_grad()
    def record(self, lse: torch.Tensor) -> None:
        """Store ``[mean, max]`` over the rows of ``lse`` that are finite (rows that see some key)."""
        finite = torch.isfinite(lse)
        mean = torch.where(finite, lse, 0.0).sum() / finite.sum().clamp_min(1)
        self.value = torch.stack([mean, torch.where(finite, lse, float("-inf")).amax()]).float()


class LseStatsCollector:
    """Latest ``[lse mean, lse max]`` per global layer number, one :class:`LseSlot` per layer."""

    def __init__(self) -> None:
        self._slots: dict[int, LseSlot] = {}

    def slot(self, layer_number: int) -> LseSlot:
        """The slot where layer ``layer_number`` records (one per layer number)."""
        return self._slots.setdefault(layer_number, LseSlot())

    def reset(self) -> None:
        for s in self._slots.values():
            s.value = None

    def per_layer(self) -> dict[int, torch.Tensor]:
        """``{layer_number: tensor([mean, max])}`` of the layers recorded since the last reset."""
        return {n: s.value for n, s in sorted(self._slots.items()) if s.value is not None}

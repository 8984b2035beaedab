"""RNG streams that keep dropout correct under tensor parallelism.

The default generator is seeded identically on all TP ranks of a stage, so dropout on replicated
activations matches across ranks. Dropout on TP-split activations (attention probabilities of this
rank's heads, sequence-parallel hidden states) runs inside ``get_rng_tracker().fork()``, a stream seeded
differently per TP rank (seed + 2718 + tp_rank, as in Megatron).
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from .. import device as device_mod

_MODEL_PARALLEL_OFFSET = 2718


class RNGStatesTracker:
    """Named generator states that can be swapped in around a region (``fork``)."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.device = torch.device("cpu")

    def reset(self, device: torch.device) -> None:
        self.states = {}
        self.device = device

    def add(self, name: str, seed: int) -> None:
        saved = device_mod.device_rng_state(self.device)
        device_mod.seed_device(self.device, seed)
        self.states[name] = device_mod.device_rng_state(self.device)
        device_mod.set_device_rng_state(self.device, saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states:
            yield
            return
        saved = device_mod.device_rng_state(self.device)
        device_mod.set_device_rng_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = device_mod.device_rng_state(self.device)
            device_mod.set_device_rng_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int, tp_rank: int, pp_rank: int, device: torch.device) -> None:
    """Seed the default stream (same over TP, offset by PP stage) and the TP-split stream."""
    stage_seed = seed + 100 * pp_rank
    device_mod.manual_seed(stage_seed)
    _TRACKER.reset(device)
    _TRACKER.add("model-parallel-rng", stage_seed + _MODEL_PARALLEL_OFFSET + tp_rank)


def _recompute_context_fn():
    """``torch.utils.checkpoint``'s ``context_fn``: the recomputation runs with the tracker's streams as they were
    at the original forward."""
    states = _TRACKER.get_states()

    @contextlib.contextmanager
    def recompute():
        current = _TRACKER.get_states()
        _TRACKER.set_states(states)
        try:
            yield
        finally:
            _TRACKER.set_states(current)

    return contextlib.nullcontext(), recompute()


def checkpoint(fn, *args):
    """``torch.utils.checkpoint`` (non-reentrant) whose recomputation draws the same dropout masks in ``fork()``
    regions (attention probabilities, sequence-parallel hidden states): checkpoint restores only the default
    generator, so the tracker's streams are restored here, as Megatron's own checkpoint function restores its
    tracker. Inside a compiled region the compiler's own RNG handling applies (it takes no such context)."""
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=_recompute_context_fn)

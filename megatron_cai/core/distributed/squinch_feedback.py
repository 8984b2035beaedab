"""Squinch's error-feedback state, one class for the DDP reducer, FSDP2's reduce-scatter and HSDP.

A Squinch reduction carries two things from one step to the next:

- **residuals**: what each encode cut off (fp32, in the units of the gradients it was cut from), added
  to the next encode of the same rows. One per named set of rows: the DDP reducer's ``b<i>`` (bucket
  i's all-to-all rows) and ``o<i>`` (the owner's re-encode of its shard), FSDP2's ``rows`` (one
  ``fully_shard`` unit's reduce-scatter rows), HSDP's ``rows`` and ``owner`` (the cross-node
  all-reduce).
- **the stochastic-rounding generator** (``--squinch-stochastic-rounding``), seeded per reducer.

Device rule: the state lives on the device of the gradients it is applied to. :meth:`residual` and
:meth:`generator` hand it out on the device they are asked for, moving there what a checkpoint restored
(on the CPU) or an earlier call left elsewhere; once :meth:`attach` has named the gradients' device
(the DDP wrapper and the FSDP2 chunk do, at construction), state restored before or after is placed
there at once. A generator that changes device keeps its state when the new device's generator takes it
(same device type). A state of another generator kind (a checkpoint written on CUDA, whose Philox state is
16 bytes, resumed on the CPU, whose Mersenne Twister state is 5056 bytes, or the reverse) cannot continue
its stream there: the generator is reseeded from that state's bytes (deterministic, so a resume is
reproducible, and not a replay of the seed's stream), counted in ``reseeded`` and logged.

The reducer calls :meth:`reset` when the step is skipped (a non-finite encode leaves NaN/Inf in its
residual) and :meth:`rescale` when the ``--fp16`` loss scale changes (the residuals are in loss-scaled
units). ``state_dict()`` is ``{"residuals": {name: cpu tensor}, "generator": state}`` (the generator
only when there is one); :meth:`load_state_dict` also reads the FSDP2 hooks' earlier layout
(``{"residual": tensor | None, "residuals": {...}}``, the single ``residual`` being today's ``rows``).
"""
from __future__ import annotations

import hashlib
import logging

import torch

log = logging.getLogger(__name__)

ROWS = "rows"  # FSDP2 / HSDP: the residual of the all-to-all rows (the DDP reducer names them per bucket)


class SquinchFeedback:
    """Error-feedback residuals and the stochastic-rounding generator of one Squinch reducer."""

    def __init__(self, *, error_feedback: bool = True, stochastic: bool = False, seed: int = 0) -> None:
        self.error_feedback, self.stochastic, self.seed = error_feedback, stochastic, seed
        self.residuals: dict[str, torch.Tensor] = {}
        self._generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None  # restored (or moved) before a device was known
        self.device: torch.device | None = None
        self.reseeded = 0  # generator states of another device type, reseeded instead of continued

    def attach(self, device: torch.device | str) -> None:
        """The gradients' device: what is held, and what is restored later, goes there now."""
        self.device = torch.device(device)
        self._place()

    def residual(self, key: str, numel: int, device: torch.device) -> torch.Tensor | None:
        """The residual of the rows named ``key`` (``numel`` fp32 elements) on ``device``; None without
        error feedback. A residual of another length (a new layout) starts again from zeros."""
        if not self.error_feedback:
            return None
        r = self.residuals.get(key)
        if r is None or r.numel() != numel:
            r = self.residuals[key] = torch.zeros(numel, dtype=torch.float32, device=device)
        elif r.device != torch.device(device):
            r = self.residuals[key] = r.to(device)
        return r

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The stochastic-rounding generator on ``device`` (None with round-to-nearest)."""
        if not self.stochastic:
            return None
        device = torch.device(device)
        if self._generator is not None and self._generator.device != device:
            self._generator_state, self._generator = self._generator.get_state(), None
        if self._generator is None:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
            if self._generator_state is not None:
                self._continue_stream(self._generator, self._generator_state)
                self._generator_state = None
        return self._generator

    def _continue_stream(self, generator: torch.Generator, state: torch.Tensor) -> None:
        """Set ``state`` on ``generator`` when it is of that generator's kind, else reseed from its bytes."""
        if state.numel() == generator.get_state().numel():
            generator.set_state(state)
            return
        seed = int.from_bytes(hashlib.sha256(state.cpu().numpy().tobytes()).digest()[:8], "little") >> 1
        generator.manual_seed(seed)
        self.reseeded += 1
        log.warning("squinch: a stochastic-rounding generator state of %d bytes cannot continue on %s (whose "
                    "generator state is %d bytes): reseeded from it", state.numel(), generator.device,
                    generator.get_state().numel())

    def _place(self) -> None:
        if self.device is None:
            return
        for k, v in self.residuals.items():
            if v.device != self.device:
                self.residuals[k] = v.to(self.device)
        if self.stochastic and (self._generator is not None or self._generator_state is not None):
            self.generator(self.device)

    # ------------------------------------------------------------------------------------ updates
    def reset(self) -> None:
        """A skipped step discards its gradients, including what error feedback carried."""
        for r in self.residuals.values():
            r.zero_()

    def rescale(self, factor: float) -> None:
        """The loss scale changed by ``factor`` (--fp16): the next step's gradients are ``factor`` x
        larger, so the residuals carried into it are scaled alike (else growth would halve their weight
        and backoff double it)."""
        for r in self.residuals.values():
            r.mul_(factor)

    # -------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        state: dict = {"residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()}}
        if self._generator is not None:
            state["generator"] = self._generator.get_state()
        elif self._generator_state is not None:
            state["generator"] = self._generator_state.clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        residuals = dict(state.get("residuals") or {})
        if state.get("residual") is not None:  # the FSDP2 hooks' earlier layout
            residuals[ROWS] = state["residual"]
        self.residuals = {k: v.detach().clone() for k, v in residuals.items()}
        if "generator" in state:
            self._generator_state, self._generator = state["generator"].clone(), None
        self._place()


class FeedbackReducer:
    """The ``contracts.GradReducer`` members of a Squinch reducer: its :class:`SquinchFeedback` answers them."""

    carries_feedback = True
    feedback: SquinchFeedback

    def attach(self, device: torch.device | str) -> None:
        self.feedback.attach(device)

    def step_skipped(self) -> None:
        self.feedback.reset()

    def rescale_feedback(self, factor: float) -> None:
        self.feedback.rescale(factor)

    def state_dict(self) -> dict:
        return self.feedback.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state)

"""Loss scaling for ``--fp16`` training, with Megatron-LM's rules and defaults.

The loss is multiplied by ``scale`` before backward; after the gradient sync the fp32 master gradients are
multiplied by ``inv_scale`` and checked. A non-finite gradient skips the optimizer step (the caller counts
it as a skipped iteration) and is reported to ``update``:

- ``ConstantGradScaler`` (``--loss-scale S``): the scale never changes.
- ``DynamicGradScaler``: each overflow decrements a hysteresis counter; once it reaches 0 the scale is
  multiplied by ``backoff_factor`` (not below ``min_scale``), on every further overflow too. After
  ``growth_interval`` clean steps in a row the scale is multiplied by ``growth_factor`` and the
  hysteresis counter is refilled (Megatron's ``DynamicGradScaler``; ``--initial-loss-scale`` 2**32,
  ``--min-loss-scale`` 1, ``--loss-scale-window`` 1000, ``--hysteresis`` 2).
"""
from __future__ import annotations

from dataclasses import dataclass


class ConstantGradScaler:
    """A fixed loss scale (``--loss-scale``)."""

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"--loss-scale must be positive, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """A constant scale ignores overflows (the step is still skipped by the caller)."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Halve after `hysteresis` overflows, double after `growth_interval` clean steps (Megatron's rules)."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2) -> None:
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale {min_scale} must be positive and at most "
                             f"--initial-loss-scale {initial_scale}")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("growth_factor must exceed 1 and backoff_factor lie in (0, 1)")
        if growth_interval < 1:
            raise ValueError(f"--loss-scale-window must be at least 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"--hysteresis must be at least 1, got {hysteresis}")
        super().__init__(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = float(min_scale), growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


@dataclass(frozen=True)
class LossScaleConfig:
    """The ``--fp16`` loss-scaling flags (Megatron's names and defaults)."""

    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


def build_grad_scaler(cfg: LossScaleConfig) -> ConstantGradScaler:
    """A constant scaler with ``--loss-scale``, else Megatron's dynamic scaler (growth 2, backoff 0.5)."""
    if cfg.loss_scale is not None:
        return ConstantGradScaler(cfg.loss_scale)
    return DynamicGradScaler(cfg.initial_loss_scale, cfg.min_loss_scale, growth_factor=2.0, backoff_factor=0.5,
                             growth_interval=cfg.loss_scale_window, hysteresis=cfg.hysteresis)

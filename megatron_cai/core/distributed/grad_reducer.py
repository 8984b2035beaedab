"""The gradient-reducer interface (its own module so every reducer can subclass it without import
circles: ``reducers.build_reducer`` imports the implementations, they import only this)."""
from __future__ import annotations

from .grad_buffer import Bucket


class CompletedHandle:
    def wait(self) -> None:
        return None


class WorkHandle:
    def __init__(self, work) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class GradReducer:
    shards = False
    holds_squinch_state = False  # Squinch error-feedback residuals that checkpoints carry

    def __init__(self, dp_group, dp_size: int) -> None:
        self.group, self.dp_size = dp_group, dp_size
        self.bytes_sent = 0

    def reduce(self, bucket: Bucket):  # pragma: no cover - interface
        raise NotImplementedError

    def attach(self, device) -> None:
        """Called by DistributedDataParallel with the device of the gradient buckets."""
        return None

    def step_skipped(self) -> None:
        """Called when the optimizer step was skipped (non-finite gradients somewhere)."""
        return None

    def rescale_feedback(self, factor: float) -> None:
        """The loss scale changed by ``factor`` (--fp16): carried state in gradient units follows it."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None

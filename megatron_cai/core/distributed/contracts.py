"""The written contracts of data parallelism: what the trainer, the schedules and the checkpoint code may
call on a gradient reducer and on a wrapped model chunk, whichever implementation is behind it.

- :class:`GradReducer`: the state and counters of a run's gradient reduction, as the trainer and the
  checkpoint code see them. Implemented by the DDP bucket reducers (``reducers.AllReduceReducer``,
  ``reducers.ReduceScatterReducer``, ``squinch_reducer.SquinchReducer``), by FSDP2's reduce-scatter
  hooks (``squinch_fsdp.CountingReduceScatter`` / ``SquinchReduceScatter``, one per ``fully_shard``
  unit) and by ``fsdp.UnitReducers``, which presents one chunk's hooks as one reducer.
- :class:`BucketReducer`: a :class:`GradReducer` that DDP hands contiguous gradient buckets to.
- :class:`ModelChunk`: one model chunk (a ``GPTModel``) wrapped for data parallelism,
  ``ddp.DistributedDataParallel`` or ``fsdp.FullyShardedChunk``.

Nothing outside these implementations asks an object what it is (no ``getattr`` / ``hasattr``); what
differs between them is a member of the contract (``carries_feedback``, ``data_parallel_kind``).
"""
from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from .comm_timing import PhaseTimers
from .grad_buffer import Bucket

NO_TIMERS = PhaseTimers(0)  # records nothing: the timers of reducers without phases


@runtime_checkable
class GradReducer(Protocol):
    """How one chunk's gradients are reduced over data parallelism, seen from the trainer."""

    bytes_sent: int             # gradient bytes this rank put on the wire (the collective's algorithmic volume)
    inter_node_bytes_sent: int  # of which across nodes (all of them without a hierarchical mode)
    carries_feedback: bool      # holds Squinch error-feedback state, which checkpoints carry
    timers: PhaseTimers         # per-phase timers (--timing-log-level); NO_TIMERS when it has no phases

    def attach(self, device: torch.device) -> None:
        """The device of the gradients: state the reducer carries lives there."""

    def step_skipped(self) -> None:
        """The optimizer step was skipped (non-finite gradients somewhere): drop carried state."""

    def rescale_feedback(self, factor: float) -> None:
        """The loss scale changed by ``factor`` (--fp16): carried state in gradient units follows it."""

    def state_dict(self) -> dict:
        """What a checkpoint carries (CPU tensors); ``{}`` when nothing."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (onto the attached device)."""


class ReductionHandle(Protocol):
    def wait(self) -> None:
        """Block until the bucket holds the DP-mean gradient (the whole bucket, or this rank's shard)."""


@runtime_checkable
class BucketReducer(GradReducer, Protocol):
    """A reducer of DDP's contiguous gradient buckets."""

    shards: bool  # only this rank's shard of a bucket is valid afterwards (distributed optimizer)

    def reduce(self, bucket: Bucket) -> ReductionHandle:
        """Start reducing ``bucket`` (asynchronously where possible)."""


class StatelessReducer:
    """The :class:`GradReducer` members of a reducer that carries no state between steps."""

    carries_feedback = False
    timers = NO_TIMERS

    def attach(self, device: torch.device) -> None:
        return None

    def step_skipped(self) -> None:
        return None

    def rescale_feedback(self, factor: float) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


@runtime_checkable
class ModelChunk(Protocol):
    """One model chunk wrapped for data parallelism, as the schedules, the trainer and checkpoints use it."""

    module: nn.Module                              # the wrapped GPTModel (parameters named as in checkpoints)
    reducer: GradReducer                           # its gradient reduction's counters and state
    data_parallel_kind: Literal["ddp", "fsdp2"]    # the checkpoint layout of its parameters

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def set_is_last_microbatch(self, last: bool) -> None:
        """Only the last micro-batch's backward reduces gradients; earlier ones accumulate."""

    def zero_grad_buffer(self) -> None:
        """Clear the gradients before an iteration's first micro-batch."""

    def finish_grad_sync(self) -> None:
        """After the last backward: complete the DP reduction and the cross-stage / cross-TP sums."""

    @property
    def grad_comm_bytes(self) -> int:
        """``reducer.bytes_sent``: what the ``grad comm bytes`` log column sums over chunks."""

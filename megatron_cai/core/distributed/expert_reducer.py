"""MoE: one chunk's dense and expert gradient reducers, seen as one ``contracts.BucketReducer``.

Expert buckets (``Bucket.expert``) go to the reducer over the expert-data-parallel group, pre-scaled by
expert-DP / (DP x CP): each expert's gradient already sums what every EP rank's tokens contributed, and the result
must be the same DP x CP mean as the dense gradients'. Dense buckets go to the reducer over DP x CP. Bytes, skipped
steps, fp16 rescaling and checkpointed state (Squinch's error feedback) cover both.
"""
from __future__ import annotations

import torch

from .contracts import BucketReducer
from .grad_buffer import Bucket


class DenseAndExpertReducer:
    def __init__(self, dense: BucketReducer, expert: BucketReducer, expert_scale: float) -> None:
        self.dense, self.expert, self.expert_scale = dense, expert, expert_scale
        self.shards = dense.shards
        self.carries_feedback = dense.carries_feedback or expert.carries_feedback
        self.timers = dense.timers

    def reduce(self, bucket: Bucket):
        if not bucket.expert:
            return self.dense.reduce(bucket)
        if self.expert_scale != 1.0:
            bucket.grad_data.mul_(self.expert_scale)
        return self.expert.reduce(bucket)

    @property
    def bytes_sent(self) -> int:
        return self.dense.bytes_sent + self.expert.bytes_sent

    @property
    def inter_node_bytes_sent(self) -> int:
        return self.dense.inter_node_bytes_sent + self.expert.inter_node_bytes_sent

    def attach(self, device: torch.device) -> None:
        self.dense.attach(device)
        self.expert.attach(device)

    def step_skipped(self) -> None:
        self.dense.step_skipped()
        self.expert.step_skipped()

    def rescale_feedback(self, factor: float) -> None:
        self.dense.rescale_feedback(factor)
        self.expert.rescale_feedback(factor)

    def state_dict(self) -> dict:
        return {"dense": self.dense.state_dict(), "expert": self.expert.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"dense", "expert"}:
            raise KeyError("the checkpoint's gradient-reducer state has no expert part (saved without MoE?)")
        self.dense.load_state_dict(state["dense"])
        self.expert.load_state_dict(state["expert"])

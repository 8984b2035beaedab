"""Resumed Squinch state lands on the device of the gradient buckets (issue 14, item 2).

The buckets live on the ``meta`` device here, a stand-in for CUDA: before the fix the residuals were
restored onto the CPU (the device was taken from residuals that were still empty at load time) and the
stochastic generator was created on the CPU, so the first reduce after a resume on a GPU failed.
"""
import pytest
import torch
from torch import nn

from megatron_cai.core.distributed.config import DDPConfig
from megatron_cai.core.distributed.ddp import DistributedDataParallel
from megatron_cai.core.distributed.squinch_reducer import SquinchReducer


class _RecordingGenerator:
    """Stands in for torch.Generator (which the meta device does not support); records its device."""

    created: list = []

    def __init__(self, device=None) -> None:
        self.device = torch.device(device if device is not None else "cpu")
        self.state = None
        _RecordingGenerator.created.append(self.device)

    def manual_seed(self, seed):
        return self

    def set_state(self, state):
        self.state = state

    def get_state(self):
        return self.state


def _saved_state() -> dict:
    return {"residuals": {"b0": torch.arange(256, dtype=torch.float32), "o0": torch.ones(128)},
            "generator": torch.Generator().manual_seed(7).get_state()}


def _model_on(device: str) -> DistributedDataParallel:
    reducer = SquinchReducer(None, 2, error_feedback=True, stochastic=True)
    return DistributedDataParallel(nn.Linear(16, 16, device=device), reducer, DDPConfig(reducer="squinch"),
                                   device=torch.device(device))


@pytest.mark.parametrize("load_first", [False, True], ids=["attach_then_load", "load_then_attach"])
def test_resumed_residuals_and_generator_land_on_bucket_device(monkeypatch, load_first):
    saved = _saved_state()
    monkeypatch.setattr(torch, "Generator", _RecordingGenerator)
    _RecordingGenerator.created = []
    if load_first:
        reducer = SquinchReducer(None, 2, error_feedback=True, stochastic=True)
        reducer.load_state_dict(saved)
        ddp = DistributedDataParallel(nn.Linear(16, 16, device="meta"), reducer, DDPConfig(reducer="squinch"),
                                      device=torch.device("meta"))
    else:
        ddp = _model_on("meta")
        ddp.reducer.load_state_dict(saved)
    bucket_device = ddp.buffer.grad_data.device
    assert bucket_device.type == "meta"
    assert {k: v.device.type for k, v in ddp.reducer.residuals.items()} == {"b0": "meta", "o0": "meta"}
    assert _RecordingGenerator.created and _RecordingGenerator.created[-1] == bucket_device
    assert ddp.reducer.generator.device == bucket_device


def test_resumed_state_round_trips_on_cpu():
    """On the CPU the restored residuals hold the saved values and the generator its saved state."""
    ddp = _model_on("cpu")
    saved = _saved_state()
    ddp.reducer.load_state_dict(saved)
    assert torch.equal(ddp.reducer.residuals["b0"], saved["residuals"]["b0"])
    again = ddp.reducer.state_dict()
    assert torch.equal(again["generator"], saved["generator"])
    assert torch.equal(again["residuals"]["o0"], saved["residuals"]["o0"])

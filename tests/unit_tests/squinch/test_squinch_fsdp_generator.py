"""FSDP2 + Squinch resume: the stochastic-rounding generator is restored onto the gradients' device.

Before the fix, ``SquinchReduceScatter.load_state_dict`` rebuilt the generator as a CPU
``torch.Generator()``: a CUDA generator's state (16 bytes: seed and offset) raised there, and on a GPU
the first stochastic encode after a resume was handed a CPU generator. Like the residuals (and like
``SquinchReducer``), the generator must be created lazily on the device of the gradients it rounds.
The ``meta`` device stands in for CUDA here.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_cai.core.distributed import squinch_fsdp

# A CUDA generator's state: 8 bytes of seed and 8 bytes of Philox offset (a CPU state is 5056 bytes).
CUDA_SHAPED_STATE = torch.arange(16, dtype=torch.uint8)


class _RecordingGenerator:
    """Stands in for torch.Generator (the meta device has none): records its device and state."""

    def __init__(self, device=None) -> None:
        self.device = torch.device(device if device is not None else "cpu")
        self.state = None

    def manual_seed(self, seed):
        return self

    def set_state(self, state):
        self.state = state.clone()

    def get_state(self):
        return self.state


class _Group:
    def __init__(self, world: int) -> None:
        self.world = world

    def size(self) -> int:
        return self.world


def test_cuda_shaped_generator_state_loads_and_round_trips_on_cpu() -> None:
    hook = squinch_fsdp.SquinchReduceScatter(stochastic=True, seed=3)
    hook.load_state_dict({"residual": torch.zeros(16), "generator": CUDA_SHAPED_STATE})  # raised before the fix
    assert torch.equal(hook.state_dict()["generator"], CUDA_SHAPED_STATE)  # kept until first use


def test_first_encode_after_resume_gets_a_generator_on_the_gradients_device(monkeypatch) -> None:
    monkeypatch.setattr(torch, "Generator", _RecordingGenerator)
    seen = []

    def fake_reduce_scatter(output, input, group, world, residual, *, stochastic, generator, backend):
        seen.append((generator, residual.device if residual is not None else None))
        return 0

    monkeypatch.setattr(squinch_fsdp, "compressed_reduce_scatter", fake_reduce_scatter)
    hook = squinch_fsdp.SquinchReduceScatter(stochastic=True, seed=3)
    hook.load_state_dict({"residual": torch.ones(16), "generator": CUDA_SHAPED_STATE})
    grads = torch.empty(16, device="meta")
    hook(torch.empty(8, device="meta"), grads, _Group(2), dist.ReduceOp.SUM)
    generator, residual_device = seen[0]
    assert residual_device == grads.device
    assert generator.device == grads.device
    assert torch.equal(generator.state, CUDA_SHAPED_STATE)
    assert torch.equal(hook.generator.get_state(), CUDA_SHAPED_STATE)


@pytest.mark.parametrize("stochastic", [False, True])
def test_cpu_generator_state_round_trips_through_first_use(stochastic) -> None:
    """On the CPU the restored generator continues exactly where the saved one stopped."""
    saved = torch.Generator().manual_seed(11)
    torch.rand(5, generator=saved)
    hook = squinch_fsdp.SquinchReduceScatter(stochastic=stochastic, seed=3)
    hook.load_state_dict({"residual": None, "generator": saved.get_state()})
    gen = hook._gen(torch.device("cpu"))
    if not stochastic:
        assert gen is None
        return
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=saved))

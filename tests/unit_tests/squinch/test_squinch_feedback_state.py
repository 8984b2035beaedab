"""Squinch's error-feedback state (``core.distributed.squinch_feedback.SquinchFeedback``), as the DDP
reducer, FSDP2's reduce-scatter hook and HSDP's cross-node all-reduce hook use it.

The device rule is checked once, on the ``meta`` device (a stand-in for CUDA): residuals and the
stochastic-rounding generator restored from a checkpoint (CPU tensors) end on the device of the gradients
they are applied to, whether that device is named before the restore, after it, or only by the first
reduction. Before the shared class, FSDP2's hooks restored both on the CPU (issue 32), and the DDP
reducer once did the same (issue 14).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_cai.core.distributed import squinch_fsdp
from megatron_cai.core.distributed.config import DDPConfig
from megatron_cai.core.distributed.ddp import DistributedDataParallel
from megatron_cai.core.distributed.fsdp import UnitReducers
from megatron_cai.core.distributed.squinch_feedback import SquinchFeedback
from megatron_cai.core.distributed.squinch_fsdp import SquinchReduceScatter
from megatron_cai.core.distributed.squinch_reducer import SquinchReducer

META = torch.device("meta")


_STATE_BYTES = {"cpu": 5056}  # torch's: a CPU (Mersenne Twister) state is 5056 bytes, CUDA's (Philox) 16


class _RecordingGenerator:
    """Stands in for torch.Generator (which the meta device lacks): records its device and state, which
    has torch's size for the device type (meta stands in for CUDA) and, like torch's, refuses another."""

    def __init__(self, device=None) -> None:
        self.device = torch.device(device if device is not None else "cpu")
        self.manual_seed(0)

    def manual_seed(self, seed):
        self.state = torch.full((_STATE_BYTES.get(self.device.type, 16),), seed % 251, dtype=torch.uint8)
        return self

    def set_state(self, state):
        if state.numel() != self.state.numel():
            raise RuntimeError(f"expected a generator state of {self.state.numel()} bytes, got {state.numel()}")
        self.state = state.clone()

    def get_state(self):
        return self.state.clone()


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


# Each user of the state, and where it finds its residuals. HSDP: two nodes of one rank (the all-reduce hook
# sums across them), its rows residual 2 x 8 elements and the owner's 8. FSDP2: a reduce-scatter over 2 ranks
# of 8-element chunks. DDP: one 16-element bucket (b0) and its owner re-encode (o0).
_SAVED = {"ddp": {"b0": 16, "o0": 8}, "fsdp2": {"rows": 16}, "hsdp": {"rows": 16, "owner": 8}}


def _saved_state(kind: str) -> dict:
    return {"residuals": {k: torch.arange(n, dtype=torch.float32) + 1 for k, n in _SAVED[kind].items()},
            "generator": torch.arange(16, dtype=torch.uint8)}  # written on CUDA, resumed on CUDA (meta)


def _build(kind: str, monkeypatch):
    """(reducer, attach(device), reduce on `device`: what the first step after a resume does)."""
    if kind == "ddp":
        reducer = SquinchReducer(None, 2, error_feedback=True, stochastic=True)

        def attach(device):
            DistributedDataParallel(nn.Linear(4, 4, device=device), reducer, DDPConfig(reducer="squinch"),
                                    device=device)

        def reduce(device):  # the reducer's own encode of bucket 0's rows and of the owner's shard
            reducer._encode_rows(torch.zeros(16, device=device), 2, "b0")
            reducer._encode_rows(torch.zeros(8, device=device), 1, "o0")

        monkeypatch.setattr("megatron_cai.core.distributed.squinch_reducer.encode_rows", _record_encode)
        return reducer, attach, reduce
    if kind == "hsdp":
        monkeypatch.setattr(squinch_fsdp.dist, "get_world_size", lambda group=None: 2)
    hook = SquinchReduceScatter(stochastic=True, inter_group=object() if kind == "hsdp" else None)
    monkeypatch.setattr(squinch_fsdp, "compressed_reduce_scatter", _record_reduce_scatter)
    monkeypatch.setattr(squinch_fsdp, "compressed_all_reduce", _record_all_reduce)

    def attach(device):  # what FullyShardedChunk does with its units' hooks
        UnitReducers({"root": hook}).attach(device)

    def reduce(device):
        if kind == "hsdp":
            hook.all_reduce_hook(torch.zeros(16, device=device))
        else:
            hook(torch.zeros(8, device=device), torch.zeros(16, device=device), _Group(2),
                 torch.distributed.ReduceOp.SUM)

    return hook, attach, reduce


SEEN: list[tuple[str, object]] = []  # (what, residual tensor or generator) handed to the codec


def _record_encode(x, rows, residual, *, out=None, stochastic=False, generator=None, backend=None):
    SEEN.extend([("residual", residual), ("generator", generator)])
    return out


def _record_reduce_scatter(output, input, group, world, residual, *, stochastic=False, generator=None,
                           backend=None):
    SEEN.extend([("residual", residual), ("generator", generator)])
    return 0


def _record_all_reduce(x, group, world, residual, owner_residual, *, stochastic=False, generator=None,
                       backend=None):
    SEEN.extend([("residual", residual), ("residual", owner_residual), ("generator", generator)])
    return 0


@pytest.mark.parametrize("when", ["attach_then_load", "load_then_attach", "first_reduce"])
@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "hsdp"])
def test_resumed_state_lands_on_the_gradients_device(monkeypatch, kind, when):
    monkeypatch.setattr(torch, "Generator", _RecordingGenerator)
    reducer, attach, reduce = _build(kind, monkeypatch)
    saved = _saved_state(kind)
    if when == "attach_then_load":
        attach(META)
        reducer.load_state_dict(saved)
    elif when == "load_then_attach":
        reducer.load_state_dict(saved)
        attach(META)
    else:  # nothing names the device before the first reduction after the resume
        reducer.load_state_dict(saved)
    residuals = reducer.feedback.residuals
    if when != "first_reduce":  # a known device takes the restored state at once
        assert {k: v.device for k, v in residuals.items()} == dict.fromkeys(_SAVED[kind], META)
    SEEN.clear()
    reduce(META)
    assert {k: v.device for k, v in residuals.items()} == dict.fromkeys(_SAVED[kind], META)
    handed = [obj for what, obj in SEEN if what == "residual"]
    generators = [obj for what, obj in SEEN if what == "generator"]
    assert len(handed) == len(_SAVED[kind]) and all(r.device == META for r in handed)
    assert all(any(r is v for v in residuals.values()) for r in handed), "the held residuals, not copies"
    assert {r.numel() for r in handed} == set(_SAVED[kind].values())
    assert generators and all(g.device == META and torch.equal(g.state, saved["generator"]) for g in generators)


def test_a_generator_follows_the_gradients_to_their_device_with_its_stream(monkeypatch):
    monkeypatch.setattr(torch, "Generator", _RecordingGenerator)
    fb = SquinchFeedback(stochastic=True, seed=5)
    first = fb.generator(torch.device("cuda", 0))  # a descriptor only: the stand-in generator needs no GPU
    first.set_state(torch.arange(16, dtype=torch.uint8))  # as if it had drawn numbers
    moved = fb.generator(torch.device("cuda", 1))
    assert moved is not first and moved.device == torch.device("cuda", 1) and torch.equal(moved.state, first.state)
    assert torch.equal(fb.state_dict()["generator"], first.state) and fb.reseeded == 0


def test_a_generator_moving_to_another_device_type_is_reseeded_from_its_state(monkeypatch):
    """CPU to CUDA (meta): torch's CUDA generator refuses a CPU state; the stream restarts from a seed
    taken from that state (not the reducer's own seed, whose stream step 0 already used)."""
    monkeypatch.setattr(torch, "Generator", _RecordingGenerator)
    fb = SquinchFeedback(stochastic=True, seed=5)
    fb.generator(torch.device("cpu")).set_state(torch.arange(5056).remainder(256).to(torch.uint8))
    fb.attach(META)
    moved = fb.generator(META)
    assert moved.device == META and moved.state.numel() == 16 and fb.reseeded == 1
    assert not torch.equal(moved.state, _RecordingGenerator(META).manual_seed(5).state)


def _philox_state(seed: int, offset: int) -> torch.Tensor:
    """A CUDA generator's state as torch writes it: the seed and the Philox offset, 8 bytes each."""
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_checkpoint_written_on_cuda_resumes_on_the_cpu(kind, caplog):
    """A real CPU torch.Generator cannot take a CUDA (Philox) state: the resumed reducer reseeds from it,
    reproducibly, logs it and counts it, instead of raising at its first stochastic encode."""
    def resume():
        reducer = (SquinchReducer(None, 2, error_feedback=True, stochastic=True, seed=5) if kind == "ddp"
                   else SquinchReduceScatter(stochastic=True, seed=5))
        reducer.load_state_dict({"residuals": {}, "generator": _philox_state(5, 4096)})
        reducer.attach(torch.device("cpu"))
        return reducer.feedback
    with caplog.at_level("WARNING"):
        a, b = resume(), resume()
    assert a.reseeded == b.reseeded == 1 and "reseeded" in caplog.text
    draws = torch.rand(8, generator=a.generator(torch.device("cpu")))
    assert torch.equal(draws, torch.rand(8, generator=b.generator(torch.device("cpu"))))  # reproducible
    assert not torch.equal(draws, torch.rand(8, generator=torch.Generator().manual_seed(5)))  # not a replay
    assert a.state_dict()["generator"].numel() == 5056  # saved again as the CPU generator it now is


def _fill(fb: SquinchFeedback) -> None:
    fb.residual("b0", 6, torch.device("cpu")).copy_(torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0, -6.0]))
    fb.residual("o0", 2, torch.device("cpu")).copy_(torch.tensor([0.5, -0.25]))
    torch.rand(3, generator=fb.generator(torch.device("cpu")))  # advance the stream past its seed


def test_state_round_trips_and_the_generator_resumes_its_stream():
    a = SquinchFeedback(stochastic=True, seed=3)
    _fill(a)
    b = SquinchFeedback(stochastic=True, seed=99)
    b.load_state_dict(a.state_dict())
    assert b.residuals.keys() == {"b0", "o0"}
    assert all(torch.equal(a.residuals[k], b.residuals[k]) for k in a.residuals)
    cpu = torch.device("cpu")
    assert torch.equal(torch.rand(5, generator=a.generator(cpu)), torch.rand(5, generator=b.generator(cpu)))


def test_skip_zeroes_and_a_loss_scale_change_rescales_every_residual():
    fb = SquinchFeedback()
    _fill(fb)
    before = {k: v.clone() for k, v in fb.residuals.items()}
    fb.rescale(0.5)
    assert all(torch.equal(fb.residuals[k], before[k] * 0.5) for k in before)
    fb.reset()
    assert all(not v.any() for v in fb.residuals.values())


def test_a_residual_of_another_length_starts_from_zero_and_none_without_feedback():
    fb = SquinchFeedback()
    _fill(fb)
    assert not fb.residual("b0", 8, torch.device("cpu")).any()
    assert SquinchFeedback(error_feedback=False).residual("b0", 8, torch.device("cpu")) is None
    assert SquinchFeedback(stochastic=False).generator(torch.device("cpu")) is None


@pytest.mark.parametrize("old", [
    {"residual": torch.arange(16.0), "generator": torch.Generator().manual_seed(5).get_state()},  # flat FSDP2
    {"residual": None, "residuals": {"rows": torch.arange(16.0), "owner": torch.ones(8)}},  # HSDP
    {"residual": None},  # FSDP2 before its first reduction
], ids=["fsdp2", "hsdp", "fsdp2_empty"])
def test_checkpoints_of_the_earlier_fsdp2_hook_layout_still_load(old):
    """Until issue 32 FSDP2's hooks saved ``{"residual": rows | None, "residuals": {...}, "generator"}``."""
    hook = SquinchReduceScatter(stochastic=True)
    hook.load_state_dict(old)
    expected = dict(old.get("residuals", {}))
    if old["residual"] is not None:
        expected["rows"] = old["residual"]
    got = hook.state_dict()
    assert got["residuals"].keys() == expected.keys()
    assert all(torch.equal(got["residuals"][k], v) for k, v in expected.items())
    assert ("generator" in got) == ("generator" in old)
    if "generator" in old:
        assert torch.equal(got["generator"], old["generator"])

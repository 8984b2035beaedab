"""The step's one read-back (training/step_readback.py) in one process: the grad norm from the sum of squares,
the micro-batch mean of each loss, any non-finite loss value, the exit signal, all in one host read; and the
log's fp32 rounding of figures without a tensor (training._fp32) against torch's own fp32 rounding."""
import math

import pytest
import torch
from testlib.host_sync import HostSyncCounter

from megatron_cai.core import parallel_state as ps
from megatron_cai.training import step_readback
from megatron_cai.training.step_readback import Deadline, read_step
from megatron_cai.training.training import _fp32


@pytest.fixture(autouse=True)
def _single_process():
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()


def _read(norm_sq: float, losses: list[float], exit_signal: bool = False, counter: HostSyncCounter | None = None,
          time_up: bool = False):
    stats = [{"lm loss": torch.tensor(v), "z": torch.tensor(2 * v)} for v in losses]
    norm = torch.tensor(norm_sq, dtype=torch.float64)
    if counter is not None:
        counter.install()
    try:
        return read_step(norm, stats, exit_signal, torch.device("cpu"), time_up=time_up)
    finally:
        if counter is not None:
            counter.uninstall()


def test_one_read_gives_norm_losses_and_flags():
    counter = HostSyncCounter()
    r = _read(9.0, [2.0, 4.0, 7.0], counter=counter)
    assert counter.total() == 1, dict(counter.where)
    assert r.grad_norm == 3.0 and not r.nonfinite_loss and not r.exit_requested
    assert r.losses == pytest.approx({"lm loss": 13 / 3, "z": 26 / 3})


@pytest.mark.parametrize("losses,norm_sq,exit_signal", [([1.0, math.nan], 4.0, False), ([1.0, math.inf], 4.0, False),
                                                        ([1.0, 2.0], math.inf, False), ([1.0, 2.0], math.nan, True)])
def test_non_finite_values_and_the_exit_signal_are_reported(losses, norm_sq, exit_signal):
    r = _read(norm_sq, losses, exit_signal)
    assert r.nonfinite_loss == (not all(math.isfinite(v) for v in losses))
    assert math.isnan(r.grad_norm) == (not math.isfinite(norm_sq))
    assert r.exit_requested == exit_signal


@pytest.mark.parametrize("time_up", [False, True])
def test_the_deadline_vote_comes_back_in_the_same_read(time_up):
    counter = HostSyncCounter()
    r = _read(4.0, [1.0], counter=counter, time_up=time_up)
    assert counter.total() == 1 and r.time_up == time_up and not r.exit_requested and r.grad_norm == 2.0


def test_deadline_is_rank_zeros_monotonic_clock(monkeypatch):
    now = {"t": 1000.0}
    monkeypatch.setattr(step_readback.time, "monotonic", lambda: now["t"])
    monkeypatch.setattr(step_readback.time, "time", lambda: 1e12)  # the wall clock is never read
    d = Deadline(2.0)
    now["t"] += 120.0
    assert not d.passed()  # exactly 2 minutes: not past
    now["t"] += 0.5
    assert d.passed()
    assert not Deadline(None).passed() and not Deadline(0).passed()
    monkeypatch.setattr(step_readback.ps, "get_rank", lambda: 1)
    monkeypatch.setattr(step_readback.time, "monotonic", lambda: pytest.fail("rank 1 read a clock"))
    assert not d.passed()  # any other rank never votes


def test_fp32_rounding_matches_torch():
    for v in (0.1, 1 / 3, 1e-3 + 1e-12, 3.4e38, 3.5e38, 1e39, -1e39, 1e-46, 0.0, 12345.6789, math.inf):
        assert _fp32(v) == torch.tensor(v, dtype=torch.float32).item(), v
    assert _fp32(None) is None

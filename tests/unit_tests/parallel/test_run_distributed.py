"""megatron_cai.testing.distributed: ranks forked from the preloaded server behave as spawned ones did (the
test's current environment and output, atexit handlers), and a rank that dies before it runs is reported
with what it printed."""
from __future__ import annotations

import os

import pytest

from megatron_cai.testing.distributed import run_distributed


def _report(rank, world_size, path):
    import atexit

    atexit.register(lambda: open(f"{path}.{rank}", "w").write("atexit ran"))
    print(f"rank {rank} says hello", flush=True)
    return rank, world_size, os.environ.get("MCAI_TEST_MARK"), os.environ.get("MCAI_TEST_EXTRA")


def test_ranks_get_the_current_environment_output_and_atexit(tmp_path, monkeypatch, capfd):
    run_distributed(_report, 1, (str(tmp_path / "warm"),))  # the fork server runs from here on
    monkeypatch.setenv("MCAI_TEST_MARK", str(tmp_path))  # set after the server started
    got = run_distributed(_report, 2, (str(tmp_path / "exit"),), env={"MCAI_TEST_EXTRA": "x"})
    assert got == [(0, 2, str(tmp_path), "x"), (1, 2, str(tmp_path), "x")]
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out
    assert [(tmp_path / f"exit.{r}").read_text() for r in range(2)] == ["atexit ran"] * 2


def _explode():
    raise RuntimeError("unpickled in the rank: boom")


class _BoomOnArrival:
    """Pickles in the test; unpickling it in a rank (before the rank's function runs) raises."""

    def __reduce__(self):
        return _explode, ()


def _never(rank, world_size, boom):
    return "unreachable"


def test_a_rank_dying_before_it_runs_is_reported_with_its_output():
    with pytest.raises(AssertionError) as err:
        run_distributed(_never, 2, (_BoomOnArrival(),), timeout=120)
    assert "died with exit code" in str(err.value)
    assert "unpickled in the rank: boom" in str(err.value)

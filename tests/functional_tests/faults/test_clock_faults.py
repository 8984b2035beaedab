"""One clock for time-based exits: a +2 h clock step on one rank of DP = 2 with --exit-duration-in-mins.

Both ``time.time`` and ``time.monotonic`` of one process jump 2 h ahead before iteration 3 (clock_inject.py's
FAULT_CLOCK_STEP_*). Rank 0's monotonic clock alone decides, inside the step's one read-back: stepped on rank 1,
nothing happens (both ranks train to the end and save once); stepped on rank 0, both ranks save once at
iteration 3 and exit 0. Before, each rank read its own ``time.time()``: the stepped rank saved and left alone.
"""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from . import test_faults
from .test_faults import MODEL, launch_ranks, tracker

CLOCK_INJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clock_inject.py")

ITERS, STEP_AT = 6, 3


@pytest.mark.parametrize("stepped_rank, saved_at", [(1, ITERS), (0, STEP_AT)])
def test_clock_step_on_one_rank_saves_once_at_one_iteration(tmp_path, monkeypatch, stepped_rank, saved_at):
    monkeypatch.setattr(test_faults, "INJECT", CLOCK_INJECT)  # launch_ranks starts this script instead
    save = str(tmp_path / "ckpt")
    argv = ["--mock-data", "--vocab-size", "64", *MODEL, "--train-iters", str(ITERS), "--save", save,
            "--exit-duration-in-mins", "60"]
    procs = launch_ranks(argv, 2, env={"FAULT_CLOCK_STEP_AT": str(STEP_AT),
                                       "FAULT_CLOCK_STEP_RANK": str(stepped_rank)})
    try:
        with ThreadPoolExecutor(len(procs)) as pool:  # both ranks' pipes drained at once: no pipe-full stall
            outs = list(pool.map(lambda p: p.communicate(timeout=300), procs))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [(o or "")[-1500:] + (e or "")[-1500:] for o, e in (p.communicate() for p in procs)]
        pytest.fail("the ranks did not finish (a hang, or a rank left alone):\n" + "\n----\n".join(tails))
    text = "".join(o + e for o, e in outs)
    assert [p.returncode for p in procs] == [0, 0], text[-4000:]
    assert "FAULT: clock stepped +7200 s" in outs[stepped_rank][1]
    assert tracker(save) == saved_at, text[-3000:]
    assert sorted(os.listdir(save)) == [f"iter_{saved_at:07d}", "latest_checkpointed_iteration.txt"]
    assert outs[0][0].count("saved checkpoint at iteration") == 1, outs[0][0][-3000:]
    timed_out = f"exiting at iteration {STEP_AT} after 60.0 minutes (--exit-duration-in-mins, rank 0's clock)"
    assert (timed_out in outs[0][0]) == (stepped_rank == 0), outs[0][0][-3000:]
    assert f"iteration {saved_at:8d}/" in outs[1][0]  # the last rank logs every iteration
    for out, _ in outs:  # every rank ran exactly the same iterations
        assert f"iteration {saved_at + 1:8d}/" not in out

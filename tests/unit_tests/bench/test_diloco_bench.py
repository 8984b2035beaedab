"""bench/diloco.py's arithmetic on hand-made rows: which bytes the model's prediction sends over the link, and
the Acceptance section's ratios (the measured runs need root and take an hour; --quick runs in
test_bench_quick_modes)."""
from __future__ import annotations

import argparse
import os
import sys

import pytest
from testlib import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

from harness.scripts import load_module  # noqa: E402

B = load_module("bench/diloco.py")
OPTS = argparse.Namespace(inner_steps=25, fragments=5, overlap=4)
MB = 1_000_000


def _row(name: str, rate: str, seed: int = 1, **kw) -> dict:
    return {"name": name, "rate": rate, "seed": seed, "times_s": [0.1] * 200, "wall_s": 20.0, "wait_s": 0.0,
            "tokens": 409_600, "val_loss": 4.0, "crossing_bytes": 0, "counted_bytes": 0, **kw}


def test_dp_prediction_sends_the_bytes_that_crossed_the_link_not_the_ranks_counts():
    # --squinch-hierarchical: the ranks count their uncompressed traffic inside an island too (1 GB), the
    # link carried 25 MB: 12.5 MB each way at 10 Mbit/s = 1.25 MB/s is 10 s on top of the unshaped 20 s
    unshaped = _row("dp squinch", "unshaped", crossing_bytes=25 * MB, counted_bytes=1000 * MB)
    shaped = _row("dp squinch", "10", crossing_bytes=25 * MB, counted_bytes=1000 * MB, wall_s=31.0)
    assert B.predict(shaped, [unshaped, shaped], OPTS) == pytest.approx(20.0 + 10.0)
    assert B.predict(unshaped, [unshaped, shaped], OPTS) is None


def test_diloco_prediction_sends_its_outer_payload():
    # 40 fragment all-reduces of 2.5 MB in all (1.25 MB each way: 31.25 kB a fragment, 25 ms at 1.25 MB/s),
    # each far shorter than the 4 inner steps (0.4 s) it overlaps: no stall, the wall is the inner steps'.
    # The link's other traffic (crossing_bytes, 2 GB here) is not the windows'.
    row = _row("diloco 6", "10", crossing_bytes=2000 * MB, counted_bytes=int(2.5 * MB))
    assert B.predict(row, [row], OPTS) == pytest.approx(200 * 0.1)
    slow = _row("diloco 6", "10", counted_bytes=2000 * MB)  # 25 s a fragment: the link sets the pace
    assert B.predict(slow, [slow], OPTS) > 10 * 200 * 0.1


def test_acceptance_ratios_by_hand():
    dp = [_row("dp bf16", "unshaped", s, val_loss=4.0, crossing_bytes=800 * MB) for s in (1, 2)]
    dp.append(_row("dp bf16", "10", 1, val_loss=4.0, wall_s=400.0, crossing_bytes=800 * MB))
    six = [_row("diloco 6", "10", s, val_loss=4.08, wall_s=40.0, crossing_bytes=16 * MB, counted_bytes=4 * MB)
           for s in (1, 2)]
    sixteen = [_row("diloco 16", "10", s, val_loss=v, crossing_bytes=24 * MB, counted_bytes=16 * MB)
               for s, v in ((1, 4.0), (2, 4.04))]
    text = "\n".join(B.acceptance(dp + six + sixteen))
    assert "equals its unshaped run's in 1 of 1" in text
    assert "validation loss is +2.00% against bf16 DP's (2 and 2 seeds" in text
    assert "wall time 0.100x DP's (target <= 0.2: holds)" in text
    assert "bytes per token 0.0200x DP's (target <= 0.01: NOT); the outer payload alone" in text
    assert "(start-up, exit votes, evaluation): 0.0050x." in text
    assert "validation loss 0.06 +- 0.028 (paired over 2 seeds)" in text
    assert "(0.667x; the outer payload alone 9.766 vs 39.06, 0.250x)" in text
    # the targets are the 10 Mbit/s link's: another link's line states the figures only
    at_30 = "\n".join(B.acceptance([{**r, "rate": "30"} if r["rate"] == "10" else r for r in dp + six + sixteen]))
    assert "- 30 Mbit/s: Squinch-DiLoCo's validation loss is +2.00% against bf16 DP's (2 and 2 seeds), its wall " \
           "time 0.100x DP's, its slow-link bytes per token 0.0200x DP's; the outer payload" in at_30
    assert "target" not in at_30


def test_losses_come_from_the_unshaped_runs_of_every_seed_when_the_link_ran_fewer():
    dp = [_row("dp bf16", "unshaped", s, val_loss=4.0) for s in (1, 2, 3)]
    dp.append(_row("dp bf16", "10", 1, val_loss=4.0, wall_s=400.0, crossing_bytes=800 * MB))
    six = [_row("diloco 6", "unshaped", s, val_loss=v) for s, v in ((1, 4.04), (2, 4.12), (3, 4.16))]
    six.append(_row("diloco 6", "10", 1, val_loss=4.04, wall_s=40.0, crossing_bytes=4 * MB, counted_bytes=4 * MB))
    sixteen = [_row("diloco 16", "unshaped", s, val_loss=4.0) for s in (1, 2, 3)]
    sixteen.append(_row("diloco 16", "10", 1, val_loss=4.0, crossing_bytes=8 * MB, counted_bytes=8 * MB))
    text = "\n".join(B.acceptance(dp + six + sixteen))
    assert "equals its unshaped run's in 3 of 3" in text
    assert "validation loss is +2.67% against bf16 DP's (3 and 3 seeds" in text  # (4.04 + 4.12 + 4.16) / 3 / 4
    assert "validation loss 0.1067 +- 0.061 (paired over 3 seeds)" in text


def test_every_configuration_is_compared_with_dp_per_seed():
    dp = [_row("dp bf16", "unshaped", s, val_loss=v) for s, v in ((1, 4.0), (2, 5.0))]
    local = [_row(B.LOCAL_ADAM, "unshaped", s, val_loss=v) for s, v in ((1, 4.2), (2, 5.0))]
    over_link = [_row(B.LOCAL_ADAM, "10", 1, val_loss=9.0)]  # a shaped row is not a loss row
    lines = B.loss_against_dp(dp + local + over_link)
    # means 4.6 vs 4.5: +2.22%; per seed +5% and 0%: mean +2.50%, sd 3.54%
    assert lines[2].startswith(f"- {B.LOCAL_ADAM}: +2.22% (per seed +2.50% +- 3.54%, 2 seeds)")
    assert B.loss_against_dp(local) == []  # nothing to compare with


def test_link_configs_name_their_rates():
    assert B.link_rows(["dp fp32@30,100", "diloco 6"]) == {"dp fp32": {30.0, 100.0}, "diloco 6": {None}}

"""--timing-log-level: the per-phase breakdown of every bucket's Squinch reduction, in the log and TensorBoard."""
import time

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, train

from megatron_cai.core.distributed.comm_timing import PHASES, PhaseTimers, timing_log_lines

AR_PHASES = ("encode", "all-to-all", "decode-accumulate", "owner re-encode", "all-gather", "decode")


def test_timers_are_free_when_off_and_measure_wall_clock_when_on():
    off = PhaseTimers(0)
    assert off.phase(0, "encode") is off.phase(1, "decode")  # one shared no-op context
    with off.phase(0, "encode"):
        time.sleep(0.01)
    assert off.collect() == {"phases": {}, "buckets": {}}
    on = PhaseTimers(1, torch.device("cpu"))
    for _ in range(2):
        with on.phase(3, "encode"):
            time.sleep(0.01)
    with on.phase(4, "all-gather"):
        pass
    got = on.collect()
    assert 20.0 <= got["phases"]["encode"] < 2000.0
    assert set(got["buckets"]) == {3, 4} and list(got["phases"]) == [p for p in PHASES if p in got["phases"]]
    assert on.collect()["phases"] == {}  # collect() clears
    lines = timing_log_lines(7, [got], 2, iters=2)
    assert "iteration 7" in lines[0] and any("encode" in x for x in lines) and any("bucket 3" in x for x in lines)


def _worker(rank, world, argv):
    import megatron_cai.training.training as training_mod

    lines = []
    original = training_mod.print_rank_last

    def capture(msg):
        lines.append(msg)
        original(msg)

    training_mod.print_rank_last = capture
    out = train(argv, world)
    return {"lines": lines, "rank": rank, **{k: out[k] for k in ("iteration",)}}


@pytest.mark.parametrize("level", [0, 2])
def test_phase_breakdown_in_log_and_tensorboard(tmp_path, level):
    tb = str(tmp_path / "tb")
    argv = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
                         "--log-interval", "2", "--eval-interval", "0", "--eval-iters", "0", "--squinch",
                         "--overlap-grad-reduce", "--ddp-bucket-size", "2000", "--tensorboard-dir", tb,
                         "--timing-log-level", str(level), "--log-timers-to-tensorboard"]
    results = run_distributed(_worker, 2, (argv,))
    lines = results[-1]["lines"]  # print_rank_last: what the last rank logs
    phase_lines = [x for x in lines if "gradient reduction phases" in x]
    if level == 0:
        assert phase_lines == []
        return
    assert len(phase_lines) == 2  # every --log-interval (2 of 4 iterations)
    text = "\n".join(lines)
    for phase in AR_PHASES:
        assert f"    {phase} ." in text, phase
    assert "chunk 0 bucket 1:" in text  # level 2: per bucket (several buckets with --ddp-bucket-size)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for phase in AR_PHASES:
        assert "grad-reduce-time/" + phase.replace(" ", "-") in tags
        assert all(e.value > 0 for e in acc.Scalars("grad-reduce-time/" + phase.replace(" ", "-")))

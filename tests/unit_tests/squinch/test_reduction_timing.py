"""--timing-log-level: the per-phase breakdown of every bucket's Squinch reduction, in the log and TensorBoard."""
import time

import pytest
import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, train

from megatron_cai.core.distributed.comm_timing import PHASES, PhaseTimers, StepTimeline, timing_log_lines

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


def test_step_timeline_takes_the_reducer_off_the_compute_clock():
    off = StepTimeline(False)
    off.step_start()
    off.bucket_ready(0, 10)
    off.mark("step end")
    assert off.collect() == {}
    tl = StepTimeline(True, torch.device("cpu"))
    for _ in range(3):
        tl.step_start()
        time.sleep(0.01)
        tl.bucket_ready(4, 128)
        with tl.in_reducer():
            time.sleep(0.02)  # the reducer's host work inside backward
        time.sleep(0.01)
        tl.bucket_ready(5, 64)
        tl.mark("backward end")
        with tl.in_reducer():
            time.sleep(0.005)
        tl.mark("sync end")
        tl.mark("step end")
    got = tl.collect()
    assert got["steps"] == 3 and tl.collect() == {}  # collect() clears
    (index, numel, ready, compute), (index5, numel5, ready5, compute5) = got["buckets"]
    assert (index, numel, index5, numel5) == (4, 128, 5, 64) and ready == compute >= 10.0
    assert ready5 >= 40.0 and ready5 - compute5 >= 20.0 and compute5 >= 20.0  # the reducer's 20 ms taken off
    assert got["backward end"] >= 40.0 and got["backward end"] - got["backward end compute"] >= 20.0
    assert got["backward end compute"] < got["backward end"] - 19.0
    assert got["step end"] >= got["sync end"] >= got["backward end"] + 5.0 and got["reducer host"] >= 25.0
    assert got["after sync"] == pytest.approx(got["step end"] - got["sync end"], abs=1.0)


def _timeline_worker(rank, world):
    import torch.distributed as dist

    tl = StepTimeline(True, torch.device("cpu"), group=dist.group.WORLD)
    for _ in range(3):
        tl.step_start()
        time.sleep(0.01 + 0.03 * rank)  # rank 1 reaches its bucket 30 ms later
        tl.bucket_ready(0, 64)
        tl.mark("backward end")
        tl.mark("sync end")
        tl.mark("step end")
    return tl.collect()


def test_step_timeline_compute_clock_is_the_slowest_ranks():
    fast, slow = run_distributed(_timeline_worker, 2)
    assert fast["buckets"][0][2] < slow["buckets"][0][2] and slow["buckets"][0][2] >= 40.0  # raw: its own clock
    assert fast["buckets"][0][3] == slow["buckets"][0][3] >= 40.0  # compute: the slower rank's, on both
    assert fast["backward end compute"] == slow["backward end compute"] >= 40.0


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
    # level 2: the backward timeline, every bucket handed over once, in backward, on a consistent clock
    import re

    block = text.split("backward timeline at iteration 4")[1]
    buckets = [tuple(map(float, m)) for m in re.findall(r"bucket (\d+): (\d+) elements ready at ([0-9.]+) "
                                                        r"\(compute ([0-9.]+)\)", block)]
    ends = re.search(r"backward end ([0-9.]+) \(compute ([0-9.]+)\), sync end ([0-9.]+), step end ([0-9.]+)",
                     block)
    assert len(buckets) >= 2 and sorted(int(b[0]) for b in buckets) == list(range(len(buckets)))
    bwd, bwd_compute, sync, step = map(float, ends.groups())
    assert "(after sync, compute" in block
    assert max(b[2] for b in buckets) <= bwd <= sync <= step  # this rank's clock
    assert all(0 < compute <= bwd_compute for _, _, _, compute in buckets)  # the slowest rank's compute clock
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for phase in AR_PHASES:
        assert "grad-reduce-time/" + phase.replace(" ", "-") in tags
        assert all(e.value > 0 for e in acc.Scalars("grad-reduce-time/" + phase.replace(" ", "-")))

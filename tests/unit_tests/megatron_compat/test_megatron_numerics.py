"""--step-batch-size-schedule against megatron-core 0.19.2's StepBatchsizeNumMicroBatchesCalculator, and
--use-checkpoint-opt-param-scheduler / --override-opt-param-scheduler against its OptimizerParamScheduler."""
from __future__ import annotations

import pytest

from megatron_cai.core.num_microbatches_calculator import NumMicroBatchesCalculator, parse_step_schedule
from megatron_cai.core.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron_cai.training.arguments import ArgumentError, parse_config

mcalc = pytest.importorskip("megatron.core.num_microbatches_calculator")
msched = pytest.importorskip("megatron.core.optimizer_param_scheduler")

BASE = ["--squared-relu", "--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2"]
SCHEDULES = ["0:16 2.4B:320 4.8B:624", "0:4, 100:8 1K:12", "0:768 250B:1536 500B:3072 750B:6144", "0:2 0.2K:6"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_schedule_is_megatrons(schedule):
    seq, mbs, dp = 16, 2, 1
    theirs = mcalc.StepBatchsizeNumMicroBatchesCalculator(mbs, dp, False, 1, schedule, seq_length=seq)
    pairs = parse_step_schedule(schedule, seq)
    assert pairs == theirs.schedule
    ours = NumMicroBatchesCalculator(pairs[-1][1], mbs, dp, step_schedule=tuple(pairs))
    for consumed in sorted({0, 1, *(t for t, _ in pairs), *(t - 1 for t, _ in pairs if t), *(t + 7 for t, _ in pairs)}):
        theirs.update(consumed, consistency_check=False)
        ours.update(consumed, consistency_check=False)
        assert (ours.current_global_batch_size, ours.num_microbatches) == (theirs.get_current_global_batch_size(),
                                                                          theirs.get())
    samples = pairs[-1][0] + 3 * pairs[-1][1] + 1  # Megatron's update_train_iters: until the samples are reached
    iterations = consumed = 0
    while consumed < samples:
        theirs.update(consumed, consistency_check=False)
        consumed += theirs.get_current_global_batch_size()
        iterations += 1
    assert ours.train_iters(samples) == iterations


def test_step_schedule_flags():
    cfg = parse_config(BASE + ["--train-samples", "40", "--step-batch-size-schedule", "0:2", "64:4"], world_size=1)
    assert cfg.training.global_batch_size == 4 and cfg.training.step_batch_size_schedule == ((0, 2), (4, 4))
    assert cfg.training.train_iters == 2 + 9  # 4 samples in batches of 2, then 36 in batches of 4
    parse_config(BASE + ["--train-iters", "3", "--step-batch-size-schedule", "0:2 64:4", "--global-batch-size",
                         "4"], world_size=1)  # the GPT-3 example's pair, taken when they agree
    for extra, message in ((["--global-batch-size", "8"], "differs from the last batch size"),
                           (["--rampup-batch-size", "2", "2", "8"], "choose one"),
                           (["--decrease-batch-size-if-needed"], "choose one")):
        with pytest.raises(ArgumentError, match=message):
            parse_config(BASE + ["--train-iters", "3", "--step-batch-size-schedule", "0:2 64:4", *extra],
                         world_size=1)
    with pytest.raises(ArgumentError, match="global batch size 3 is not a positive multiple"):
        parse_config(BASE + ["--train-iters", "3", "--step-batch-size-schedule", "0:3 64:4"], world_size=1)
    with pytest.raises(ArgumentError, match="first threshold must be 0"):
        parse_config(BASE + ["--train-iters", "3", "--step-batch-size-schedule", "16:2"], world_size=1)


class _Optimizer:
    def __init__(self) -> None:
        self.param_groups = [{"params": [], "default_config": True}]


def _megatron(cfg, **kw):
    return msched.OptimizerParamScheduler(
        _Optimizer(), init_lr=cfg.lr_warmup_init, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_samples, lr_decay_steps=cfg.lr_decay_samples, lr_decay_style=cfg.lr_decay_style,
        start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant", **kw)


@pytest.mark.parametrize("flag", ["--use-checkpoint-opt-param-scheduler", "--override-opt-param-scheduler"])
def test_resumed_schedule_follows_megatrons_flag(flag):
    """Saved with one schedule, resumed with other LR flags: the rates of the resumed run are megatron-core's
    (with --use-checkpoint-opt-param-scheduler the saved schedule's, with --override-opt-param-scheduler the
    flags')."""
    saved = parse_config(BASE + ["--train-iters", "20", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "4",
                                 "--lr-decay-style", "cosine"], world_size=1).scheduler
    resumed = parse_config(BASE + ["--train-iters", "30", "--lr", "5e-4", "--min-lr", "0", "--lr-warmup-iters", "2",
                                   "--lr-decay-style", "linear", flag], world_size=1).scheduler
    ours_before, theirs_before = OptimizerParamScheduler(saved), _megatron(saved)
    for _ in range(7):
        ours_before.step(2)
        theirs_before.step(increment=2)
    ours = OptimizerParamScheduler(resumed)
    ours.load_state_dict(ours_before.state_dict())
    use_checkpoint = "use-checkpoint" in flag
    theirs = _megatron(resumed, use_checkpoint_opt_param_scheduler=use_checkpoint,
                       override_opt_param_scheduler=not use_checkpoint)
    theirs.load_state_dict(theirs_before.state_dict())
    got, want = [], []
    for _ in range(12):
        got.append(ours.get_lr())
        want.append(theirs.optimizer.param_groups[0]["lr"])
        ours.step(2)
        theirs.step(increment=2)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    flags_values = OptimizerParamScheduler(resumed)  # what the flags alone give at the same steps
    flags_values.num_steps = ours_before.num_steps
    first = flags_values.get_lr()
    assert (got[0] == pytest.approx(first)) == ("override" in flag)  # the two flags differ here

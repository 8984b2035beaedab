"""--rampup-batch-size: Megatron's ramp-up rules against a hand-computed schedule (and megatron-core's
calculator where the installed version still has it), and a training run that follows it."""
import pytest
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, train

from megatron_cai.core.num_microbatches_calculator import BatchRampup, NumMicroBatchesCalculator, parse_rampup
from megatron_cai.training.arguments import parse_config
from megatron_cai.training.config import ArgumentError


def test_hand_computed_schedule():
    # global 32 from 8 in steps of 8 over 60 samples: 3 increments, one every 20 samples; micro 2 x DP 2 = 4
    calc = NumMicroBatchesCalculator(32, 2, 2, BatchRampup(8, 8, 60))
    expected = {0: 8, 19: 8, 20: 16, 39: 16, 40: 24, 59: 24, 60: 32, 61: 32, 1000: 32}
    for consumed, batch in expected.items():
        calc.update(consumed)
        assert calc.current_global_batch_size == batch, consumed
        assert calc.num_microbatches == batch // 4
    # iterations for 200 samples: consumed 0, 8, 16, 24, 40 (batches 8 8 8 16 24) -> 64, then 136 // 32 = 4
    assert calc.train_iters(200) == 9
    assert NumMicroBatchesCalculator(32, 2, 2).train_iters(200) == 6


def test_matches_megatron_core_calculator():
    mod = pytest.importorskip("megatron.core.num_microbatches_calculator")
    if not hasattr(mod, "RampupBatchsizeNumMicroBatchesCalculator"):
        pytest.skip("this megatron-core dropped RampupBatchsizeNumMicroBatchesCalculator (0.19 ignores ramp-up)")
    theirs = mod.RampupBatchsizeNumMicroBatchesCalculator(96, 2, 4, False, 0, 16, 16, 1000)
    ours = NumMicroBatchesCalculator(96, 2, 4, BatchRampup(16, 16, 1000))
    for consumed in range(0, 1200, 7):
        theirs.update(consumed, False)
        ours.update(consumed, consistency_check=False)
        assert (ours.current_global_batch_size, ours.num_microbatches) == (theirs.get_current_global_batch_size(),
                                                                          theirs.get())


def test_decrease_batch_size_if_needed_rounds_down():
    calc = NumMicroBatchesCalculator(30, 2, 2, BatchRampup(6, 6, 40), decrease_batch_size_if_needed=True)
    calc.update(0)
    assert (calc.current_global_batch_size, calc.running_global_batch_size, calc.num_microbatches) == (6, 4, 1)


BASE = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "100",
                     "--eval-interval", "0", "--eval-iters", "0", "--lr-decay-style", "linear"]


@pytest.mark.parametrize("flags,message", [
    (["--rampup-batch-size", "8", "8"], "3 integers"),
    (["--rampup-batch-size", "6", "8", "60"], "multiple of INCREMENT"),
    (["--rampup-batch-size", "3", "29", "60"], "not a positive multiple of micro batch"),
])
def test_bad_rampup_is_one_clear_error(flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse_config(BASE + ["--global-batch-size", "32", "--train-samples", "200"] + flags, world_size=1)
    with pytest.raises(ValueError):
        parse_rampup(["1", "2"])


def test_rampup_with_train_iters_keeps_the_iteration_count():
    """Megatron-LM refuses a ramp-up with --train-iters, yet its GPT-3 example uses one: taken here, the ramp
    follows consumed samples and the run still has --train-iters iterations."""
    cfg = parse_config(BASE + ["--global-batch-size", "32", "--train-iters", "5", "--rampup-batch-size", "8", "8",
                               "60"], world_size=1)
    assert cfg.training.train_iters == 5
    calc = NumMicroBatchesCalculator(32, cfg.training.micro_batch_size, 1, parse_rampup([8, 8, 60]))
    calc.update(0)
    assert calc.running_global_batch_size == 8


def _worker(rank, world_size, argv):
    return train(argv, world_size)


def test_training_follows_the_ramp():
    r = run_distributed(_worker, 1, (BASE + ["--global-batch-size", "32", "--train-samples", "200",
                                             "--rampup-batch-size", "8", "8", "60", "--lr-warmup-samples", "20"],))[0]
    hist = r["history"]
    assert [h["global batch size"] for h in hist] == [8, 8, 8, 16, 24, 32, 32, 32, 32]
    # the LR schedule counts samples: warmup over 20 samples, then linear decay to 0 at 200 samples
    consumed, expected = 0, []
    for batch in [8, 8, 8, 16, 24, 32, 32, 32, 32]:
        expected.append(1e-3 * consumed / 20 if consumed <= 20 else 1e-3 * (1 - (consumed - 20) / 180))
        consumed += batch
    assert [h["lr"] for h in hist] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_train_samples_counts_whole_global_batches_as_megatron():
    """Megatron's update_train_iters floors train_samples / global_batch_size; fewer samples than one batch
    is refused here (Megatron would train zero iterations)."""
    config = parse_config(BASE + ["--global-batch-size", "32", "--train-samples", "203"], world_size=1)
    assert config.training.train_iters == 203 // 32 == 6  # not ceil (7)
    with pytest.raises(ArgumentError, match="less than one global batch"):
        parse_config(BASE + ["--global-batch-size", "32", "--train-samples", "31"], world_size=1)
    import types
    import typing

    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    training = pytest.importorskip("megatron.training.training")
    theirs = types.SimpleNamespace(train_iters=None, train_samples=203, global_batch_size=32,
                                   step_batch_size_schedule=None, rampup_batch_size=None)
    training.update_train_iters(theirs)
    assert theirs.train_iters == config.training.train_iters

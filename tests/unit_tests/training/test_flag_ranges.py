"""Every numeric flag is range-checked: one ArgumentError naming the flag, the value and the range."""
from __future__ import annotations

import math

import pytest

from megatron_cai.training.arguments import build_parser, parse_config
from megatron_cai.training.config import FLAG_RANGES, ArgumentError
from megatron_cai.training.flags.megatron_compat import MAPPED_FLAGS, NO_OP_FLAGS, REFUSED_FLAGS

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2"]


def _numeric_flags() -> dict[str, object]:
    return {a.dest: a for a in build_parser()._actions if a.type in (int, float)}


def test_every_numeric_flag_has_a_range():
    # the Megatron-LM flags that are accepted without effect or refused (flags/table_*.py) need none
    tabled = {f.dest for f in NO_OP_FLAGS + MAPPED_FLAGS + REFUSED_FLAGS}
    missing = sorted(set(_numeric_flags()) - set(FLAG_RANGES) - tabled)
    assert not missing, f"numeric flags without a range in config.FLAG_RANGES: {missing}"
    assert not sorted(set(FLAG_RANGES) - set(_numeric_flags())), "ranges of flags that do not exist"


def _outside(rng, kind):
    """A value of ``kind`` outside ``rng`` (and NaN for floats)."""
    if rng.lo is not None:
        return rng.lo if rng.lo_open else (rng.lo - 1 if kind is int else rng.lo - 0.5)
    return rng.hi if rng.hi_open else rng.hi + 1


@pytest.mark.parametrize("dest", sorted(FLAG_RANGES))
def test_a_value_out_of_range_is_one_error_naming_the_flag(dest):
    action = _numeric_flags()[dest]
    if action.choices:
        pytest.skip("argparse's choices restrict it already")
    rng = FLAG_RANGES[dest]
    flag = action.option_strings[0]
    values = [_outside(rng, action.type)] + ([float("nan")] if action.type is float else [])
    for bad in values:
        bad = action.type(bad)
        argv = [*BASE, flag, *([str(bad)] * (1 if action.nargs is None else 3))]
        with pytest.raises(ArgumentError) as e:
            parse_config(argv, world_size=1)
        assert str(e.value).startswith(f"{flag} {bad}: out of range, must be"), str(e.value)
        assert not math.isnan(bad) or "finite" in str(e.value)


@pytest.mark.parametrize("extra, needle", [
    (["--split", "0,0,0"], "--split '0,0,0': weights must be finite, >= 0 and not all 0"),
    (["--data-path", "-1", "a", "2", "b"], "--data-path weights must be finite, >= 0"),
    (["--data-path", "nan", "a", "2", "b"], "--data-path weights must be finite"),
])
def test_split_and_data_weights(extra, needle):
    argv = [a for a in BASE if a != "--mock-data"] + extra
    with pytest.raises(ArgumentError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_config(argv, world_size=1)


def test_in_range_values_pass():
    cfg = parse_config([*BASE, "--hidden-dropout", "0", "--attention-dropout", "0.5", "--eval-interval", "0",
                        "--distributed-timeout-minutes", "0.5"], world_size=1)
    assert cfg.parallel.distributed_timeout_minutes == 0.5

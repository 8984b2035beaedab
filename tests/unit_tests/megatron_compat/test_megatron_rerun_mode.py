"""--rerun-mode: validate_results (megatron-core's default) and disabled run with our non-finite checks (disabled
says so once); report_stats and error injection are refused by name."""
from __future__ import annotations

import pytest

from megatron_cai.training.arguments import ArgumentError, parse_config

BASE = ["--mock-data", "--vocab-size", "64", "--train-iters", "2"]


def _notes(extra: list[str]) -> list[str]:
    return [n for n in parse_config(BASE + extra, world_size=1).logging.megatron_notes if "--rerun-mode" in n]


def test_validate_results_and_disabled():
    assert _notes([]) == _notes(["--rerun-mode", "validate_results"]) == []
    (note,) = _notes(["--rerun-mode", "disabled"])
    assert "--check-for-nan-in-loss-and-grad" in note


@pytest.mark.parametrize("extra,flag", [(["--rerun-mode", "report_stats"], "--rerun-mode report_stats"),
                                        (["--error-injection-rate", "100"], "--error-injection-rate 100"),
                                        (["--error-injection-type", "persistent_error"],
                                         "--error-injection-type persistent_error")])
def test_refused_by_name(extra, flag):
    with pytest.raises(ArgumentError) as err:
        parse_config(BASE + extra, world_size=1)
    assert str(err.value).startswith(f"{flag}: refused:")


def test_default_error_injection_values_are_accepted():
    parse_config(BASE + ["--error-injection-rate", "0", "--error-injection-type", "transient_error"], world_size=1)

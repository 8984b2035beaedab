"""The rerun-engine flags: megatron-core's names, choices and defaults (its own parser builds them), the
configuration they give, the start-up line of disabled, and their value rules (each an error naming the flag)."""
from __future__ import annotations

import argparse
import typing

import pytest

from megatron_cai.training.arguments import ArgumentError, parse_config
from megatron_cai.training.features.rerun import RerunConfig

BASE = ["--mock-data", "--vocab-size", "64", "--train-iters", "2"]
FLAGS = ("--rerun-mode", "--error-injection-rate", "--error-injection-type", "--result-rejected-tracker-filename",
         "--check-for-large-grads")


def _rerun(extra: list[str]) -> RerunConfig:
    return parse_config(BASE + extra, world_size=1).training.divergence.rerun


def test_defaults_and_choices_are_megatron_cores():
    from megatron_cai.training.arguments import build_parser

    if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
        typing.override = lambda f: f
    margs = pytest.importorskip("megatron.training.arguments")

    def actions(parser: argparse.ArgumentParser) -> dict:
        return {s: a for a in parser._actions for s in a.option_strings if s in FLAGS}

    theirs = actions(margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    ours = actions(build_parser())
    assert set(theirs) == set(ours) == set(FLAGS)
    for flag in FLAGS:
        assert ours[flag].default == theirs[flag].default, flag
        assert set(theirs[flag].choices or ()) <= set(ours[flag].choices or ()), flag
    # megatron-core's parser spells the stats mode report_stats, its RerunMode enum report_determinism_stats
    assert set(ours["--rerun-mode"].choices) == set(theirs["--rerun-mode"].choices) | {"report_determinism_stats"}


def test_the_flags_reach_the_configuration(tmp_path):
    track = str(tmp_path / "rejected.txt")
    assert _rerun([]) == RerunConfig()
    cfg = _rerun(["--rerun-mode", "report_determinism_stats", "--error-injection-rate", "100",
                  "--error-injection-type", "persistent_error", "--result-rejected-tracker-filename", track,
                  "--check-for-large-grads", "--no-check-for-nan-in-loss-and-grad"])
    assert cfg == RerunConfig("report_determinism_stats", 100, "persistent_error", track, False, True)
    assert cfg.reports_stats and not cfg.validates and _rerun(["--rerun-mode", "report_stats"]).reports_stats


def test_disabled_says_so_once():
    notes = [n for n in parse_config(BASE + ["--rerun-mode", "disabled"], world_size=1).logging.megatron_notes
             if "--rerun-mode" in n]
    assert len(notes) == 1 and "--check-for-nan-in-loss-and-grad" in notes[0]
    assert not [n for n in parse_config(BASE, world_size=1).logging.megatron_notes if "--rerun-mode" in n]


@pytest.mark.parametrize("extra,start", [
    (["--error-injection-rate", "-1"], "--error-injection-rate -1: must be finite and >= 0"),
    (["--error-injection-rate", "10", "--num-experts", "4"], "--error-injection-rate / --check-for-large-grads with"),
    (["--rerun-mode", "report_stats", "--num-experts", "4"], "--rerun-mode report_stats with --num-experts"),
    (["--result-rejected-tracker-filename", "/nonexistent-dir/x.txt"],
     "--result-rejected-tracker-filename /nonexistent-dir/x.txt: cannot be appended to")])
def test_value_rules_name_the_flag(extra, start):
    with pytest.raises(ArgumentError) as err:
        parse_config(BASE + extra, world_size=1)
    assert start.split(":")[0] in str(err.value) and start.split(": ")[-1] in str(err.value)

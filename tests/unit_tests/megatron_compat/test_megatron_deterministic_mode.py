"""--deterministic-mode sets megatron-core 0.19.2's deterministic environment, accepts and refuses the launcher's
values as megatron-core's own ``determinism.apply_determinism_env`` does, and refuses its flag combinations."""
from __future__ import annotations

import typing

import pytest
import torch

from megatron_cai.training.arguments import ArgumentError, parse_args, parse_config
from megatron_cai.training.features import determinism

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
mdet = pytest.importorskip("megatron.training.determinism")

MINIMAL = ["--mock-data", "--vocab-size", "64", "--train-iters", "2"]
ENVS = [{}, {"NCCL_ALGO": "Ring"}, {"NCCL_ALGO": "Tree"}, {"NCCL_ALGO": "Ring,^NVLS"}, {"NCCL_ALGO": ","},
        {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, {"CUBLAS_WORKSPACE_CONFIG": ":0:0"},
        {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, {"MAMBA_DETERMINISTIC": "0"}, {"MAMBA_DETERMINISTIC": "1"},
        {"NCCL_ALGO": "CollnetDirect", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OTHER": "x"}]


@pytest.fixture
def restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("env", ENVS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "unset")
def test_environment_as_megatron_core_sets_it(env, restore_determinism):
    theirs = dict(env)
    try:
        mdet.apply_determinism_env(theirs)
        refused = False
    except AssertionError:
        refused = True
    assert bool(determinism.environment_problems(env)) == refused
    if not refused:
        ours = dict(env)
        torch.use_deterministic_algorithms(False)
        determinism.apply_deterministic_mode(ours)
        assert ours == theirs and torch.are_deterministic_algorithms_enabled()


def test_the_launch_reports_a_nondeterministic_environment(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(ArgumentError, match=r"--deterministic-mode with NCCL_ALGO='Tree'"):
        parse_args(MINIMAL + ["--deterministic-mode", "--bogus"], machine=True)


@pytest.mark.parametrize("flag", ["--cross-entropy-loss-fusion", "--tp-comm-overlap"])
def test_megatrons_flag_rules(flag):
    with pytest.raises(ArgumentError, match=f"--deterministic-mode requires {flag} off"):
        parse_config(MINIMAL + ["--deterministic-mode", flag], world_size=1)
    assert parse_config(MINIMAL + ["--deterministic-mode"], world_size=1).parallel.deterministic_mode

"""Megatron-LM's GPT functional-test configurations (tests/fixtures/megatron_scripts/functional_tests, verbatim)
parse here with no problem at all and build their configuration at their own layout (TP x PP x CP ranks), the
paths pointing at a temporary directory and --distributed-backend gloo (there is no NCCL on CPU)."""
from __future__ import annotations

from pathlib import Path

import pytest
from testlib.megatron_scripts import FUNCTIONAL_CONFIGS, functional_argv, functional_env, resize

from megatron_cai.training.arguments import build_config, parse_args


def test_the_fixtures_are_there():
    assert len(FUNCTIONAL_CONFIGS) >= 10


@pytest.mark.parametrize("name", FUNCTIONAL_CONFIGS)
def test_functional_config_parses_and_builds(name, tmp_path: Path):
    argv = resize(functional_argv(name, functional_env(tmp_path)), {"--distributed-backend": ["gloo"]})
    args = parse_args(argv)  # raises with every problem, if there is any
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    config = build_config(args, world, vocab_size=args.vocab_size or 50257)
    assert config.parallel.data_parallel_size == 1
    assert config.training.train_iters == args.train_iters


def test_a_spaced_value_stays_one_word_which_megatron_core_rejects_too():
    """gpt3_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic's ``--hierarchical-context-parallel-sizes: 2 2``:
    Megatron-LM's launcher (_run_training.sh) passes a value with spaces quoted, one word; megatron-core's own
    parser (nargs='+', type=int) rejects that word as ours does, and accepts the two words."""
    import sys

    from testlib import TOOLS

    sys.path.insert(0, TOOLS)
    from megatron_functional_configs import launcher_argv, megatron_core_error

    flag = "--hierarchical-context-parallel-sizes"
    argv = launcher_argv({flag: "2 2", "--context-parallel-size": 4, "--bf16": True, "--fp16": False}, {})
    assert argv == [flag, "2 2", "--context-parallel-size", "4", "--bf16"]
    assert launcher_argv({flag: "[2 2]"}, {}) == [flag, "2", "2"]
    assert megatron_core_error(argv) == f"argument {flag}: invalid int value: '2 2'"
    assert megatron_core_error([flag, "2", "2", "--context-parallel-size", "4"]) is None

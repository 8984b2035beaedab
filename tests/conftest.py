"""Shared pytest configuration: markers, GPU skipping and deterministic CPU threads."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


# Cases kept out of CI for its time budget (marked slow here, so the list is one place): each is the costliest
# variant of a test whose cheaper variants stay in CI and cover the same code path. Run them with -m slow.
CI_TIME_SLOW = {
    "megatron_compat/test_megatron_numerics.py::test_step_schedule_is_megatrons[0:768 250B:1536 500B:3072 750B:6144]",
    "megatron_compat/test_megatron_numerics.py::test_step_schedule_is_megatrons[0:16 2.4B:320 4.8B:624]",
    "checkpoint/test_async_checkpoint.py::test_kill_during_async_save_resumes_from_the_previous_checkpoint[torch_dist]",
    "checkpoint/test_async_checkpoint.py::test_async_save_equals_sync_and_resumes_bit_exactly[torch]",
    "checkpoint/test_async_checkpoint.py::test_async_save_equals_sync_and_resumes_bit_exactly[torch_dist_fsdp2]",
    "checkpoint/test_dist_checkpoint.py::test_resume_in_another_layout[fsdp2_tp1pp1dp4]",
    "checkpoint/test_dist_checkpoint.py::test_same_layout_bit_exact_with_squinch[pp2dp2_interleaved]",
    "checkpoint/test_checkpoint_resume.py::test_resume_is_bit_exact[squinch_stochastic_distopt]",
    "megatron_compat/test_megatron_example_scripts.py::test_llama3_8b_fp8_script_with_context_parallel_size_2",
    "megatron_compat/test_megatron_training_flags.py::test_profile_writes_a_tensorboard_trace",
    "megatron_compat/test_megatron_convert_tool.py::test_loader_core_saver_core_reshards_tp2pp2_to_tp1pp1",
    "megatron_compat/test_megatron_checkpoint_interop.py::test_torch_dist_both_ways[2-gpt]",
    "megatron_compat/test_megatron_checkpoint_interop.py::test_torch_dist_both_ways[1-llama]",
    "megatron_compat/test_megatron_checkpoint_interop.py::test_logit_parity_both_ways[2-gpt]",
    "megatron_compat/test_megatron_checkpoint_interop.py::test_logit_parity_both_ways[1-llama]",
    "megatron_compat/test_megatron_checkpoint_interop.py::test_training_continues_as_in_megatron_core[2-gpt]",
    "megatron_compat/test_megatron_checkpoint_interop.py::test_training_continues_as_in_megatron_core[1-llama]",
    "data/test_preprocess_vs_megatron.py::test_outputs_are_megatrons_bytes[keep_newlines]",
}


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if item.nodeid.split("tests/", 1)[-1].split("/", 1)[-1] in CI_TIME_SLOW:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: a folder named gpu matches
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _no_checkpoint_trust_leaks():
    """A Trainer built with --trust-checkpoint-code (or the other loading flags) sets the process's checkpoint
    loading policy; every test starts and ends with the default, strict one."""
    from megatron_cai.training.checkpoint import CheckpointTrust, set_trust

    yield
    set_trust(CheckpointTrust(), log=lambda *_: None)

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


def pytest_collection_modifyitems(config, items):
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

"""The fault suite's shared reference run (one for every module of the suite)."""
from __future__ import annotations

import pytest

from .test_faults import BASE, FINAL, run, tracker


@pytest.fixture(scope="package")
def base(tmp_path_factory) -> str:
    """A tiny model on mock data, a checkpoint at every iteration 1..FINAL (torch format)."""
    root = str(tmp_path_factory.mktemp("base") / "ckpt")
    proc = run([*BASE, "--save", root, "--save-interval", "1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert tracker(root) == FINAL
    return root


@pytest.fixture(scope="package")
def dist_sync(tmp_path_factory) -> str:
    """Two iterations of the base run saved synchronously in torch_dist format (one rank)."""
    root = str(tmp_path_factory.mktemp("dist_sync") / "ckpt")
    proc = run([*BASE[:-1], "2", "--save", root, "--save-interval", "1", "--ckpt-format", "torch_dist"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root

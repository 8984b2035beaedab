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

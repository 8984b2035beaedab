"""Run-directory guards: which --load/--save directories a run may start in, and where a conversion may write."""
from __future__ import annotations

import os

import pytest

from megatron_cai.training.checkpoint import CheckpointError, run_dirs


def _mk_run(root, iterations, tracker=None):
    os.makedirs(root, exist_ok=True)
    for i in iterations:
        os.makedirs(os.path.join(root, f"iter_{i:07d}"))
    if tracker is not None:
        with open(os.path.join(root, run_dirs.TRACKER), "w") as f:
            f.write(str(tracker))
    return str(root)


def test_check_run_dirs_cases(tmp_path):
    run = _mk_run(tmp_path / "run", [2, 4])
    os.makedirs(tmp_path / "run" / "iter_0000006.tmp")  # an interrupted save is not a checkpoint
    assert run_dirs.list_iterations(run) == [2, 4]
    with pytest.raises(CheckpointError, match=r"iter_0000002, iter_0000004 but no .*--ckpt-step 4"):
        run_dirs.check_run_dirs(run, run)
    with pytest.raises(CheckpointError, match=r"after the one this run resumes: iter_0000004;.*--overwrite-chec"):
        run_dirs.check_run_dirs(run, run, step=2)  # an explicit step loads, but iteration 4 would be replaced
    run_dirs.check_run_dirs(run, run, step=2, overwrite=True)
    run_dirs.check_run_dirs(run, run, step=4)
    other = _mk_run(tmp_path / "other", [3, 5])  # another run's directory as --save
    with pytest.raises(CheckpointError, match=r"of another run \(this run resumes iteration 4 .*iter_0000005"):
        run_dirs.check_run_dirs(run, other, step=4)
    with pytest.raises(CheckpointError, match="--finetune.*iter_0000003, iter_0000005"):
        run_dirs.check_run_dirs(run, other, step=4, finetune=True)
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        run_dirs.check_run_dirs(None, run)
    fresh = str(tmp_path / "requeue")
    run_dirs.check_run_dirs(fresh, fresh)  # first start of a requeued job
    with pytest.raises(CheckpointError, match="no such directory"):
        run_dirs.check_run_dirs(fresh, str(tmp_path / "elsewhere"))
    empty = _mk_run(tmp_path / "empty", [])
    run_dirs.check_run_dirs(empty, empty)
    tracked = _mk_run(tmp_path / "tracked", [2], tracker=2)
    run_dirs.check_run_dirs(tracked, tracked)
    with pytest.raises(CheckpointError, match="Resume with --load"):
        run_dirs.check_run_dirs(None, tracked)


def test_check_conversion_target(tmp_path):
    src = _mk_run(tmp_path / "src", [2], tracker=2)
    with pytest.raises(CheckpointError, match="replace the source"):
        run_dirs.check_conversion_target(src, str(tmp_path / "src" / "."))
    busy = _mk_run(tmp_path / "busy", [4], tracker=4)
    with pytest.raises(CheckpointError, match="not empty"):
        run_dirs.check_conversion_target(src, busy)
    run_dirs.check_conversion_target(src, busy, overwrite=True)
    run_dirs.check_conversion_target(src, str(tmp_path / "new"))
    run_dirs.check_conversion_target(src, _mk_run(tmp_path / "empty", []))

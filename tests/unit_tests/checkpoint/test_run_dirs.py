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
    lagging = _mk_run(tmp_path / "lagging", [2, 4], tracker=2)  # killed between publishing 4 and the tracker
    with pytest.raises(CheckpointError, match="after the one this run resumes: iter_0000004"):
        run_dirs.check_run_dirs(lagging, lagging)


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


def test_check_paths_names_the_flag_and_the_cause(tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match=f"--save {afile} exists and is not a directory"):
        run_dirs.check_paths(None, str(afile))
    with pytest.raises(CheckpointError, match=f"--load {afile} exists and is not a directory"):
        run_dirs.check_paths(str(afile), None)
    new = tmp_path / "a" / "b"
    run_dirs.check_paths(None, str(new))  # created, and left without the write probe
    assert os.listdir(new) == []
    run = _mk_run(tmp_path / "run", [1], tracker=1)
    real_access = os.access  # root reads everything: the permission answer is the one that matters here
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p).startswith(run) else real_access(p, m))
    with pytest.raises(CheckpointError, match=f"--load {run} is not readable \\(permission denied\\)"):
        run_dirs.check_paths(run, None)


def test_free_space_warning_names_both_figures(tmp_path):
    import shutil

    free = shutil.disk_usage(tmp_path).free
    assert run_dirs.free_space_warning(str(tmp_path), 1000) is None
    line = run_dirs.free_space_warning(str(tmp_path), 2 * free + 10**9)
    assert line.startswith("WARNING: --save") and str(tmp_path) in line
    # the free figure is read again inside the call, so it may have moved by a little since ours
    got_free = int(line.split(" bytes) free")[0].rsplit("(", 1)[1])
    assert abs(got_free - free) < 10**8 and f"({2 * free + 10**9} bytes)" in line

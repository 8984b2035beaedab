"""Resuming a checkpoint into a model of another shape, as real processes: one ``error:`` line naming the checkpoint
file (torch) or directory (torch_dist), the parameter and both shapes (read back from the saved file, not
hard-coded), and the flag that differs; exit 2, no traceback, nothing of the checkpoint changed.

The base run (``conftest.base``: torch format; ``dist_sync``: torch_dist) has ``--hidden-size 32 --num-layers 2
--make-vocab-size-divisible-by 8`` over 64 tokens. One case runs in CI; the others, and two ranks, are slow.
"""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from .test_faults import (
    BASE,
    assert_kept,
    assert_one_error,
    copy_run,
    error_lines,
    launch_ranks,
    rank_file,
    run,
    snapshot,
)

TORCH_CASES = {
    "hidden": (["--hidden-size", "64"], "--hidden-size"),
    "more_layers": (["--num-layers", "3"], "--num-layers"),
    "fewer_layers": (["--num-layers", "1"], "--num-layers"),
    "vocab_padding": (["--make-vocab-size-divisible-by", "128"], "--make-vocab-size-divisible-by"),
}


def _changed(flags: list[str]) -> list[str]:
    """The base run's flags with ``flags`` (pairs) replacing the base's values."""
    argv = list(BASE)
    for name, value in zip(flags[::2], flags[1::2]):
        argv[argv.index(name) + 1] = value
    return argv


def _saved_shapes(root: str, iteration: int) -> dict[str, tuple[int, ...]]:
    """Every saved weight's shape, read from the torch-format rank file."""
    payload = torch.load(rank_file(root, iteration), weights_only=False)
    return {k: tuple(v.shape) for k, v in payload["model"]["model0"].items()}


def _check_line(line: str, saved: dict[str, tuple[int, ...]], flag: str) -> None:
    """The line names a parameter with its saved shape (from the file) and, where both have it, this run's."""
    m = re.search(r"'([\w.]+)' has shape (\([\d, ]*\)) in the checkpoint but (\([\d, ]*\)) in this run", line) \
        or re.search(r"this run's '([\w.]+)' \(shape (\([\d, ]*\))\) is not in the checkpoint", line) \
        or re.search(r"the checkpoint holds '([\w.]+)' \(shape (\([\d, ]*\))\), which this run lacks", line)
    assert m, line
    name = m.group(1)
    if "in the checkpoint but" in line:
        assert str(saved[name]) == m.group(2) and m.group(2) != m.group(3), line
    elif "which this run lacks" in line:
        assert str(saved[name]) == m.group(2), line
    else:
        assert name not in saved, line
    assert flag in line, line


def _resume(base: str, tmp_path, change: list[str], *extra: str):
    root = copy_run(base, tmp_path, 2)
    before = snapshot(root)
    proc = run([*_changed(change), "--train-iters", "3", "--load", root, *extra])
    return root, before, proc


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "hidden" else pytest.mark.slow)
                                  for c in TORCH_CASES])
def test_torch_resume_with_another_shape(base, tmp_path, case):
    change, flag = TORCH_CASES[case]
    root, before, proc = _resume(base, tmp_path, change)
    line = assert_one_error(proc, rank_file(root, 2))
    _check_line(line, _saved_shapes(root, 2), flag)
    assert_kept(before, root, allow_new=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["hidden", "more_layers", "fewer_layers"])
def test_torch_dist_resume_with_another_shape(dist_sync, base, tmp_path, case):
    change, flag = TORCH_CASES[case]
    root = str(tmp_path / "dist")
    shutil.copytree(dist_sync, root)
    before = snapshot(root)
    proc = run([*_changed(change), "--train-iters", "3", "--load", root, "--ckpt-format", "torch_dist"])
    line = assert_one_error(proc, os.path.join(root, "iter_0000002"))
    _check_line(line, _saved_shapes(base, 2), flag)  # the same model as the torch-format base run
    assert_kept(before, root, allow_new=False)


@pytest.mark.slow
def test_torch_dist_repads_the_vocabulary(dist_sync, tmp_path):
    """Not a mismatch in torch_dist: the vocabulary tables are re-padded (docs/checkpoints.md)."""
    root = str(tmp_path / "dist")
    shutil.copytree(dist_sync, root)
    proc = run([*_changed(["--make-vocab-size-divisible-by", "128"]), "--train-iters", "3", "--load", root,
                "--ckpt-format", "torch_dist", "--save", root])
    assert proc.returncode == 0 and not error_lines(proc.stderr), proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_two_pipeline_ranks_give_one_line_and_no_hang(tmp_path, fmt):
    """PP = 2: both stages find a mismatch in their own files; every rank exits 2, one ``error:`` line."""
    root = str(tmp_path / "pp2")
    pp = ["--pipeline-model-parallel-size", "2", "--ckpt-format", fmt]
    procs = launch_ranks([*BASE[:-1], "2", *pp, "--save", root, "--save-interval", "2"], 2)
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "".join(o + e for o, e in outs)[-3000:]
    before = snapshot(root)
    procs = launch_ranks([*_changed(["--hidden-size", "64"]), "--train-iters", "3", *pp, "--load", root], 2)
    outs = [p.communicate(timeout=240) for p in procs]
    text = "".join(o + e for o, e in outs)
    assert [p.returncode for p in procs] == [2, 2], text[-3000:]
    lines = error_lines("".join(e for _, e in outs))
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    assert os.path.join(root, "iter_0000002") in lines[0] and "in the checkpoint but" in lines[0], lines[0]
    assert "--hidden-size differs: 32 in the checkpoint, 64 in this run" in lines[0], lines[0]
    assert_kept(before, root, allow_new=False)
    procs = launch_ranks([*BASE[:-1], "3", *pp, "--load", root], 2)  # the same shapes: no false alarm on any stage
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "".join(o + e for o, e in outs)[-3000:]

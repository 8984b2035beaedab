"""--save-retain-interval with non-persistent saves in real runs: the directories hold exactly the hand-computed
iterations, and a process killed at a chosen point (mid-write of a persistent or a non-persistent save, or
between publishing a save and deleting what it supersedes) leaves a latest checkpoint that verifies, loads, and
resumes to the uninterrupted run's state bit for bit.

The run: 7 iterations, --save-interval 2 --save-retain-interval 4 --non-persistent-save-interval 1
--non-persistent-ckpt-type global. Persistent saves at 2, 4, 6 and the final 7 (2 goes once 4 is published,
6 once 7 is); non-persistent saves at 1, 3, 5, 7 (each supersedes the older ones, and a newer persistent save
those older than it, but for the one the non-persistent tracker names).
"""
from __future__ import annotations

import os

import pytest
import torch

import pretrain_gpt
from megatron_cai.training.checkpoint import list_iterations, load_any_canonical, read_tracker, verify_iteration
from megatron_cai.training.checkpoint.retention import newest_checkpoint
from megatron_cai.training.training import pretrain

from ..faults.test_faults import BASE, assert_same_state, rank_file, run

ITERS = 7
FLAGS = [*[a for a in BASE if a not in ("--train-iters", "6")], "--train-iters", str(ITERS), "--save-interval", "2",
         "--save-retain-interval", "4", "--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global"]
NP = "non_persistent"


def train_in_process(root: str, capsys) -> str:
    """Run FLAGS saving into (and resuming from) ``root`` in this process; its stdout."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocesses run (OMP_NUM_THREADS=1): the same reduction order
    try:
        config, tokenizer = pretrain_gpt.build_run([*FLAGS, "--load", root, "--save", root], world_size=1)
        pretrain(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def assert_latest_loads(root: str, expected: tuple[str, int]) -> None:
    """The checkpoint a resume picks is ``expected``, all its files verify, and it loads."""
    where, iteration = newest_checkpoint(root, os.path.join(root, NP))
    assert (where, iteration) == (os.path.join(root, *expected[:1]) if expected[0] else root, expected[1])
    manifest, bad = verify_iteration(os.path.join(where, f"iter_{iteration:07d}"))
    assert manifest is not None and not bad, bad
    assert load_any_canonical(where, iteration).model


def assert_final_layout(root: str) -> None:
    assert (list_iterations(root), read_tracker(root)) == ([4, 7], 7)
    assert (list_iterations(os.path.join(root, NP)), read_tracker(os.path.join(root, NP))) == ([7], 7)
    assert not [n for n in os.listdir(root) if n.endswith((".tmp", ".deleting"))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> str:
    """The uninterrupted run (a subprocess)."""
    root = str(tmp_path_factory.mktemp("straight") / "ckpt")
    proc = run([*FLAGS, "--save", root])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return root


def test_retention_and_non_persistent_saves_leave_exactly_these_iterations(straight):
    assert_final_layout(straight)
    assert_latest_loads(straight, (NP, 7))  # equal iterations: the non-persistent one wins (Megatron-LM's rule)


def test_kill_between_publish_and_delete(straight, tmp_path, capsys):
    """Killed at the 2nd deletion (iter_0000002, once 4 is published): 4 is current and verifies; the resumed
    run finishes the deletion (its lineage) and ends where the straight run ends."""
    root = str(tmp_path / "ckpt")
    proc = run([*FLAGS, "--save", root], env={"FAULT_KILL_DELETE": "2"})
    assert proc.returncode == 9, (proc.stdout + proc.stderr)[-3000:]
    assert (list_iterations(root), read_tracker(root)) == ([2, 4], 4)
    assert list_iterations(os.path.join(root, NP)) == [3]
    assert_latest_loads(root, ("", 4))
    out = train_in_process(root, capsys)
    assert f"loaded checkpoint from {root} at iteration 4" in out
    assert_final_layout(root)
    assert_same_state(rank_file(root, ITERS), rank_file(straight, ITERS))


def test_kill_during_a_persistent_write_resumes_from_the_newer_non_persistent_save(straight, tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    proc = run([*FLAGS, "--save", root], env={"FAULT_KILL_SAVE": "iter_0000006.tmp"})
    assert proc.returncode == 9, (proc.stdout + proc.stderr)[-3000:]
    assert (list_iterations(root), read_tracker(root)) == ([4], 4)
    assert_latest_loads(root, (NP, 5))
    out = train_in_process(root, capsys)
    assert f"loaded checkpoint from {os.path.join(root, NP)} at iteration 5" in out
    assert_final_layout(root)
    assert_same_state(rank_file(root, ITERS), rank_file(straight, ITERS))


def test_kill_during_a_non_persistent_write(tmp_path):
    root = str(tmp_path / "ckpt")
    proc = run([*FLAGS, "--save", root], env={"FAULT_KILL_SAVE": f"{NP}/iter_0000005.tmp"})
    assert proc.returncode == 9, (proc.stdout + proc.stderr)[-3000:]
    assert (list_iterations(root), read_tracker(root)) == ([4], 4)
    assert (list_iterations(os.path.join(root, NP)), read_tracker(os.path.join(root, NP))) == ([3], 3)
    assert_latest_loads(root, ("", 4))


def test_the_same_iterations_with_torch_dist_and_async_saves(tmp_path):
    """torch_dist files and --async-save (deletion once the background write is made current) keep the same
    iterations, and the newest verifies."""
    root = str(tmp_path / "ckpt")
    proc = run([*FLAGS, "--save", root, "--ckpt-format", "torch_dist", "--async-save"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert_final_layout(root)
    assert_latest_loads(root, (NP, 7))

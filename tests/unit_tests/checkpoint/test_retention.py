"""--save-retain-interval and non-persistent checkpoints: which iterations a published save lets go, against
hand-computed lists, on real directories published the way a save publishes them."""
from __future__ import annotations

import os

import pytest

from megatron_cai.training.checkpoint import CheckpointError, retention, run_dirs
from megatron_cai.training.checkpoint.integrity import hash_tree
from megatron_cai.training.config import CheckpointConfig


def save(root: str, iteration: int) -> None:
    """A published iteration with one file and its content hash, as a save leaves it."""
    tmp = run_dirs.begin_save(root, iteration)
    with open(os.path.join(tmp, "model.pt"), "wb") as f:
        f.write(os.urandom(64) + bytes([iteration]))
    run_dirs.publish(root, iteration, hash_tree(tmp))


def policy(save_dir: str, **kw) -> retention.RetentionPolicy:
    return retention.RetentionPolicy(CheckpointConfig(save=save_dir, **kw), log=lambda line: None)


def test_retention_keeps_the_multiples_and_the_newest(tmp_path):
    root = str(tmp_path / "ckpt")
    p = policy(root, save_retain_interval=4)
    for it in range(1, 11):  # --save-interval 1, retain every 4th
        save(root, it)
        p.after_publish(root, it)
    assert run_dirs.list_iterations(root) == [4, 8, 10]  # hand-computed: the multiples of 4, and the newest
    assert run_dirs.read_tracker(root) == 10
    assert not [n for n in os.listdir(root) if n.endswith(retention.DELETING)]


def test_only_this_runs_lineage_is_deleted(tmp_path):
    """A run saving into a --save that holds another run's older iterations (--load elsewhere) deletes only its
    own; resuming in place, the older iterations of the directory are its own and go too."""
    root = str(tmp_path / "ckpt")
    for it in (1, 2, 3):
        save(root, it)
    p = policy(root, save_retain_interval=5)
    for it in (6, 7):
        save(root, it)
        p.after_publish(root, it)
    assert run_dirs.list_iterations(root) == [1, 2, 3, 7]
    p = policy(root, save_retain_interval=5)
    p.resumed_in_place()
    save(root, 8)
    p.after_publish(root, 8)
    assert run_dirs.list_iterations(root) == [8]


def test_nothing_is_deleted_before_the_newer_save_is_published(tmp_path):
    """Not tracked yet, or a file missing / of another size than recorded: one warning, nothing deleted."""
    root = str(tmp_path / "ckpt")
    lines: list[str] = []
    p = retention.RetentionPolicy(CheckpointConfig(save=root, save_retain_interval=10), log=lines.append)
    for it in (1, 2, 3):
        save(root, it)
    run_dirs.write_text(os.path.join(root, run_dirs.TRACKER), "2")
    assert p.after_publish(root, 3) == []
    run_dirs.write_text(os.path.join(root, run_dirs.TRACKER), "3")
    with open(os.path.join(run_dirs.iteration_dir(root, 3), "model.pt"), "ab") as f:
        f.write(b"x")
    assert p.after_publish(root, 3) == []
    assert run_dirs.list_iterations(root) == [1, 2, 3]
    assert len(lines) == 2 and all("not removing older checkpoints" in line for line in lines), lines


def test_non_persistent_saves_keep_one_and_a_newer_persistent_save_supersedes_them(tmp_path):
    root = str(tmp_path / "ckpt")
    np_root = os.path.join(root, "non_persistent")
    p = policy(root, non_persistent_ckpt_type="global", save_retain_interval=100)
    assert p.np_root == np_root
    for it in (1, 2, 3):
        save(np_root, it)
        p.after_publish(np_root, it)
    assert run_dirs.list_iterations(np_root) == [3]
    assert retention.newest_checkpoint(root, np_root) == (np_root, 3)  # no persistent one yet
    save(root, 4)
    p.after_publish(root, 4)
    assert retention.newest_checkpoint(root, np_root) == (root, 4)
    assert run_dirs.list_iterations(np_root) == [3]  # the one its tracker names stays
    save(np_root, 5)
    p.after_publish(np_root, 5)
    assert run_dirs.list_iterations(np_root) == [5] and run_dirs.list_iterations(root) == [4]
    assert retention.newest_checkpoint(root, np_root) == (np_root, 5)
    custom = str(tmp_path / "fast")
    assert policy(root, non_persistent_ckpt_type="global", non_persistent_global_ckpt_dir=custom).np_root == custom


def test_a_killed_deletion_is_finished_by_the_next_pass(tmp_path):
    root = str(tmp_path / "ckpt")
    for it in (1, 2):
        save(root, it)
    os.replace(run_dirs.iteration_dir(root, 1), run_dirs.iteration_dir(root, 1) + retention.DELETING)
    save(root, 3)
    policy(root, save_retain_interval=10).after_publish(root, 3)  # iter_0000002: not this job's lineage
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", run_dirs.TRACKER]


def test_start_up_refuses_non_persistent_iterations_that_saving_would_replace(tmp_path):
    root = str(tmp_path / "ckpt")
    np_root = os.path.join(root, "non_persistent")
    flags = dict(save=root, non_persistent_ckpt_type="global", non_persistent_save_interval=1)
    retention.check_non_persistent_dir(CheckpointConfig(**flags))  # nothing there yet
    save(np_root, 3)
    with pytest.raises(CheckpointError, match="holds iter_0000003 and this run starts from scratch"):
        retention.check_non_persistent_dir(CheckpointConfig(**flags))
    retention.check_non_persistent_dir(CheckpointConfig(**flags, load=root))  # resumes the non-persistent 3
    save(root, 2)
    with pytest.raises(CheckpointError, match="after iteration 2, which this run resumes"):
        retention.check_non_persistent_dir(CheckpointConfig(**flags, load=root, ckpt_step=2))
    retention.check_non_persistent_dir(CheckpointConfig(**flags, load=root, ckpt_step=2, overwrite_checkpoints=True))


def test_a_failed_deletion_is_one_warning_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    for it in (1, 2, 3):
        save(root, it)
    real_rmtree, lines = retention.shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        if path.endswith("iter_0000001" + retention.DELETING):
            raise PermissionError(13, "Permission denied")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(retention.shutil, "rmtree", rmtree)
    p = retention.RetentionPolicy(CheckpointConfig(save=root, save_retain_interval=10), log=lines.append)
    p.resumed_in_place()
    assert p.after_publish(root, 3) == [2]
    assert run_dirs.list_iterations(root) == [3]
    assert [line for line in lines if "could not remove" in line and "iter_0000001" in line], lines

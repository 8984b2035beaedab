"""``--save-retain-interval`` and non-persistent checkpoints (``--non-persistent-save-interval``), Megatron-LM's
semantics on this package's publish rule.

- **Retention.** Once a persistent save of iteration N is published, the older persistent checkpoints of this
  run whose iteration is not a multiple of ``--save-retain-interval`` are deleted (Megatron-LM deletes the
  previously tracked one; here every such leftover of this run goes, so a job killed between publishing and
  deleting leaves nothing behind for good).
- **Non-persistent saves** (``--non-persistent-ckpt-type global``) are normal checkpoints in
  ``--non-persistent-global-ckpt-dir`` (default ``<save>/non_persistent``), with their own tracker. Once one is
  published the older non-persistent ones are deleted; once a persistent save is published the non-persistent
  ones older than it are deleted too (but for the one that directory's tracker names). A resume reads the
  non-persistent checkpoint when it is at least as new as the persistent one (Megatron-LM's rule).

What is deleted, and when (issue 28: nothing is removed unless intended):

- only after the newer checkpoint is published: its tracker names it and its ``checksums.json`` is intact,
  listing files that all exist with their recorded sizes (their content was hashed as written; a load
  verifies it); otherwise one warning and nothing is deleted;
- never the newest checkpoint, never the iteration a tracker names, never a symbolic link;
- only this run's lineage: the iterations this job published, and, when it resumed in place (``--load`` is
  ``--save``, or its non-persistent directory, without ``--finetune``), the older ones of that directory;
  never another run's iterations in a ``--save`` that differs from ``--load``;
- a deletion that fails (permissions, a busy file system) is one warning, not an error; the next save
  tries again;
- a deletion first renames ``iter_N`` to ``iter_N.deleting`` (one atomic step), so a kill mid-deletion never
  leaves a half-deleted ``iter_N``; leftover ``*.deleting`` directories are removed by the next pass;
- never an iteration another job is loading (it holds a shared ``flock`` on the directory,
  :class:`.run_dirs.IterationPin`): it is kept until a later save.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
from collections.abc import Callable

from ..config import CheckpointConfig
from .file_io import CheckpointError
from .integrity import read_manifest
from .run_dirs import iteration_dir, list_iterations, read_tracker

NON_PERSISTENT_SUBDIR = "non_persistent"
DELETING = ".deleting"
_LEFTOVER = re.compile(r"iter_\d{7,}\.deleting$")


def non_persistent_root(ckpt: CheckpointConfig, base: str | None) -> str | None:
    """The global non-persistent directory of ``base`` (``--save`` or ``--load``), or None when there is none."""
    if ckpt.non_persistent_ckpt_type != "global":
        return None
    if ckpt.non_persistent_global_ckpt_dir:
        return ckpt.non_persistent_global_ckpt_dir
    return os.path.join(base, NON_PERSISTENT_SUBDIR) if base else None


def newest_checkpoint(load: str | None, np_root: str | None) -> tuple[str | None, int | None]:
    """(directory, iteration) a resume reads: the non-persistent checkpoint when it is at least as new as the
    persistent one, else ``load``'s tracked one; (load, None) when neither has a tracker."""
    persistent = read_tracker(load) if load and os.path.isdir(load) else None
    non_persistent = read_tracker(np_root) if np_root and os.path.isdir(np_root) else None
    if non_persistent is not None and (persistent is None or non_persistent >= persistent):
        return np_root, non_persistent
    return load, persistent


def check_non_persistent_dir(ckpt: CheckpointConfig) -> None:
    """Raise CheckpointError when the non-persistent saves of this run would meet iterations already in their
    directory (a fresh start, or a resume older than them), unless ``--overwrite-checkpoints``; as
    :func:`.run_dirs.check_run_dirs` does for ``--save``."""
    np_root = non_persistent_root(ckpt, ckpt.save)
    if np_root is None or ckpt.overwrite_checkpoints or ckpt.non_persistent_save_interval is None:
        return
    found = list_iterations(np_root)
    if not found:
        return
    if ckpt.finetune:
        resumed: int | None = 0
    elif ckpt.ckpt_step is not None:
        resumed = ckpt.ckpt_step
    else:
        resumed = newest_checkpoint(ckpt.load, non_persistent_root(ckpt, ckpt.load))[1]
    later = [i for i in found if resumed is None or i > resumed]
    if later:
        what = ("and this run starts from scratch" if resumed is None
                else f"after iteration {resumed}, which this run resumes")
        raise CheckpointError(
            f"the non-persistent directory {np_root} holds iter_{later[0]:07d}"
            f"{f' and {len(later) - 1} more' if len(later) > 1 else ''} {what}; saving would replace them. Resume "
            f"with --load {ckpt.save} --non-persistent-ckpt-type global, choose another directory, or pass "
            f"--overwrite-checkpoints to move them aside")


def retention_victims(iterations: list[int], newest: int, retain_interval: int | None, lineage_start: int,
                      tracked: int | None) -> list[int]:
    """The iterations to delete once ``newest`` is published: those of this lineage (>= ``lineage_start``)
    older than ``newest``, except multiples of ``retain_interval`` and the ``tracked`` one."""
    return [i for i in iterations if lineage_start <= i < newest and i != tracked
            and not (retain_interval and i % retain_interval == 0)]


def unpublished_reason(root: str, iteration: int) -> str | None:
    """Why ``iter_N`` of ``root`` does not count as published (None when it does): the tracker names it and
    its content-hash manifest is intact and lists files that all exist with their recorded sizes."""
    tracked = read_tracker(root)
    if tracked != iteration:
        return f"the tracker names {tracked}"
    d = iteration_dir(root, iteration)
    try:
        manifest = read_manifest(d)
    except CheckpointError as e:
        return str(e)
    if manifest is None:
        return "it carries no content hashes"
    for name, record in manifest["files"].items():
        path = os.path.join(d, name)
        if not os.path.isfile(path) or os.path.getsize(path) != record.get("bytes"):
            return f"{path} is missing or not of its recorded size"
    return None


def remove_iteration(root: str, iteration: int, log: Callable[[str], None]) -> bool:
    """Delete ``iter_N`` of ``root`` (renamed to ``iter_N.deleting`` first); False for a symbolic link or an
    iteration another job is loading (:class:`.run_dirs.IterationPin`): kept."""
    d = iteration_dir(root, iteration)
    if os.path.islink(d):
        log(f" --save-retain-interval: kept {d}: it is a symbolic link")
        return False
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f" kept {d} for now: another job is loading it (the next save removes it)")
            return False
        doomed = d + DELETING
        os.replace(d, doomed)
        shutil.rmtree(doomed)
    finally:
        os.close(fd)
    return True


def remove_leftovers(root: str) -> None:
    """Finish deletions that a killed job started (``iter_N.deleting``)."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if _LEFTOVER.match(name):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def prune(root: str, below: int, retain_interval: int | None, lineage_start: int,
          log: Callable[[str], None]) -> list[int]:
    """Delete the iterations of ``root`` that :func:`retention_victims` names; the ones deleted."""
    if not os.path.isdir(root):
        return []
    remove_leftovers(root)
    victims = retention_victims(list_iterations(root), below, retain_interval, lineage_start, read_tracker(root))
    removed = []
    for i in victims:
        try:
            if remove_iteration(root, i, log):
                removed.append(i)
        except OSError as e:  # as in Megatron-LM, a failed deletion is not fatal
            log(f" WARNING: could not remove {iteration_dir(root, i)}: {e.strerror or e} (the next save tries again)")
    if removed:
        log(f" removed checkpoints {', '.join(f'iter_{i:07d}' for i in removed)} of {root} "
            f"(superseded by iteration {below})")
    return removed


class RetentionPolicy:
    """What a published save lets go: call :meth:`after_publish` on rank 0 once a save is published."""

    def __init__(self, ckpt: CheckpointConfig, log: Callable[[str], None] = print) -> None:
        self.save, self.retain_interval = ckpt.save, ckpt.save_retain_interval
        self.np_root = non_persistent_root(ckpt, ckpt.save)
        self.lineage_start: int | None = None  # the oldest iteration of this run's lineage (set on load/publish)
        self.log = log

    def resumed_in_place(self) -> None:
        """This job resumed from its own ``--save`` (or its non-persistent directory): its older iterations are
        this run's lineage."""
        self.lineage_start = 0

    def after_publish(self, root: str, iteration: int) -> list[int]:
        """Delete what the save of ``iteration`` into ``root`` supersedes (see the module docstring)."""
        if self.lineage_start is None:
            self.lineage_start = iteration
        persistent = root == self.save or (self.save and os.path.realpath(root) == os.path.realpath(self.save))
        if not (persistent and self.retain_interval) and self.np_root is None:
            return []
        why = unpublished_reason(root, iteration)
        if why is not None:
            self.log(f" WARNING: not removing older checkpoints: iteration {iteration} of {root} does not count as "
                     f"published ({why})")
            return []
        removed: list[int] = []
        if persistent and self.retain_interval:
            removed += prune(root, iteration, self.retain_interval, self.lineage_start, self.log)
        if self.np_root is not None:  # non-persistent checkpoints older than this save, of either kind
            removed += prune(self.np_root, iteration, None, self.lineage_start, self.log)
        return removed

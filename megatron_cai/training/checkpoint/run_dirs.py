"""Run directories: the ``iter_XXXXXXX`` layout of ``--save``, how a save is published, and the start-up
checks that keep anything from overwriting a run.

A save is written into ``iter_XXXXXXX.tmp`` (:func:`begin_save`) and published by :func:`publish` once
every rank has finished: rank 0 writes the content hashes (``checksums.json``, :mod:`.integrity`), renames
the directory to ``iter_XXXXXXX`` and then moves the tracker (``latest_checkpointed_iteration.txt``), so a
process killed during a save leaves the previous checkpoint current.

A published iteration is never removed before its replacement is published, and never replaced at all
without ``--overwrite-checkpoints``; with it, the replaced iteration and every later one are moved aside
(``iter_XXXXXXX.superseded-<time>``, never deleted), the later ones only after the tracker has moved.

Start-up checks:

- ``--load DIR`` that does not exist is an error, unless ``--save`` is the same path (the first start of
  a requeued job that always passes ``--load $SAVE``).
- A ``--load`` directory holding ``iter_*`` checkpoints but no tracker is an error naming them and
  suggesting ``--ckpt-step N`` (or rebuilding the tracker), instead of a quiet fresh start.
- A ``--save`` directory holding iterations this run would write again (any, on a fresh start; those
  after the resumed one, or from the resumed one on when ``--save`` is another directory) is an error
  naming them, unless ``--overwrite-checkpoints``.
- A conversion refuses ``--save`` equal to ``--load``, and a non-empty ``--save`` unless ``--overwrite``.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import time

import torch.distributed as dist

from ...core import parallel_state as ps
from ..errors import current_rank
from .file_io import CheckpointError, CheckpointIOError, FileHash, write_text
from .integrity import verify_iteration, write_manifest

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"iter_(\d{7,})$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """The iteration ``root``'s tracker names, or None when there is no tracker."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number, found {text!r}") from None


class IterationPaths:
    """``final`` (``root/iter_XXXXXXX``) and ``tmp`` (``final + ".tmp"``) for objects with ``root`` and
    ``iteration``: a save is written into ``tmp`` and renamed to ``final`` before the tracker moves."""

    root: str
    iteration: int

    @property
    def final(self) -> str:
        return iteration_dir(self.root, self.iteration)

    @property
    def tmp(self) -> str:
        return self.final + ".tmp"


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _io_error(what: str, path: str, e: OSError) -> CheckpointIOError:
    cause = {13: "permission denied", 30: "read-only file system", 28: "no space left on device (ENOSPC)"}.get(
        e.errno, e.strerror or str(e))
    return CheckpointIOError(f"cannot {what} {path} on rank {current_rank()}: {cause}")


def begin_save(root: str, iteration: int) -> str:
    """Make the empty temporary directory ``iter_XXXXXXX.tmp`` (rank 0) and return it (collective)."""
    tmp = iteration_dir(root, iteration) + ".tmp"
    if ps.get_rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # an unpublished save of this iteration, never a published one
            os.makedirs(tmp)
        except OSError as e:
            raise _io_error("create the checkpoint directory", tmp, e) from None
    barrier()
    return tmp


def superseded_name(root: str, iteration: int) -> str:
    """A free ``iter_XXXXXXX.superseded-<time>`` path for an iteration moved aside."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = f"{iteration_dir(root, iteration)}.superseded-{stamp}"
    n = 1
    while os.path.exists(path):
        n += 1
        path = f"{iteration_dir(root, iteration)}.superseded-{stamp}.{n}"
    return path


def move_aside(root: str, iteration: int, log=print) -> str:
    """Rename a published iteration to ``iter_XXXXXXX.superseded-<time>`` (never deleted); the new path."""
    src, dst = iteration_dir(root, iteration), superseded_name(root, iteration)
    try:
        os.replace(src, dst)
    except OSError as e:
        raise _io_error("move aside", src, e) from None
    log(f" --overwrite-checkpoints: moved {src} aside to {dst}")
    return dst


def publish(root: str, iteration: int, records: dict[str, tuple[FileHash, int]] | None = None, *,
            overwrite: bool = False, log=print) -> str:
    """Rank 0, once every rank has written: write ``checksums.json`` from ``records`` (path -> (hash, writing
    rank); none: no hashes), rename ``iter_XXXXXXX.tmp`` into place, then move the tracker; returns the
    iteration directory.

    An existing ``iter_XXXXXXX`` is an error unless ``overwrite``: then it is moved aside before the rename,
    and the iterations after this one are moved aside once the tracker names the new save."""
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if records is not None:
        write_manifest(tmp, records)
    if os.path.exists(final):
        if not overwrite:
            raise CheckpointError(f"{final} already exists: not replacing a published checkpoint (pass "
                                  f"--overwrite-checkpoints to move it aside; the new save is left in {tmp})")
        move_aside(root, iteration, log)
    try:
        os.replace(tmp, final)
    except OSError as e:
        raise _io_error("publish", tmp, e) from None
    write_text(os.path.join(root, TRACKER), str(iteration), fsync=True)
    if overwrite:
        for later in list_iterations(root):
            if later > iteration:
                move_aside(root, later, log)
    return final


class IterationPin:
    """A shared ``flock`` on one published ``iter_XXXXXXX`` directory, held while a job reads it: a writer's
    retention (:func:`.retention.remove_iteration`) takes the exclusive lock before it removes an iteration, so
    it skips one that a reader holds (and the next save tries again)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def take(cls, root: str, iteration: int) -> IterationPin | None:
        """Pin ``iter_XXXXXXX`` of ``root``; None when it is gone or being removed."""
        path = iteration_dir(root, iteration)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # not renamed to iter_N.deleting meanwhile
                return cls(fd)
        except OSError:
            pass
        os.close(fd)
        return None

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def list_iterations(root: str) -> list[int]:
    """Iterations of the complete-looking ``iter_XXXXXXX`` directories in ``root`` (not ``*.tmp``), sorted."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _ITER_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def same_path(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


def _names(iterations: list[int], limit: int = 6) -> str:
    names = [f"iter_{i:07d}" for i in iterations]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _has_tracker(root: str) -> bool:
    return os.path.exists(os.path.join(root, TRACKER))


def check_run_dirs(load: str | None, save: str | None, step: int | None = None, *, finetune: bool = False,
                   overwrite: bool = False) -> None:
    """Raise CheckpointError when this start would silently start fresh or overwrite a run (see above)."""
    loads_something = False
    if load:
        if not os.path.isdir(load):
            if not same_path(load, save):
                raise CheckpointError(f"--load {load}: no such directory (only allowed when --save is the same "
                                      f"path, for the first start of a requeued job); check the path")
        elif step is not None or _has_tracker(load):
            loads_something = True
        else:
            found = list_iterations(load)
            if found:
                raise CheckpointError(
                    f"--load {load} holds checkpoints {_names(found)} but no {TRACKER}; resume one with "
                    f"--ckpt-step {found[-1]}, or rebuild the tracker: echo {found[-1]} > "
                    f"{os.path.join(load, TRACKER)}")
    if not save or overwrite:
        return
    found = list_iterations(save)
    if found and not loads_something:
        tracker = "" if _has_tracker(save) else f" (and no {TRACKER})"
        raise CheckpointError(
            f"--save {save} already holds checkpoints {_names(found)}{tracker}; starting from scratch would "
            f"overwrite them. Resume with --load {save}"
            f"{'' if _has_tracker(save) else f' --ckpt-step {found[-1]}'}, choose an empty --save directory, or "
            f"pass --overwrite-checkpoints to move them aside as this run saves")
    resumed = 0 if finetune else (step if step is not None else (read_tracker(load) if load else None))
    if not found or resumed is None:
        return
    here = same_path(load, save)
    later = [i for i in found if i > resumed or (i == resumed and not here)]
    if later:
        what = "after the one this run resumes" if here else (
            f"of another run (this run resumes iteration {resumed} of --load {load})" if not finetune
            else "that --finetune (which restarts at iteration 0) would write again")
        raise CheckpointError(
            f"--save {save} holds iterations {what}: {_names(later)}; saving would replace them. Pass "
            f"--overwrite-checkpoints to move them aside (iter_N.superseded-<time>, never deleted), or choose "
            f"another --save directory")


def check_paths(load: str | None, save: str | None) -> None:
    """``--save`` a writable directory (created when missing), ``--load`` a readable one; else one error
    naming the flag, the path and the cause."""
    if save:
        if os.path.exists(save) and not os.path.isdir(save):
            raise CheckpointError(f"--save {save} exists and is not a directory")
        try:
            os.makedirs(save, exist_ok=True)
            probe = os.path.join(save, f".write_test.{os.getpid()}")
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as e:
            raise CheckpointError(f"--save {save} is not writable: {_io_error('write', save, e).args[0]}; choose a "
                                  f"writable directory") from None
    if load and os.path.exists(load):
        if not os.path.isdir(load):
            raise CheckpointError(f"--load {load} exists and is not a directory")
        if not os.access(load, os.R_OK | os.X_OK) or (
                _has_tracker(load) and not os.access(os.path.join(load, TRACKER), os.R_OK)):
            raise CheckpointError(f"--load {load} is not readable (permission denied)")


def directory_bytes(path: str) -> int:
    """Bytes of the files under ``path``."""
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def free_space_warning(save: str, expected_bytes: int) -> str | None:
    """A warning when the file system of ``save`` has less free space than one checkpoint needs."""
    try:
        free = shutil.disk_usage(save).free
    except OSError:
        return None
    if free >= expected_bytes:
        return None
    return (f"WARNING: --save {save} has {free / 1e9:.3f} GB ({free} bytes) free, but a checkpoint of this run "
            f"needs about {expected_bytes / 1e9:.3f} GB ({expected_bytes} bytes): saves will fail with no space "
            f"left on device (the previous checkpoint stays current)")


def check_conversion_target(load: str, save: str, overwrite: bool = False) -> None:
    """Raise CheckpointError when writing a conversion into ``save`` could replace existing files."""
    if same_path(load, save):
        raise CheckpointError(f"--save {save} is the --load directory: converting in place would replace the "
                              f"source checkpoint; write to a new directory")
    if os.path.exists(save) and not os.path.isdir(save):
        raise CheckpointError(f"--save {save} exists and is not a directory")
    entries = sorted(os.listdir(save)) if os.path.isdir(save) else []
    if entries and not overwrite:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise CheckpointError(f"--save {save} is not empty ({shown}); choose a new directory, or pass --overwrite "
                              f"to write into it (files of the same iteration are replaced)")


def last_verifying_iteration(root: str, before: int) -> int | None:
    """The newest iteration in ``root`` older than ``before`` whose files all verify (or that carries no
    hashes and whose files exist), or None."""
    for it in reversed([i for i in list_iterations(root) if i < before]):
        try:
            manifest, bad = verify_iteration(iteration_dir(root, it))
        except CheckpointError:
            continue
        if manifest is not None and not bad:
            return it
    return None

"""Run directories: the ``iter_XXXXXXX`` layout of ``--save``, how a save is published, and the start-up
checks that keep anything from overwriting a run.

A save is written into ``iter_XXXXXXX.tmp`` (:func:`begin_save`) and published by :func:`publish` once
every rank has finished: rank 0 renames it to ``iter_XXXXXXX`` and then moves the tracker
(``latest_checkpointed_iteration.txt``), so a process killed during a save leaves the previous
checkpoint current.

Start-up checks:

- ``--load DIR`` that does not exist is an error, unless ``--save`` is the same path (the first start of
  a requeued job that always passes ``--load $SAVE``).
- A ``--load`` directory holding ``iter_*`` checkpoints but no tracker is an error naming them and
  suggesting ``--ckpt-step N`` (or rebuilding the tracker), instead of a quiet fresh start.
- A fresh start (nothing loaded) into a ``--save`` directory that already holds ``iter_*`` checkpoints
  is an error: it would overwrite them.
- A conversion refuses ``--save`` equal to ``--load``, and a non-empty ``--save`` unless ``--overwrite``.
"""
from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist

from ...core import parallel_state as ps
from .file_io import CheckpointError, write_text

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


def begin_save(root: str, iteration: int) -> str:
    """Make the empty temporary directory ``iter_XXXXXXX.tmp`` (rank 0) and return it (collective)."""
    tmp = iteration_dir(root, iteration) + ".tmp"
    if ps.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    return tmp


def publish(root: str, iteration: int) -> str:
    """Rename ``iter_XXXXXXX.tmp`` into place (replacing a save of the same iteration), then move the tracker;
    returns the iteration directory. One process calls it (rank 0), once every rank has written."""
    final = iteration_dir(root, iteration)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(final + ".tmp", final)
    write_text(os.path.join(root, TRACKER), str(iteration), fsync=True)
    return final


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


def check_run_dirs(load: str | None, save: str | None, step: int | None = None) -> None:
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
    if save and not loads_something:
        found = list_iterations(save)
        if found:
            tracker = "" if _has_tracker(save) else f" (and no {TRACKER})"
            raise CheckpointError(
                f"--save {save} already holds checkpoints {_names(found)}{tracker}; starting from scratch would "
                f"overwrite them. Resume with --load {save}"
                f"{'' if _has_tracker(save) else f' --ckpt-step {found[-1]}'}, or choose an empty --save directory")


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

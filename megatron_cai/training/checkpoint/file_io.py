"""Checkpoint file I/O that names the file: every read and write of a checkpoint goes through here.

An I/O problem becomes a ``CheckpointIOError`` that says which file, which rank, and what was found:
a missing file, an empty or truncated ``.pt``, something that is not a torch file, invalid JSON, or a
full disk (ENOSPC, with the bytes the file needed and the bytes free). Writes go to ``path.tmp`` and
are renamed, so a failed write never replaces a good file; the partial temporary file is removed.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import zipfile
from typing import Any

import torch

from ..errors import RankLocalError, current_rank

_ZIP_MAGIC = b"PK\x03\x04"
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used with this run; the message says why and what to do."""


class CheckpointIOError(CheckpointError, RankLocalError):
    """A checkpoint file that could not be read or written; the message names the file and rank."""


def payload_nbytes(obj: Any) -> int:
    """Bytes of tensor data in a nested payload (what a save of it needs, give or take the metadata)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_nbytes(v) for v in obj)
    return 0


def _free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".").free
    except OSError:
        return None


def _mb(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 1e6:.1f} MB ({n} bytes)"


def describe_write_error(path: str, exc: BaseException, needed: int) -> str:
    """One sentence for a failed write of ``path`` (ENOSPC recognised from errno or torch's zip writer)."""
    free = _free_bytes(path)
    no_space = isinstance(exc, OSError) and exc.errno in _NO_SPACE
    torch_writer = isinstance(exc, RuntimeError) and any(
        s in str(exc) for s in ("unexpected pos", "file write failed", "No space left"))
    if no_space or (torch_writer and (free is None or free < needed or "No space left" in str(exc))):
        return (f"cannot write {path} on rank {current_rank()}: no space left on device (ENOSPC): the file "
                f"needs about {_mb(needed)}, {_mb(free)} free; nothing was replaced (free space and resume "
                f"from the previous checkpoint)")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"cannot write {path} on rank {current_rank()}: {type(exc).__name__}: {first}"


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def save_torch(obj: Any, path: str) -> None:
    """``torch.save`` to ``path.tmp`` and rename; an error names the file (see the module docstring)."""
    tmp = path + ".tmp"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        _remove_quietly(tmp)
        raise CheckpointIOError(describe_write_error(path, e, payload_nbytes(obj))) from None


def write_text(path: str, text: str, *, fsync: bool = False) -> None:
    """Write a small text/JSON file atomically; an error names the file."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _remove_quietly(tmp)
        raise CheckpointIOError(describe_write_error(path, e, len(text.encode()))) from None


def write_json(path: str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=1, default=str))


def read_json(path: str, what: str = "checkpoint metadata") -> dict:
    """A JSON object from ``path``; a missing, unreadable or invalid file is a CheckpointError naming it."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a megatron-cai checkpoint (or an interrupted save)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {what} {path}: {e}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        found = "an empty file" if not text.strip() else f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        raise CheckpointError(f"{what} {path} is corrupt: {found} ({len(text)} bytes)") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{what} {path} is corrupt: expected a JSON object, found {type(obj).__name__}")
    return obj


def _what_is_wrong(path: str, exc: BaseException) -> str:
    size = os.path.getsize(path)
    if size == 0:
        return "empty file (0 bytes): truncated"
    with open(path, "rb") as f:
        head = f.read(4)
    if head == _ZIP_MAGIC:
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
            found = f"a corrupt member {bad!r}" if bad else "a zip torch could not read"
        except (zipfile.BadZipFile, OSError):
            found = "no zip directory at the end"
        return f"truncated or corrupt torch file ({size} bytes, {found}): {str(exc).splitlines()[0][:160]}"
    if head[:1] == b"\x80":  # a legacy (pickle) torch file
        return f"truncated or corrupt legacy torch file ({size} bytes): {type(exc).__name__}: {exc}"
    return f"not a torch file ({size} bytes, starts with {head!r})"


def load_torch(path: str) -> Any:
    """``torch.load(path, map_location="cpu")``; an error names the file, the rank and what was found."""
    if not os.path.exists(path):
        raise CheckpointIOError(f"{path} is missing: incomplete checkpoint (read by rank {current_rank()})")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError, OSError, zipfile.BadZipFile) as e:
        raise CheckpointIOError(f"cannot load {path} on rank {current_rank()}: {_what_is_wrong(path, e)}") from None

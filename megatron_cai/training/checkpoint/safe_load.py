"""Loading a checkpoint is not executing it: every pickle we read is parsed as data, with an allowlist.

- Torch files (``model_optim_rng.pt``, ``reducer_dp_*.pt``, the byte objects inside a ``.distcp``) are read with
  ``torch.load(weights_only=True)``: tensors, storages, the builtin containers and scalars that PyTorch's
  weights-only unpickler admits, plus :data:`SAFE_TYPES` (exactly the other types our saves write).
- DCP's ``.metadata`` is read by :class:`SafeFileSystemReader`, whose unpickler resolves only DCP's own metadata
  classes (dataclasses and enums of ``torch.distributed.checkpoint.metadata``, ``.filesystem``, ``.planner`` and
  ``.storage``: megatron-core keeps its save plans in the metadata), ``torch.Size``,
  torch dtypes, layouts and memory formats, and ``pathlib`` paths; any other global is refused before its module
  is imported. This is a restricted unpickler rather than a reader of our own for the format: the pickle's
  classes are DCP's public dataclasses, stable across PyTorch versions (checked on torch 2.11 and 2.13), while
  a private reader would have to follow every change of their fields.
- Anything else is refused with one error naming the file and the global it asked for. Checkpoints written
  before these rules (their NumPy RNG state was a pickled ``ndarray``) load only under an explicit
  :class:`CheckpointTrust` with ``trust_code`` (``--trust-checkpoint-code``), which prints what it allows.

:class:`CheckpointTrust` is the process's loading policy (set once by an entry point, see :func:`set_trust`):
``trust_code``, ``allow_unverified`` (``--allow-unverified-checkpoint``: a checkpoint without a usable manifest)
and ``signing_key`` (``--checkpoint-signing-key FILE``: the HMAC key of :mod:`.integrity`).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import os
import pickle
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..errors import current_rank, safe_print
from .file_io import CheckpointError, CheckpointIOError, describe_unreadable

SAFE_TYPES: list[Any] = [collections.OrderedDict]  # state_dict() containers; everything else is torch's default
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint.storage")  # megatron-core
# keeps its save plans (SavePlan, WriteItem...) in the metadata
_PATHS = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path", "PurePath")
_MIN_KEY_BYTES = 16


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that would run code when unpickled (a global outside the allowlist)."""


@dataclasses.dataclass(frozen=True)
class CheckpointTrust:
    """How far this process trusts the checkpoints it reads (the default: not at all)."""

    trust_code: bool = False           # --trust-checkpoint-code: unpickle with weights_only=False
    allow_unverified: bool = False     # --allow-unverified-checkpoint: no manifest / an algorithm we lack
    signing_key: bytes | None = None   # --checkpoint-signing-key FILE: sign manifests, require the signature


_trust = CheckpointTrust()


def current_trust() -> CheckpointTrust:
    return _trust


def set_trust(trust: CheckpointTrust, log=safe_print) -> CheckpointTrust:
    """Make ``trust`` this process's loading policy (every thread's); returns the previous one. Printing what a
    relaxed policy allows."""
    global _trust
    previous, _trust = _trust, trust
    if trust.trust_code and not previous.trust_code:
        log(" WARNING: --trust-checkpoint-code: checkpoint files that are not plain data are unpickled with "
            "torch.load(weights_only=False) and DCP's unrestricted reader: any code in them runs. Use it only for "
            "checkpoints from a source you trust (re-save them once to drop the need)")
    if trust.allow_unverified and not previous.allow_unverified:
        log(" WARNING: --allow-unverified-checkpoint: a checkpoint without a content-hash manifest (or hashed with "
            "an algorithm this installation lacks) loads with its files unverified")
    return previous


@contextmanager
def checkpoint_trust(trust: CheckpointTrust, log=safe_print) -> Iterator[None]:
    previous = set_trust(trust, log)
    try:
        yield
    finally:
        set_trust(previous, log=lambda *_: None)


def read_signing_key(path: str | None) -> bytes | None:
    """The key in file ``path`` (``--checkpoint-signing-key``; trailing newlines dropped); None without one."""
    if not path:
        return None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise CheckpointError(f"--checkpoint-signing-key {path}: not a regular file")
        with open(path, "rb") as f:
            key = f.read().rstrip(b"\r\n")
    except OSError as e:
        raise CheckpointError(f"--checkpoint-signing-key {path}: cannot read the key file: {e.strerror}") from None
    if len(key) < _MIN_KEY_BYTES:
        raise CheckpointError(f"--checkpoint-signing-key {path}: the key holds {len(key)} bytes; use at least "
                              f"{_MIN_KEY_BYTES} random bytes (e.g. head -c 32 /dev/urandom | base64 > {path})")
    return key


def trust_from_flags(args: argparse.Namespace) -> CheckpointTrust:
    """The policy the three flags of ``arguments.add_checkpoint_trust_flags`` ask for (the tools' parsers)."""
    return CheckpointTrust(trust_code=args.trust_checkpoint_code, allow_unverified=args.allow_unverified_checkpoint,
                           signing_key=read_signing_key(args.checkpoint_signing_key))


# ------------------------------------------------------------------------------------------ torch files
def _refusal(exc: pickle.UnpicklingError) -> str | None:
    """What a weights-only load refused (``Unsupported global: GLOBAL x.y``...), or None for another failure."""
    text = str(exc)
    if "Weights only load failed" not in text:
        return None
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip().split(" was not an allowed global")[0]
    return "a global outside the allowlist"


@contextmanager
def _only_safe_types() -> Iterator[None]:
    """Admit :data:`SAFE_TYPES` and nothing else: other libraries register process-wide safe globals (importing
    megatron.core admits numpy's array reconstructors), which would otherwise widen what a checkpoint may ask for."""
    others = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with torch.serialization.safe_globals(SAFE_TYPES):
            yield
    finally:
        torch.serialization.add_safe_globals(others)


def load_weights(source: str | BinaryIO, what: str) -> Any:
    """``torch.load(source, weights_only=True)`` with :data:`SAFE_TYPES` only; a refused global is an
    :class:`UnsafeCheckpointError` naming ``what``, unless the policy trusts checkpoint code."""
    try:
        with _only_safe_types():
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _refusal(e)
        if refused is None:
            raise
        if not _trust.trust_code:
            raise UnsafeCheckpointError(
                f"{what} is not plain data: it asks for {refused}, which loading it would run (a tampered file, "
                f"or one saved before checkpoints were written as plain data); not loaded. If the checkpoint comes "
                f"from a source you trust, pass --trust-checkpoint-code") from None
    if not isinstance(source, str):
        source.seek(0)
    return torch.load(source, map_location="cpu", weights_only=False)


def load_torch(path: str) -> Any:
    """A checkpoint's torch file as data (:func:`load_weights`); an error names the file, the rank and what
    was found (missing, truncated, not a torch file, not plain data)."""
    if not os.path.exists(path):
        raise CheckpointIOError(f"{path} is missing: incomplete checkpoint (read by rank {current_rank()})")
    try:
        return load_weights(path, f"{path} (read by rank {current_rank()})")
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - the weights-only unpickler fails on damage in many ways (KeyError...)
        raise CheckpointIOError(f"cannot load {path} on rank {current_rank()}: {describe_unreadable(path, e)}") \
            from None


# ------------------------------------------------------------------------------------- DCP .metadata
def _admitted(module: str, name: str) -> bool:
    """Whether the global ``module.name`` may appear in DCP's metadata (checked before anything is imported)."""
    if module in _DCP_MODULES:
        import importlib

        obj = getattr(importlib.import_module(module), name, None)
        return (isinstance(obj, type) and obj.__module__.startswith("torch.distributed.checkpoint.")
                and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)))  # not enum.Enum itself
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    if module in ("pathlib", "pathlib._local"):
        return name in _PATHS
    return (module, name) in {("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise pickle.UnpicklingError(f"global {module}.{name}, which is not one of DCP's metadata types")
        return super().find_class(module, name)


def load_dcp_metadata(file: BinaryIO, what: str) -> Metadata:
    """DCP's ``Metadata`` from ``file`` through the restricted unpickler (the policy may trust it instead)."""
    try:
        md = _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as e:
        if "not one of DCP's metadata types" not in str(e):
            raise
        if not _trust.trust_code:
            raise UnsafeCheckpointError(f"{what} is not plain DCP metadata: it asks for {str(e)[len('global '):]}, "
                                        f"which loading it would run; not loaded. If the checkpoint comes from a "
                                        f"source you trust, pass --trust-checkpoint-code") from None
        file.seek(0)
        md = pickle.load(file)  # noqa: S301 - trusted by the user's explicit flag
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{what} does not hold DCP metadata (found {type(md).__name__})")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``.metadata`` goes through :func:`load_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = os.path.join(str(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            md = load_dcp_metadata(f, path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = getattr(self, "load_id", None)
        return md

"""Content hashes of checkpoint files: computed as the bytes are written, recorded per iteration, verified on load.

Every file a save writes goes through a :class:`HashingStream` (``torch.save`` of the per-rank files,
``metadata.json``, the tokenizer copy) or, for ``torch_dist``, through DCP's own writer with a hashing file
system (:class:`HashingFileSystemWriter`: the ``.distcp`` files and DCP's ``.metadata``). Each rank keeps
``{path: FileHash}`` for what it wrote; before the save is published the records are gathered to rank 0
(:func:`gather_records`, collective), which writes ``checksums.json`` into the iteration directory::

    {"format": 1, "algorithm": "xxh3_64", "files": {"mp_rank_00/model_optim_rng.pt":
     {"hash": "...", "bytes": 123, "rank": 0}, ...}, "manifest_hash": "..."}

``manifest_hash`` is the hash of the canonical JSON of ``algorithm`` and ``files``, so a damaged manifest is
found too. The hash is xxHash's XXH3-64 when the ``xxhash`` package is installed, else BLAKE2b with an
8-byte digest (stdlib); the manifest names the one used. Loading verifies every file (the files split over
the ranks, :func:`verify_share`); a checkpoint saved before hashes were recorded (no ``checksums.json``)
loads with one line saying so.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from ..errors import current_rank
from .file_io import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    CheckpointError,
    FileHash,
    HashingStream,
    hash_file,
    new_hasher,
    read_json,
    write_text,
)

MANIFEST = "checksums.json"
MANIFEST_FORMAT = 1


class _HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every stream opened for writing into ``records`` (by path)."""

    def __init__(self, records: dict[str, FileHash]) -> None:
        super().__init__()
        self.records = records

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = HashingStream(stream)
            yield hashing
        self.records[os.path.abspath(str(path))] = hashing.result()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        old = os.path.abspath(str(path))
        if old in self.records:  # DCP writes .metadata.tmp and renames it
            self.records[os.path.abspath(str(new_path))] = self.records.pop(old)


class HashingFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose files are hashed as written; ``records`` maps path -> FileHash."""

    def __init__(self, path: str, **kwargs) -> None:
        super().__init__(path, **kwargs)
        self.records: dict[str, FileHash] = {}
        self.fs = _HashingFileSystem(self.records)


# ------------------------------------------------------------------------------------------ manifest
def gather_records(records: dict[str, FileHash], group=None) -> dict[str, tuple[FileHash, int]] | None:
    """Collective: every rank's ``{path: FileHash}`` to rank 0 as ``{path: (FileHash, writing rank)}``
    (None on the other ranks)."""
    rank = current_rank()
    mine = {p: (h, rank) for p, h in records.items()}
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return mine
    out: list[Any] = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(mine, out, dst=0, group=group)
    if rank != 0:
        return None
    merged: dict[str, tuple[FileHash, int]] = {}
    for part in out:
        merged.update(part or {})
    return merged


def _manifest_hash(algorithm: str, files: dict) -> str:
    h = new_hasher(algorithm)
    h.update(json.dumps({"algorithm": algorithm, "files": files}, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def manifest_for(iteration_dir: str, records: dict[str, tuple[FileHash, int]],
                 algorithm: str = DEFAULT_ALGORITHM) -> dict:
    """The ``checksums.json`` object for the files in ``records`` (paths under ``iteration_dir``)."""
    files = {os.path.relpath(p, iteration_dir).replace(os.sep, "/"): {"hash": h.digest, "bytes": h.nbytes,
                                                                       "rank": r}
             for p, (h, r) in sorted(records.items())}
    return {"format": MANIFEST_FORMAT, "algorithm": algorithm, "files": files,
            "manifest_hash": _manifest_hash(algorithm, files)}


def write_manifest(iteration_dir: str, records: dict[str, tuple[FileHash, int]]) -> None:
    """Rank 0: write ``checksums.json`` into ``iteration_dir`` (the save's ``.tmp`` before it is published)."""
    write_text(os.path.join(iteration_dir, MANIFEST), json.dumps(manifest_for(iteration_dir, records), indent=1),
               fsync=True)


def hash_tree(iteration_dir: str) -> dict[str, tuple[FileHash, int]]:
    """Records of every file under ``iteration_dir`` hashed as it is now (the offline converters' outputs)."""
    out = {}
    for d, _, names in os.walk(iteration_dir):
        for n in names:
            if n != MANIFEST:
                p = os.path.join(d, n)
                out[p] = (hash_file(p), 0)
    return out


@dataclass
class Mismatch:
    """A file that does not verify: ``cause`` is missing / truncated / hash mismatch / unreadable."""

    path: str
    cause: str
    expected: str
    found: str
    rank: int

    def describe(self) -> str:
        return (f"checkpoint file {self.path} does not verify ({self.cause}): expected hash {self.expected}, "
                f"found {self.found} (checked by rank {self.rank})")


def read_manifest(iteration_dir: str) -> dict | None:
    """The iteration's ``checksums.json``; None when it has none (saved before hashes were recorded).

    A damaged manifest raises :class:`.file_io.CheckpointError` naming it."""
    path = os.path.join(iteration_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        m = read_json(path, "checkpoint content hashes")
    except CheckpointError as e:
        raise CheckpointError(f"{e} (hash mismatch of the manifest itself)") from None
    algorithm, files = m.get("algorithm"), m.get("files")
    if not isinstance(files, dict) or algorithm not in ALGORITHMS and algorithm != "xxh3_64":
        raise CheckpointError(f"checkpoint content hashes {path} are corrupt: unknown algorithm {algorithm!r} or "
                              f"no file list")
    if algorithm in ALGORITHMS and _manifest_hash(algorithm, files) != m.get("manifest_hash"):
        raise CheckpointError(f"checkpoint content hashes {path} are corrupt (hash mismatch of the manifest "
                              f"itself: expected {m.get('manifest_hash')}, found {_manifest_hash(algorithm, files)})")
    return m


def verify_files(iteration_dir: str, manifest: dict, names: list[str], rank: int | None = None) -> list[Mismatch]:
    """Check the listed files of ``manifest`` against the disk; the ones that do not verify."""
    rank = current_rank() if rank is None else rank
    algorithm, out = manifest["algorithm"], []
    for name in names:
        want = manifest["files"][name]
        path = os.path.join(iteration_dir, name)
        expected = f"{algorithm} {want['hash']} ({want['bytes']} bytes)"
        try:
            got = hash_file(path, algorithm)
        except FileNotFoundError:
            out.append(Mismatch(path, "missing", expected, "no file", rank))
            continue
        except OSError as e:
            out.append(Mismatch(path, f"unreadable: {e.strerror or e}", expected, "nothing", rank))
            continue
        if got.digest == want["hash"] and got.nbytes == want["bytes"]:
            continue
        cause = ("truncated" if got.nbytes < want["bytes"] else
                 "longer than written" if got.nbytes > want["bytes"] else "hash mismatch")
        out.append(Mismatch(path, cause, expected, f"{algorithm} {got.digest} ({got.nbytes} bytes)", rank))
    return out


def verify_share(iteration_dir: str, manifest: dict, rank: int, world: int) -> list[Mismatch]:
    """This rank's share of the manifest's files (every ``world``-th, by size order), verified."""
    files = manifest["files"]
    names = sorted(files, key=lambda n: (-files[n]["bytes"], n))[rank::world]
    return verify_files(iteration_dir, manifest, names, rank)


def verify_iteration(iteration_dir: str) -> tuple[dict | None, list[Mismatch]]:
    """(manifest, files that do not verify) of one iteration directory, in one process; (None, []) without
    a manifest."""
    manifest = read_manifest(iteration_dir)
    if manifest is None:
        return None, []
    return manifest, verify_files(iteration_dir, manifest, sorted(manifest["files"]))

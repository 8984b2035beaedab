"""Content hashes of checkpoint files: computed as the bytes are written, recorded per iteration, verified on load.

Every file a save writes goes through a :class:`HashingStream` (``torch.save`` of the per-rank files,
``metadata.json``, the tokenizer copy) or, for ``torch_dist``, through DCP's own writer with a hashing file
system (:class:`HashingFileSystemWriter`: the ``.distcp`` files and DCP's ``.metadata``). Each rank keeps
``{path: FileHash}`` for what it wrote; before the save is published the records are gathered to rank 0
(:func:`gather_records`, collective), which writes ``checksums.json`` into the iteration directory::

    {"format": 1, "algorithm": "blake2b_256", "files": {"mp_rank_00/model_optim_rng.pt":
     {"hash": "...", "bytes": 123, "rank": 0}, ...}, "manifest_hash": "...", "hmac_sha256": "..."}

``manifest_hash`` is the hash of the canonical JSON of ``algorithm`` and ``files``, so a damaged manifest is
found too. New saves hash with BLAKE2b-256 (hashlib, always installed); older ``blake2b_64`` manifests verify,
and ``xxh3_64`` ones where the ``xxhash`` package is installed. ``hmac_sha256`` is present when the save had a
``--checkpoint-signing-key``: an HMAC-SHA256 of the same canonical JSON.

Reading a manifest (:func:`read_manifest`) is strict: an unknown algorithm is an :class:`UnverifiableError`
(the policy's ``allow_unverified`` turns it into a warning, as it does a missing manifest), and every name must
be a plain relative path inside the iteration directory (no ``..``, no absolute path, no empty or ``.``
component). Verifying opens each file without following links (``O_NOFOLLOW``, every directory on the way
checked with ``lstat``) and hashes it only when it is a regular file, so no entry can make a load read
``/dev/zero``, a FIFO or a file outside the checkpoint. A file on disk that the manifest does not list is an
error too: a load reads only files whose bytes were recorded.

What this proves: without a key, that the files are the ones that were written, unless someone rewrote both a
file and the manifest (anyone can recompute an unkeyed hash). With a key, also that whoever wrote the manifest
held the key. It never proves that a file is safe to unpickle: that is :mod:`.safe_load`'s job.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import stat
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
    hash_stream,
    new_hasher,
    read_json,
    write_text,
)
from .safe_load import current_trust

MANIFEST = "checksums.json"
MANIFEST_FORMAT = 1
SIGNATURE = "hmac_sha256"
_OPTIONAL_ALGORITHMS = {"xxh3_64": "it needs the xxhash package: pip install xxhash"}  # read when installed


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


def _canonical(algorithm: str, files: dict) -> bytes:
    return json.dumps({"algorithm": algorithm, "files": files}, sort_keys=True, separators=(",", ":")).encode()


def _manifest_hash(algorithm: str, files: dict) -> str:
    h = new_hasher(algorithm)
    h.update(_canonical(algorithm, files))
    return h.hexdigest()


def _signature(key: bytes, algorithm: str, files: dict) -> str:
    return hmac.new(key, _canonical(algorithm, files), hashlib.sha256).hexdigest()


def manifest_for(iteration_dir: str, records: dict[str, tuple[FileHash, int]],
                 algorithm: str = DEFAULT_ALGORITHM, signing_key: bytes | None = None) -> dict:
    """The ``checksums.json`` object for the files in ``records`` (paths under ``iteration_dir``)."""
    files = {os.path.relpath(p, iteration_dir).replace(os.sep, "/"): {"hash": h.digest, "bytes": h.nbytes,
                                                                       "rank": r}
             for p, (h, r) in sorted(records.items())}
    out = {"format": MANIFEST_FORMAT, "algorithm": algorithm, "files": files,
           "manifest_hash": _manifest_hash(algorithm, files)}
    if signing_key is not None:
        out[SIGNATURE] = _signature(signing_key, algorithm, files)
    return out


def write_manifest(iteration_dir: str, records: dict[str, tuple[FileHash, int]]) -> None:
    """Rank 0: write ``checksums.json`` into ``iteration_dir`` (the save's ``.tmp`` before it is published),
    signed when the process's policy holds a signing key."""
    manifest = manifest_for(iteration_dir, records, signing_key=current_trust().signing_key)
    write_text(os.path.join(iteration_dir, MANIFEST), json.dumps(manifest, indent=1), fsync=True)


def hash_tree(iteration_dir: str) -> dict[str, tuple[FileHash, int]]:
    """Records of every file under ``iteration_dir`` hashed as it is now (the offline converters' outputs)."""
    out = {}
    for d, _, names in os.walk(iteration_dir):
        for n in names:
            p = os.path.join(d, n)
            if os.path.relpath(p, iteration_dir) != MANIFEST:
                out[p] = (hash_file(p), 0)
    return out


class UnverifiableError(CheckpointError):
    """A checkpoint whose files cannot be verified: no manifest, or an algorithm this installation lacks."""


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


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain relative path inside an iteration directory (None when it is)."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if name.startswith("/") or "\\" in name or "\0" in name or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "a path that leaves the checkpoint (..)"
    if any(p in ("", ".") for p in parts):
        return "not a normalised relative path"
    return None


def _check_entries(path: str, algorithm: str, files: dict) -> None:
    for name, want in files.items():
        problem = name_problem(name)
        if problem is not None:
            raise CheckpointError(f"checkpoint content hashes {path} list {name!r}, which is {problem}: a manifest "
                                  f"names only files inside its iteration directory (a tampered manifest)")
        if not (isinstance(want, dict) and isinstance(want.get("hash"), str) and isinstance(want.get("bytes"), int)
                and want["bytes"] >= 0):
            raise CheckpointError(f"checkpoint content hashes {path} are corrupt: the entry of {name!r} is not "
                                  f"{{'hash': str, 'bytes': int}}")


def read_manifest(iteration_dir: str) -> dict | None:
    """The iteration's ``checksums.json``, checked (see the module docstring); None when it has none.

    A damaged manifest raises :class:`.file_io.CheckpointError` naming it; an unknown algorithm an
    :class:`UnverifiableError`."""
    path = os.path.join(iteration_dir, MANIFEST)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint content hashes {path}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"checkpoint content hashes {path} are not a regular file (a link or a device)")
    try:
        m = read_json(path, "checkpoint content hashes")
    except CheckpointError as e:
        raise CheckpointError(f"{e} (hash mismatch of the manifest itself)") from None
    algorithm, files = m.get("algorithm"), m.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint content hashes {path} are corrupt: no file list")
    if algorithm not in ALGORITHMS:
        if algorithm in _OPTIONAL_ALGORITHMS:  # a real algorithm whose package is not installed
            raise UnverifiableError(
                f"checkpoint content hashes {path} use the hash algorithm {algorithm!r}, which this installation "
                f"cannot check ({_OPTIONAL_ALGORITHMS[algorithm]}): its files cannot be verified (new saves use "
                f"{DEFAULT_ALGORITHM}); pass --allow-unverified-checkpoint to load it anyway")
        raise CheckpointError(f"checkpoint content hashes {path} are corrupt: unknown hash algorithm {algorithm!r} "
                              f"(hash mismatch of the manifest itself, or a manifest of a newer version)")
    if _manifest_hash(algorithm, files) != m.get("manifest_hash"):
        raise CheckpointError(f"checkpoint content hashes {path} are corrupt (hash mismatch of the manifest "
                              f"itself: expected {m.get('manifest_hash')}, found {_manifest_hash(algorithm, files)})")
    _check_entries(path, algorithm, files)
    return m


def check_signature(iteration_dir: str, manifest: dict, key: bytes | None) -> None:
    """With a signing key: the manifest must carry a matching HMAC, else an error naming it."""
    if key is None:
        return
    path = os.path.join(iteration_dir, MANIFEST)
    signed = manifest.get(SIGNATURE)
    if not isinstance(signed, str):
        raise CheckpointError(f"checkpoint content hashes {path} are not signed, but --checkpoint-signing-key asks "
                              f"for a signed checkpoint: its origin cannot be checked")
    if not hmac.compare_digest(signed, _signature(key, manifest["algorithm"], manifest["files"])):
        raise CheckpointError(f"checkpoint content hashes {path} do not match their signature under "
                              f"--checkpoint-signing-key: the checkpoint was altered, or signed with another key")


def unlisted_files(iteration_dir: str, manifest: dict) -> list[str]:
    """Entries under ``iteration_dir`` (files, links, devices; links are not followed) that the manifest does
    not list, besides the manifest itself."""
    listed = set(manifest["files"]) | {MANIFEST}
    out = []
    for d, dirs, names in os.walk(iteration_dir):
        for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            rel = os.path.relpath(os.path.join(d, n), iteration_dir).replace(os.sep, "/")
            if rel not in listed:
                out.append(rel)
    return sorted(out)


def _open_listed(iteration_dir: str, name: str) -> int:
    """A read-only descriptor of ``name`` inside ``iteration_dir``: no link followed on the way, a regular file.
    OSError (FileNotFoundError for a missing one) otherwise."""
    parts = name.split("/")
    here = iteration_dir
    for part in parts[:-1]:
        here = os.path.join(here, part)
        if not stat.S_ISDIR(os.lstat(here).st_mode):
            raise OSError(errno.ENOTDIR, "a path component is a link or not a directory")
    fd = os.open(os.path.join(iteration_dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def verify_files(iteration_dir: str, manifest: dict, names: list[str], rank: int | None = None) -> list[Mismatch]:
    """Check the listed files of ``manifest`` against the disk; the ones that do not verify."""
    rank = current_rank() if rank is None else rank
    algorithm, out = manifest["algorithm"], []
    for name in names:
        want = manifest["files"][name]
        path = os.path.join(iteration_dir, name)
        expected = f"{algorithm} {want['hash']} ({want['bytes']} bytes)"
        try:
            fd = _open_listed(iteration_dir, name)
        except FileNotFoundError:
            out.append(Mismatch(path, "missing", expected, "no file", rank))
            continue
        except OSError as e:
            what = "a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
            out.append(Mismatch(path, f"unreadable: {what}", expected, "nothing", rank))
            continue
        with os.fdopen(fd, "rb", buffering=0) as f:
            got = hash_stream(f, algorithm)
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


def check_listing(iteration_dir: str, manifest: dict) -> None:
    """Every entry on disk is listed (else an error naming the first ones), and the signature holds."""
    extra = unlisted_files(iteration_dir, manifest)
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise CheckpointError(f"checkpoint {iteration_dir} holds {', '.join(extra[:3])}{more}, which its content "
                              f"hashes ({MANIFEST}) do not list: a load reads only files whose bytes were recorded "
                              f"(remove them, or restore the checkpoint)")
    check_signature(iteration_dir, manifest, current_trust().signing_key)


def verify_iteration(iteration_dir: str) -> tuple[dict | None, list[Mismatch]]:
    """(manifest, files that do not verify) of one iteration directory, in one process; (None, []) without
    a manifest. A manifest that cannot be trusted (see :func:`read_manifest`, :func:`check_listing`) raises."""
    manifest = read_manifest(iteration_dir)
    if manifest is None:
        return None, []
    check_listing(iteration_dir, manifest)
    return manifest, verify_files(iteration_dir, manifest, sorted(manifest["files"]))

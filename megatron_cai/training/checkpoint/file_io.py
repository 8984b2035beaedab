"""Checkpoint file I/O that names the file: every read and write of a checkpoint goes through here.

Every write is hashed as its bytes go out (:class:`HashingStream`: BLAKE2b-256 of the standard library);
:mod:`.integrity` records and verifies the hashes. Reads of torch files are in :mod:`.safe_load`.

An I/O problem becomes a ``CheckpointIOError`` that says which file, which rank, and what was found:
a missing file, an empty or truncated ``.pt``, something that is not a torch file, invalid JSON, or a
full disk (ENOSPC, with the bytes the file needed and the bytes free). Writes go to ``path.tmp`` and
are renamed, so a failed write never replaces a good file; the partial temporary file is removed.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RankLocalError, UserError, current_rank

_ZIP_MAGIC = b"PK\x03\x04"
_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


# ------------------------------------------------------------------------------- content hashes
try:  # XXH3-64 manifests of older saves verify where the xxhash package is installed
    import xxhash
except ImportError:  # pragma: no cover - the GPU validation machine takes no installs
    xxhash = None

# BLAKE2b (hashlib: always there) with a 256-bit digest for every new save: collision-resistant, so a signed
# manifest (:mod:`.integrity`) binds the files' bytes. blake2b_64 and xxh3_64 are read for older saves.
ALGORITHMS: dict[str, Callable[[], Any]] = {"blake2b_256": lambda: hashlib.blake2b(digest_size=32),
                                            "blake2b_64": lambda: hashlib.blake2b(digest_size=8)}
if xxhash is not None:
    ALGORITHMS["xxh3_64"] = xxhash.xxh3_64
DEFAULT_ALGORITHM = "blake2b_256"
_OVERLAP_BYTES = 1 << 22      # writes this large hash in a helper thread while the bytes go to the file
_READ_CHUNK = 1 << 24


@dataclass(frozen=True)
class FileHash:
    """A file's content hash (hex) and size, as written."""

    digest: str
    nbytes: int


def new_hasher(algorithm: str = DEFAULT_ALGORITHM):
    return ALGORITHMS[algorithm]()


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash")
        return _pool


class HashingStream:
    """A binary file open for writing that hashes every byte written to it, in order.

    A large write is hashed in a helper thread while the main thread writes it (both release the GIL), so
    the hash adds little to a write that the disk bounds."""

    def __init__(self, f, algorithm: str = DEFAULT_ALGORITHM) -> None:
        self._f = f
        self._h = new_hasher(algorithm)
        self._n = 0
        self.name = str(getattr(f, "name", ""))  # the path, for messages

    def write(self, b) -> int:
        view = memoryview(b).cast("B") if not isinstance(b, (bytes, bytearray)) else b
        if len(view) >= _OVERLAP_BYTES:
            pending = _hash_pool().submit(self._h.update, view)
            try:
                n = self._f.write(view)
            finally:
                pending.result()
        else:
            self._h.update(view)
            n = self._f.write(view)
        self._n += len(view)
        return n if n is not None else len(view)

    def result(self) -> FileHash:
        return FileHash(self._h.hexdigest(), self._n)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self._f.closed

    def __enter__(self) -> HashingStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_hashed(path: str, write: Callable[[HashingStream], Any], *, fsync: bool = False) -> FileHash:
    """Open ``path`` for writing, let ``write`` fill it through a :class:`HashingStream`; its hash."""
    with open(path, "wb") as f:
        stream = HashingStream(f)
        write(stream)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return stream.result()


def copy_hashed(src: str, dst: str) -> FileHash:
    """Copy ``src`` to ``dst`` (and its mode), hashing the bytes as they are written."""
    def write(stream: HashingStream) -> None:
        with open(src, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                stream.write(chunk)
    out = write_hashed(dst, write)
    os.chmod(dst, os.stat(src).st_mode & 0o777)
    return out


def hash_stream(f, algorithm: str = DEFAULT_ALGORITHM) -> FileHash:
    """The hash of what is left to read in the unbuffered binary file ``f``."""
    h, n = new_hasher(algorithm), 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    while k := f.readinto(buf):
        h.update(view[:k])
        n += k
    return FileHash(h.hexdigest(), n)


def hash_file(path: str, algorithm: str = DEFAULT_ALGORITHM) -> FileHash:
    """The hash of a file as it is on disk now (the converters, the tokenizer's content hash)."""
    with open(path, "rb", buffering=0) as f:
        return hash_stream(f, algorithm)


class CheckpointError(UserError, RuntimeError):
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


def save_torch(obj: Any, path: str) -> FileHash:
    """``torch.save`` to ``path.tmp`` and rename; returns the content hash of the bytes written
    (:mod:`.integrity`). An error names the file (see the module docstring)."""
    tmp = path + ".tmp"
    try:
        written = write_hashed(tmp, lambda stream: torch.save(obj, stream))
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        _remove_quietly(tmp)
        raise CheckpointIOError(describe_write_error(path, e, payload_nbytes(obj))) from None
    return written


def write_text(path: str, text: str, *, fsync: bool = False) -> FileHash:
    """Write a small text/JSON file atomically; returns its content hash; an error names the file."""
    tmp = path + ".tmp"
    data = text.encode()
    try:
        written = write_hashed(tmp, lambda stream: stream.write(data), fsync=fsync)
        os.replace(tmp, path)
    except OSError as e:
        _remove_quietly(tmp)
        raise CheckpointIOError(describe_write_error(path, e, len(data))) from None
    return written


def write_json(path: str, obj: Any) -> FileHash:
    return write_text(path, json.dumps(obj, indent=1, default=str))


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


def describe_unreadable(path: str, exc: BaseException) -> str:
    """What is wrong with a torch file that would not load (empty, truncated, not a torch file)."""
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

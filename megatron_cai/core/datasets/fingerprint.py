"""Content fingerprints of a corpus prefix: the key of its index caches and of the record a checkpoint keeps.

A prefix's fingerprint is a hash of its whole ``.idx`` and a *sampled* hash of its ``.bin``:

* ``.idx``: every byte (blake2b-128). The document boundaries, sizes and dtype live here, so any change to
  the document structure is always seen.
* ``.bin``: its size and :data:`SAMPLES` windows of :data:`SAMPLE_BYTES` bytes at fixed, evenly spread
  offsets (the first window at 0, the last one ending at the end of the file). A ``.bin`` up to
  ``SAMPLES * SAMPLE_BYTES`` bytes (4 MiB) is hashed whole.

Cost per prefix: the ``.idx`` size plus at most 4 MiB, whatever the corpus size (a 1 TB ``.bin`` of 2 KiB
documents has a ~5 GB ``.idx``; of 64 KiB ones a ~0.2 GB ``.idx``). A process computes a prefix's
fingerprint once (memoized on the files' inode, size, mtime and ctime; a write changes the ctime, see
:func:`cached_file_fingerprint`).

What it guarantees: a changed ``.idx``, a changed ``.bin`` size, and any change of a ``.bin`` up to 4 MiB are
always seen; for a larger ``.bin``, a change that touches any sampled window is seen: a re-tokenized,
re-shuffled or different corpus of the same size changes nearly every window. It does not see a same-size
edit confined to bytes between the windows of a ``.bin`` over 4 MiB (say one document rewritten in place with
the same length). Modification times are not part of it: a copy with its mtime kept is no disguise.
"""
from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass

from megatron_cai.core.datasets.indexed_dataset import get_bin_path, get_idx_path

SAMPLES = 64
SAMPLE_BYTES = 64 * 1024
ALGORITHM = "blake2b-128"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileFingerprint:
    """``digest`` of one file (whole or sampled), its size, and the bytes read to compute it."""

    digest: str
    size: int
    sampled: bool
    bytes_read: int


def _hasher():
    return hashlib.blake2b(digest_size=16)


def sample_offsets(size: int, samples: int = SAMPLES, sample_bytes: int = SAMPLE_BYTES) -> list[int]:
    """Where the windows of a file of ``size`` bytes start; ``[]`` when the file is hashed whole."""
    if size <= samples * sample_bytes:
        return []
    span = size - sample_bytes
    return [i * span // (samples - 1) for i in range(samples)]


def file_fingerprint(path: str, sampled: bool, samples: int = SAMPLES,
                     sample_bytes: int = SAMPLE_BYTES) -> FileFingerprint:
    """The content fingerprint of ``path``: every byte, or (``sampled``) the windows of :func:`sample_offsets`."""
    h = _hasher()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        offsets = sample_offsets(size, samples, sample_bytes) if sampled else []
        read = 0
        if offsets:
            for off in offsets:
                f.seek(off)
                block = f.read(sample_bytes)
                h.update(block)
                read += len(block)
        else:
            while block := f.read(_CHUNK):
                h.update(block)
                read += len(block)
    return FileFingerprint(f"{ALGORITHM}:{h.hexdigest()}", size, bool(offsets), read)


@functools.lru_cache(maxsize=1024)
def _fingerprint_of(path: str, sampled: bool, dev: int, ino: int, size: int, mtime_ns: int,
                    ctime_ns: int) -> FileFingerprint:
    return file_fingerprint(path, sampled)


def cached_file_fingerprint(path: str, sampled: bool) -> FileFingerprint:
    """:func:`file_fingerprint`, computed once per process for the same file (inode, size, mtime and ctime).

    Any write changes the ctime, but only to the kernel's clock tick (a few ms): a file rewritten within the tick
    of its previous change can keep its memoized fingerprint inside one process. A new process reads afresh;
    :func:`forget_cached_fingerprints` forgets."""
    st = os.stat(path)
    return _fingerprint_of(os.path.abspath(path), sampled, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                           st.st_ctime_ns)


def forget_cached_fingerprints() -> None:
    """Drop every memoized fingerprint of this process (after rewriting a corpus file in place)."""
    _fingerprint_of.cache_clear()


def prefix_fingerprint(prefix: str) -> dict[str, str]:
    """``{"idx": whole-file digest, "bin": sampled digest}`` of a corpus prefix (the cache key and the record)."""
    return {"idx": cached_file_fingerprint(get_idx_path(prefix), sampled=False).digest,
            "bin": cached_file_fingerprint(get_bin_path(prefix), sampled=True).digest}


"""Megatron-LM's MMIDIDX indexed dataset: a ``.bin`` of raw token ids and an ``.idx`` index.

The format is byte-compatible with Megatron-LM, so corpora preprocessed by either codebase load in the
other. ``<prefix>.bin`` is the concatenation of all sequences in one numpy dtype (C order, no header);
``<prefix>.idx`` is little-endian::

    offset        size      field
    0             9         magic b"MMIDIDX\\x00\\x00"
    9             8         version, <Q, always 1
    17            1         dtype code, <B (see DType)
    18            8         sequence count N, <Q
    26            8         document count D+1, <Q (length of document_indices, leading 0 included)
    34            4N        sequence_lengths   int32[N]   (tokens per sequence)
    34+4N         8N        sequence_pointers  int64[N]   (byte offset of each sequence in .bin)
    34+12N        8(D+1)    document_indices   int64[D+1] (sequence boundaries: 0, ..., N)

Without sentence splitting a sequence is a document (``document_indices == 0..N``). Every load
validates the index against both files (vectorized, O(N)) and raises :class:`IndexedDatasetError`
naming the file and the problem, so a truncated or corrupt file never yields garbage tokens.
"""
from __future__ import annotations

import enum
import os
import shutil
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_cai.core.datasets.temp_files import remove_quietly, temp_path

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # = 34 bytes
_CHECK_CHUNK = 1 << 22  # elements per validation chunk (bounds the temporary memory)


class IndexedDatasetError(ValueError):
    """A ``.idx``/``.bin`` pair is missing, truncated or inconsistent."""


class DType(enum.Enum):
    """Megatron-LM's dtype codes stored in byte 17 of the ``.idx`` file."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Any) -> int:
        """The code of a numpy dtype (``np.uint16``, ``np.dtype("int32")``, ...)."""
        return cls[np.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> type[np.number]:
        """The numpy scalar type of a code; ``ValueError`` for an unknown code."""
        return getattr(np, cls(value).name)

    @staticmethod
    def size(key: Any) -> int:
        """Bytes per element of a code or a numpy dtype."""
        if isinstance(key, DType):
            key = key.value
        if isinstance(key, int):
            key = DType.dtype_from_code(key)
        return np.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(vocab_size: int | None) -> type[np.number]:
        """Megatron's choice of token dtype: uint16 for vocabularies under 65500, else int32 (its margin keeps
        the files of a 65500..65536-token vocabulary identical to Megatron's)."""
        if vocab_size is not None and vocab_size < 65500:
            return np.uint16
        return np.int32


def get_idx_path(path_prefix: str) -> str:
    """``<prefix>.idx``."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """``<prefix>.bin``."""
    return path_prefix + ".bin"


def _fail(path: str, what: str) -> IndexedDatasetError:
    return IndexedDatasetError(f"{path}: {what}")


class _IndexReader:
    """Reads and validates an ``.idx`` file; arrays are read-only views on a memmap."""

    def __init__(self, idx_path: str, bin_size: int, bin_path: str) -> None:
        self.path = idx_path
        file_size = os.path.getsize(idx_path)
        if file_size < _HEADER_SIZE:
            raise _fail(idx_path, f"truncated index: {file_size} bytes, the header alone is {_HEADER_SIZE}")
        with open(idx_path, "rb") as f:
            header = f.read(_HEADER_SIZE)
        magic = header[:9]
        if magic != _INDEX_HEADER:
            raise _fail(idx_path,
                        f"not a Megatron MMIDIDX index (magic {magic!r}, expected {_INDEX_HEADER!r})")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != _VERSION:
            raise _fail(idx_path, f"unsupported index version {version} (expected {_VERSION})")
        (code,) = struct.unpack("<B", header[17:18])
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            known = ", ".join(f"{d.value}={d.name}" for d in DType)
            raise _fail(idx_path, f"unknown dtype code {code} (known: {known})") from None
        self.dtype_size = np.dtype(self.dtype).itemsize
        n, d = struct.unpack("<QQ", header[18:34])
        self.sequence_count, self.document_count = int(n), int(d)
        expected = _HEADER_SIZE + 12 * n + 8 * d
        # Megatron's multimodal variant appends int8 sequence_modes[N]; accept and ignore it.
        if file_size not in (expected, expected + n):
            raise _fail(
                idx_path,
                f"size mismatch: header says {n} sequences and {d} document boundaries, which needs "
                f"{expected} bytes, but the file has {file_size} (truncated or corrupt)",
            )
        if d < 1:
            raise _fail(idx_path, "document count is 0; it must include the leading 0 boundary")
        self._mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buf = memoryview(self._mm)
        off = _HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=n, offset=off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=off)
        off += 8 * n
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=d, offset=off)
        self._validate(bin_size, bin_path)

    def _validate(self, bin_size: int, bin_path: str) -> None:
        """Vectorized O(N) consistency checks against the format and the ``.bin`` size."""
        path, n, size = self.path, self.sequence_count, self.dtype_size
        if bin_size % size:
            raise _fail(bin_path, f"size {bin_size} bytes is not a multiple of the {size}-byte token dtype")
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        expected_ptr = 0
        for beg in range(0, n, _CHECK_CHUNK):
            ln = lengths[beg : beg + _CHECK_CHUNK].astype(np.int64)
            if (ln < 0).any():
                i = beg + int(np.argmax(ln < 0))
                raise _fail(path, f"negative length {int(ln[i - beg])} for sequence {i}")
            ends = np.cumsum(ln * size) + expected_ptr
            starts = ends - ln * size
            bad = pointers[beg : beg + _CHECK_CHUNK] != starts
            if bad.any():
                i = int(np.argmax(bad))
                raise _fail(
                    path,
                    f"sequence {beg + i}: byte pointer {int(pointers[beg + i])} does not follow from the "
                    f"lengths (expected {int(starts[i])}); the index is corrupt",
                )
            expected_ptr = int(ends[-1])
        if expected_ptr != bin_size:
            raise _fail(
                bin_path,
                f"size mismatch: the index {path} describes {expected_ptr} bytes "
                f"({expected_ptr // size} tokens) but the file has {bin_size} bytes "
                f"({'truncated' if bin_size < expected_ptr else 'extra data'}; .idx and .bin do not match)",
            )
        doc = self.document_indices
        if doc[0] != 0 or doc[-1] != n:
            raise _fail(
                path, f"document indices must start at 0 and end at {n}, got {int(doc[0])}..{int(doc[-1])}"
            )
        for beg in range(0, len(doc) - 1, _CHECK_CHUNK):
            step = np.diff(doc[beg : beg + _CHECK_CHUNK + 1])
            if (step < 0).any():
                i = beg + int(np.argmax(step < 0))
                raise _fail(path, f"document indices decrease at position {i + 1} ({int(doc[i])} -> "
                            f"{int(doc[i + 1])}); they must be non-decreasing")


class IndexedDataset:
    """Read-only view of ``<path_prefix>.idx/.bin`` (Megatron MMIDIDX).

    ``len(ds)`` is the number of sequences; ``ds[i]`` a numpy array of its tokens; ``ds[a:b]`` a list of
    arrays; ``ds.get(i, offset, length)`` a slice of one sequence. ``mmap=False`` reads with ``pread``
    instead of mapping the ``.bin`` (useful on file systems where mmap is slow).
    """

    def __init__(self, path_prefix: str, mmap: bool = True) -> None:
        self.path_prefix = path_prefix
        self.mmap = mmap
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = get_idx_path(self.path_prefix), get_bin_path(self.path_prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise IndexedDatasetError(
                    f"{p}: file not found (a dataset prefix names <prefix>.idx and <prefix>.bin, "
                    f"e.g. the '<output-prefix>_text_document' written by tools/preprocess_data.py)"
                )
        bin_size = os.path.getsize(bin_path)
        self.index = _IndexReader(idx_path, bin_size, bin_path)
        self._bin_path = bin_path
        self._bin_mm: np.memmap | None = None
        self._fd: int | None = None
        if self.mmap and bin_size > 0:
            self._bin_mm = np.memmap(bin_path, mode="r", dtype=np.uint8)
            self._bin_buffer = memoryview(self._bin_mm)
        elif not self.mmap:
            self._fd = os.open(bin_path, os.O_RDONLY)

    # Pickling (DataLoader workers under spawn) reopens the files by path.
    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix, "mmap": self.mmap}

    def __setstate__(self, state: dict) -> None:
        self.path_prefix, self.mmap = state["path_prefix"], state["mmap"]
        self._open()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    @property
    def dtype(self) -> type[np.number]:
        """Token dtype (numpy scalar type)."""
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32[N] tokens per sequence."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64[N] byte offset of each sequence in the ``.bin``."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64[D+1] sequence index where each document starts (leading 0, trailing N)."""
        return self.index.document_indices

    def __len__(self) -> int:
        return self.index.sequence_count

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        if count == 0:
            return np.empty(0, dtype=self.dtype)
        if self._bin_mm is not None:
            return np.frombuffer(self._bin_buffer, dtype=self.dtype, count=count, offset=byte_offset)
        nbytes = count * self.index.dtype_size
        data = os.pread(self._fd, nbytes, byte_offset)
        if len(data) != nbytes:
            raise _fail(self._bin_path, f"short read at byte {byte_offset} (file changed after loading?)")
        return np.frombuffer(data, dtype=self.dtype)

    def _check_index(self, idx: int) -> int:
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence index {idx} out of range for {n} sequences in {self.path_prefix}")
        return idx

    def __getitem__(self, idx: int | np.integer | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, (int, np.integer)):
            i = self._check_index(int(idx))
            return self._read(int(self.sequence_pointers[i]), int(self.sequence_lengths[i]))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("IndexedDataset slices must be contiguous (step 1)")
            if stop <= start:
                return []
            lengths = self.sequence_lengths[start:stop].astype(np.int64)
            flat = self._read(int(self.sequence_pointers[start]), int(lengths.sum()))
            return np.split(flat, np.cumsum(lengths)[:-1])
        raise TypeError(f"IndexedDataset indices must be int or slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        i = self._check_index(int(idx))
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(
                f"get({i}, offset={offset}, length={length}) is outside sequence {i} of length {seq_len}"
            )
        return self._read(int(self.sequence_pointers[i]) + offset * self.index.dtype_size, length)

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """True when both ``<prefix>.idx`` and ``<prefix>.bin`` exist."""
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


def write_index(idx_path: str, dtype: Any, sequence_lengths: Sequence[int] | np.ndarray,
                document_indices: Sequence[int] | np.ndarray, publish: bool = True) -> str:
    """Write an ``.idx`` atomically (temporary file + rename); pointers follow from the lengths.

    Returns the path written: ``idx_path``, or with ``publish=False`` the temporary file, for the caller to
    rename. A failed write (a full disk) leaves no temporary file."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError("sequence lengths must fit in int32")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    tmp = temp_path(idx_path)
    try:
        with open(tmp, "wb") as f:
            f.write(_INDEX_HEADER)
            f.write(struct.pack("<Q", _VERSION))
            f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(docs)))
            f.write(lengths.astype("<i4").tobytes(order="C"))
            f.write(pointers.astype("<i8").tobytes(order="C"))
            f.write(docs.astype("<i8").tobytes(order="C"))
    except BaseException:
        remove_quietly(tmp)
        raise
    if not publish:
        return tmp
    os.replace(tmp, idx_path)
    return idx_path


class IndexedDatasetBuilder:
    """Writes a ``.bin`` incrementally and its ``.idx`` in :meth:`finalize`.

    The ``.bin`` is written to a temporary file next to ``bin_path``. :meth:`prepare` closes it and writes
    the ``.idx`` to a temporary file too; :meth:`publish` then renames the ``.bin`` and, last, the ``.idx``
    into place (after removing a stale ``.idx``), so the pair is published together or not at all: a full
    disk or a kill before :meth:`publish` leaves neither, and a reader (which needs both) never sees a new
    ``.bin`` with an old ``.idx``. :meth:`finalize` is both. Call :meth:`abort` (or use the builder as a
    context manager) to discard a failed build: no temporary file is left.
    """

    def __init__(self, bin_path: str, dtype: Any = np.int32) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype).type
        DType.code_from_dtype(self.dtype)  # unknown dtypes fail early
        self._tmp_bin = temp_path(bin_path)
        self._tmp_idx: str | None = None
        self._idx_path: str | None = None
        self._file = open(self._tmp_bin, "wb")  # noqa: SIM115 - closed in finalize/abort
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self._info = np.iinfo(self.dtype) if np.issubdtype(self.dtype, np.integer) else None

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add_item(self, tokens: Any) -> None:
        """Append one sequence (array, list or tensor of token ids)."""
        if hasattr(tokens, "numpy") and not isinstance(tokens, np.ndarray):
            tokens = tokens.detach().cpu().numpy()
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if self._info is not None and arr.size and (arr.min() < self._info.min or arr.max() > self._info.max):
            raise ValueError(
                f"token ids in [{arr.min()}, {arr.max()}] do not fit the {np.dtype(self.dtype).name} "
                f"dataset dtype of {self.bin_path}"
            )
        self._file.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the previous call)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Any, lengths: Sequence[int] | None = None) -> None:
        """Append one document: ``tokens`` split into sequences of ``lengths`` (one sequence if None)."""
        arr = np.asarray(tokens.detach().cpu().numpy() if hasattr(tokens, "detach") else tokens).reshape(-1)
        if lengths is None:
            self.add_item(arr)
        else:
            if sum(lengths) != arr.size:
                raise ValueError(f"lengths sum to {sum(lengths)} but the document has {arr.size} tokens")
            for part in np.split(arr, np.cumsum(lengths)[:-1]):
                self.add_item(part)
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (merge); its dtype must match."""
        other = _IndexReader(get_idx_path(path_prefix), os.path.getsize(get_bin_path(path_prefix)),
                             get_bin_path(path_prefix))
        if other.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {path_prefix}: dtype {np.dtype(other.dtype).name} differs from "
                f"{np.dtype(self.dtype).name}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self._file, length=1 << 24)

    def prepare(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx``, both under temporary names: nothing is published yet."""
        self._file.close()
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()  # sequences added without end_document form a final document
        self._idx_path = idx_path
        self._tmp_idx = write_index(idx_path, self.dtype, self.sequence_lengths, self.document_indices,
                                    publish=False)

    def publish(self) -> None:
        """Move the prepared pair into place: the ``.bin``, then the ``.idx`` (a reader needs both)."""
        if self._tmp_idx is None or self._idx_path is None:
            raise RuntimeError("IndexedDatasetBuilder.publish() before prepare()")
        if os.path.exists(self._idx_path):
            os.remove(self._idx_path)
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self._idx_path)
        self._tmp_idx = None

    def finalize(self, idx_path: str) -> None:
        """:meth:`prepare` and :meth:`publish`."""
        self.prepare(idx_path)
        self.publish()

    def abort(self) -> None:
        """Discard the partial ``.bin`` (and a prepared ``.idx``); nothing is left at the target paths."""
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:  # the buffered tail cannot be written (a full disk): the file goes anyway
                pass
        remove_quietly(self._tmp_bin)
        if self._tmp_idx is not None:
            remove_quietly(self._tmp_idx)
            self._tmp_idx = None

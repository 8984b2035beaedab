"""Sidecar store of sparse teacher samples, aligned with the samples of a preprocessed GPT dataset.

Layout of a store directory ``PATH/``::

    metadata.json          written once, atomically, when the store is created
    shard_00000.bin        samples [0, shard_size)
    shard_00001.bin        samples [shard_size, 2 * shard_size)
    ...                    the last shard may hold fewer samples

``metadata.json`` (``format_version`` 1)::

    {"format": "megatron-cai-teacher-samples", "format_version": 1,
     "sampler": "gumbel" | "topk",       # how the ids were chosen (gumbel_topk / topk_select)
     "k": 32, "tau": 1.0, "vocab_size": 32000, "seed": 1234,
     "ids_dtype": "uint16" | "int32",    # uint16 when vocab_size <= 65536
     "logits_dtype": "float16" | "bfloat16",
     "shard_size": 1024, "num_shards": 7,
     "dataset": {"path": "...", "idx_fingerprint": "sha256:...", "seq_length": 2048, "num_samples": 7000},
     "extra": {...}}                     # free-form (teacher checkpoint, iteration, noise scheme, ...)

Sample ``i`` has ``seq_length`` positions; position ``t`` holds the teacher's distribution for the label at
position ``t`` of sample ``i`` (the token that follows input token ``t``). Per position the store keeps the
``k`` ids (decreasing Gumbel key, or decreasing logit for top-k), the raw teacher logits at those ids,
``kappa`` (the (k+1)-th largest key) and ``lse = logsumexp(logits / tau)``; see
:mod:`megatron_cai.core.distillation.gumbel`.

Each ``shard_NNNNN.bin`` is little-endian: a 64-byte header (``b"MCTSHRD1"``, then uint32 format_version,
uint32 shard_index, uint64 first_sample, uint32 num_samples, uint32 seq_length, uint32 k, zero padding),
followed by four arrays, each starting at a multiple of 64 bytes::

    ids     [n, seq_length, k]  ids_dtype
    logits  [n, seq_length, k]  logits_dtype (bfloat16 stored as its raw 16 bits)
    kappa   [n, seq_length]     float32
    lse     [n, seq_length]     float32

A shard is written to ``shard_NNNNN.bin.tmp``, fsynced and renamed into place, so a shard file that exists
with a valid header and the expected size is finished: an interrupted dump resumes by computing only
:meth:`TeacherSamplesWriter.pending_shards`. The draw of a shard is a function of ``(seed, shard index)``
(:func:`shard_seed` for torch generators) or of ``(seed, sample, position)`` (:func:`position_keys` with
:func:`~megatron_cai.core.distillation.gumbel.counter_gumbel`), so any shard can be recomputed exactly.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any

import numpy as np
import torch

__all__ = [
    "FORMAT_VERSION",
    "TeacherSamples",
    "TeacherSamplesError",
    "TeacherSamplesMismatchError",
    "TeacherSamplesWriter",
    "dataset_fingerprint",
    "position_keys",
    "shard_seed",
]

FORMAT = "megatron-cai-teacher-samples"
FORMAT_VERSION = 1
METADATA = "metadata.json"
_MAGIC = b"MCTSHRD1"
_HEADER = struct.Struct("<8sIIQIII")
_HEADER_BYTES = 64
_ALIGN = 64
_LOGITS_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_MAX_OPEN_SHARDS = 64  # memory maps kept open by a reader (each holds a file descriptor)


class TeacherSamplesError(ValueError):
    """A teacher-sample store is malformed, incomplete or used wrongly."""


class TeacherSamplesMismatchError(TeacherSamplesError):
    """A teacher-sample store does not match the dataset, the vocabulary or the requested settings."""


def dataset_fingerprint(idx_path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """``"sha256:<hex>"`` of a dataset's ``.idx`` file (document sizes and offsets identify the corpus)."""
    h = hashlib.sha256()
    with open(idx_path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


def shard_seed(seed: int, shard_index: int) -> int:
    """A 63-bit seed for ``torch.Generator().manual_seed`` derived from (seed, shard index)."""
    digest = hashlib.sha256(f"teacher-samples:{seed}:{shard_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def position_keys(first_sample: int, num_samples: int, seq_length: int) -> torch.Tensor:
    """Row keys ``sample * seq_length + position`` [num_samples, seq_length] for counter-based noise."""
    samples = torch.arange(first_sample, first_sample + num_samples, dtype=torch.int64)
    return samples.unsqueeze(1) * seq_length + torch.arange(seq_length, dtype=torch.int64)


def _ids_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(n: int, seq: int, k: int, ids_dtype: str) -> tuple[dict[str, tuple[int, np.dtype, tuple]], int]:
    """Byte offset, numpy dtype and shape of each array in a shard of n samples; and the file size."""
    specs = [("ids", np.dtype(ids_dtype), (n, seq, k)), ("logits", np.dtype("<u2"), (n, seq, k)),
             ("kappa", np.dtype("<f4"), (n, seq)), ("lse", np.dtype("<f4"), (n, seq))]
    out, off = {}, _HEADER_BYTES
    for name, dt, shape in specs:
        off = _aligned(off)
        out[name] = (off, dt.newbyteorder("<"), shape)
        off += dt.itemsize * int(np.prod(shape))
    return out, off


def _read_metadata(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, METADATA)
    if not os.path.isfile(meta_path):
        raise TeacherSamplesError(f"{path}: not a teacher-sample store (no {METADATA})")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise TeacherSamplesError(f"{meta_path}: format {meta.get('format')!r} version "
                                  f"{meta.get('format_version')!r}; expected {FORMAT!r} "
                                  f"version {FORMAT_VERSION}")
    return meta


def _atomic_write(path: str, data: bytes | list[bytes]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for chunk in data if isinstance(data, list) else [data]:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # make the rename durable
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


class _Store:
    """Shared geometry of a store (metadata only)."""

    def __init__(self, path: str, meta: dict[str, Any]):
        self.path = str(path)
        self.metadata = meta
        self.k: int = meta["k"]
        self.tau: float = meta["tau"]
        self.vocab_size: int = meta["vocab_size"]
        self.seed: int = meta["seed"]
        self.sampler: str = meta["sampler"]
        self.shard_size: int = meta["shard_size"]
        self.num_shards: int = meta["num_shards"]
        self.seq_length: int = meta["dataset"]["seq_length"]
        self.num_samples: int = meta["dataset"]["num_samples"]
        self.logits_dtype: torch.dtype = _LOGITS_DTYPES[meta["logits_dtype"]]

    def __len__(self) -> int:
        return self.num_samples

    def shard_path(self, shard_index: int) -> str:
        return os.path.join(self.path, f"shard_{shard_index:05d}.bin")

    def shard_range(self, shard_index: int) -> tuple[int, int]:
        """Sample indices ``[start, end)`` held by a shard."""
        if not 0 <= shard_index < self.num_shards:
            raise IndexError(f"{self.path}: shard {shard_index} out of range [0, {self.num_shards})")
        start = shard_index * self.shard_size
        return start, min(start + self.shard_size, self.num_samples)

    def _shard_problem(self, shard_index: int) -> str | None:
        """None when the shard file is finished and well-formed, else why not."""
        p = self.shard_path(shard_index)
        if not os.path.isfile(p):
            return "missing"
        start, end = self.shard_range(shard_index)
        _, size = _layout(end - start, self.seq_length, self.k, self.metadata["ids_dtype"])
        if os.path.getsize(p) != size:
            return f"size {os.path.getsize(p)} bytes, expected {size}"
        with open(p, "rb") as f:
            magic, ver, idx, first, n, seq, k = _HEADER.unpack(f.read(_HEADER.size))
        if (magic, ver, idx, first, n, seq, k) != (_MAGIC, FORMAT_VERSION, shard_index, start, end - start,
                                                   self.seq_length, self.k):
            return (f"header (magic={magic!r}, version={ver}, shard={idx}, first_sample={first}, n={n}, "
                    f"seq_length={seq}, k={k}) does not match the metadata")
        return None


class TeacherSamplesWriter(_Store):
    """Create (or resume) a store and write whole shards atomically.

    If ``path`` already holds a store, its metadata must match the arguments (else
    :class:`TeacherSamplesMismatchError`), and :meth:`pending_shards` lists what is left to do.
    """

    def __init__(self, path: str | os.PathLike, *, k: int, tau: float, vocab_size: int, seq_length: int,
                 num_samples: int, shard_size: int, seed: int, dataset_path: str, idx_fingerprint: str,
                 logits_dtype: str = "float16", sampler: str = "gumbel", extra: dict | None = None):
        path = str(path)
        if logits_dtype not in _LOGITS_DTYPES:
            raise TeacherSamplesError(f"logits_dtype must be one of {sorted(_LOGITS_DTYPES)}, "
                                      f"got {logits_dtype!r}")
        if sampler not in ("gumbel", "topk"):
            raise TeacherSamplesError(f"sampler must be 'gumbel' or 'topk', got {sampler!r}")
        for name, v in (("k", k), ("vocab_size", vocab_size), ("seq_length", seq_length),
                        ("num_samples", num_samples), ("shard_size", shard_size)):
            if int(v) < 1:
                raise TeacherSamplesError(f"{name} must be >= 1, got {v}")
        if k > vocab_size:
            raise TeacherSamplesError(f"k={k} exceeds vocab_size={vocab_size}; "
                                      "use k = vocab_size to keep all")
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "sampler": sampler, "k": int(k),
                "tau": float(tau), "vocab_size": int(vocab_size), "seed": int(seed),
                "ids_dtype": _ids_dtype(vocab_size), "logits_dtype": logits_dtype,
                "shard_size": int(shard_size), "num_shards": -(-int(num_samples) // int(shard_size)),
                "dataset": {"path": str(dataset_path), "idx_fingerprint": idx_fingerprint,
                            "seq_length": int(seq_length), "num_samples": int(num_samples)},
                "extra": extra or {}}
        os.makedirs(path, exist_ok=True)
        if os.path.exists(os.path.join(path, METADATA)):
            old = _read_metadata(path)
            diffs = [f"{key}: store has {old.get(key)!r}, requested {meta[key]!r}"
                     for key in meta if key != "extra" and _cmp_key(old.get(key)) != _cmp_key(meta[key])]
            if diffs:
                raise TeacherSamplesMismatchError(
                    f"{path}: existing teacher-sample store does not match this dump; refusing to mix. "
                    + "; ".join(diffs) + ". Use a new --output path or delete the old store.")
            meta = old
        else:
            _atomic_write(os.path.join(path, METADATA), (json.dumps(meta, indent=2) + "\n").encode())
        super().__init__(path, meta)

    def is_finished(self, shard_index: int) -> bool:
        return self._shard_problem(shard_index) is None

    def pending_shards(self) -> list[int]:
        """Shards that still have to be computed (missing, or not a finished, well-formed file)."""
        return [i for i in range(self.num_shards) if not self.is_finished(i)]

    def write_shard(self, shard_index: int, ids: torch.Tensor, logits: torch.Tensor, kappa: torch.Tensor,
                    lse: torch.Tensor) -> None:
        """Write a shard from ``ids``/``logits`` ``[n, seq, k]`` and ``kappa``/``lse`` ``[n, seq]``."""
        start, end = self.shard_range(shard_index)
        n, seq, k = end - start, self.seq_length, self.k
        expect = {"ids": (n, seq, k), "logits": (n, seq, k), "kappa": (n, seq), "lse": (n, seq)}
        for name, t in (("ids", ids), ("logits", logits), ("kappa", kappa), ("lse", lse)):
            if tuple(t.shape) != expect[name]:
                raise TeacherSamplesError(f"{self.path}: shard {shard_index} {name} has shape "
                                          f"{tuple(t.shape)}, expected {expect[name]} "
                                          f"(samples [{start}, {end}))")
        ids = ids.detach().cpu().long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise TeacherSamplesError(f"{self.path}: shard {shard_index} has token ids outside "
                                      f"[0, {self.vocab_size}): min {int(ids.min())}, max {int(ids.max())}")
        layout, size = _layout(n, seq, k, self.metadata["ids_dtype"])
        arrays = {
            "ids": ids.numpy().astype(layout["ids"][1]),
            "logits": logits.detach().cpu().to(self.logits_dtype).contiguous().view(torch.int16).numpy()
                      .view("<u2"),
            "kappa": kappa.detach().cpu().float().numpy().astype("<f4"),
            "lse": lse.detach().cpu().float().numpy().astype("<f4"),
        }
        chunks = [_HEADER.pack(_MAGIC, FORMAT_VERSION, shard_index, start, n, seq, k)]
        pos = _HEADER.size
        for name in ("ids", "logits", "kappa", "lse"):
            off = layout[name][0]
            chunks.append(b"\0" * (off - pos))
            data = np.ascontiguousarray(arrays[name]).tobytes()
            chunks.append(data)
            pos = off + len(data)
        assert pos == size
        _atomic_write(self.shard_path(shard_index), chunks)


def _cmp_key(v: Any) -> Any:
    return json.loads(json.dumps(v))  # compare as JSON would store it (tuples -> lists, etc.)


class TeacherSamples(_Store):
    """Read a store, memory-mapped; optionally check it against the dataset and vocabulary.

    ``idx_fingerprint`` (or ``idx_path``, hashed with :func:`dataset_fingerprint`), ``seq_length``,
    ``num_samples``, ``vocab_size`` (the tokenizer's, unpadded), ``k``, ``tau`` and ``sampler``: each given
    value must equal the store's, else :class:`TeacherSamplesMismatchError` says which and how. All shards
    must be finished unless ``allow_incomplete`` (then reading a sample of an unfinished shard raises).
    """

    def __init__(self, path: str | os.PathLike, *, idx_path: str | os.PathLike | None = None,
                 idx_fingerprint: str | None = None, seq_length: int | None = None,
                 num_samples: int | None = None, vocab_size: int | None = None, k: int | None = None,
                 tau: float | None = None, sampler: str | None = None, allow_incomplete: bool = False):
        path = str(path)
        super().__init__(path, _read_metadata(path))
        if idx_path is not None:
            idx_fingerprint = dataset_fingerprint(idx_path)
        ds = self.metadata["dataset"]
        checks = [("dataset .idx fingerprint", ds["idx_fingerprint"], idx_fingerprint,
                   f"the store was dumped from {ds['path']!r}, a different corpus or preprocessing"),
                  ("seq_length", self.seq_length, seq_length, "samples would be misaligned"),
                  ("number of samples", self.num_samples, num_samples, "samples would be misaligned"),
                  ("vocab_size", self.vocab_size, vocab_size, "teacher and student tokenizers differ"),
                  ("k", self.k, k, ""), ("tau", self.tau, tau, "the weights are only valid at the dump tau"),
                  ("sampler", self.sampler, sampler, "")]
        for name, have, want, why in checks:
            if want is not None and have != want:
                raise TeacherSamplesMismatchError(
                    f"{path}: teacher samples do not match: {name} is {have!r} in the store but {want!r} "
                    f"was expected" + (f" ({why})" if why else ""))
        self._finished = [self._shard_problem(i) for i in range(self.num_shards)]
        bad = [(i, why) for i, why in enumerate(self._finished) if why is not None]
        if bad and not allow_incomplete:
            shown = ", ".join(f"{i} ({why})" for i, why in bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise TeacherSamplesError(f"{path}: store incomplete: {len(bad)} of {self.num_shards} shards not "
                                      f"finished: {shown}; resume the dump to complete it")
        self._maps: dict[int, dict[str, np.ndarray]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}  # data-loader workers re-open their own memory maps
        return state

    def _shard(self, shard_index: int) -> dict[str, np.ndarray]:
        if shard_index not in self._maps:
            if len(self._maps) >= _MAX_OPEN_SHARDS:
                self._maps.pop(next(iter(self._maps)))
            why = self._finished[shard_index]
            if why is not None:
                raise TeacherSamplesError(f"{self.shard_path(shard_index)}: shard not finished ({why})")
            start, end = self.shard_range(shard_index)
            layout, _ = _layout(end - start, self.seq_length, self.k, self.metadata["ids_dtype"])
            self._maps[shard_index] = {
                name: np.memmap(self.shard_path(shard_index), dtype=dt, mode="r", offset=off, shape=shape)
                for name, (off, dt, shape) in layout.items()}
        return self._maps[shard_index]

    def get(self, sample_index: int) -> dict[str, torch.Tensor]:
        """``{"ids": int64 [seq, k], "logits": fp16/bf16 [seq, k], "kappa"/"lse": fp32 [seq]}``."""
        if not 0 <= sample_index < self.num_samples:
            raise IndexError(f"{self.path}: sample {sample_index} out of range [0, {self.num_samples})")
        shard = self._shard(sample_index // self.shard_size)
        j = sample_index % self.shard_size
        logits = torch.from_numpy(np.array(shard["logits"][j]).view(np.int16)).view(self.logits_dtype)
        return {"ids": torch.from_numpy(np.array(shard["ids"][j]).astype(np.int64)),
                "logits": logits,
                "kappa": torch.from_numpy(np.array(shard["kappa"][j])),
                "lse": torch.from_numpy(np.array(shard["lse"][j]))}

    def get_batch(self, sample_indices: list[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`get` for several samples, stacked along a new leading dim."""
        items = [self.get(int(i)) for i in sample_indices]
        return {key: torch.stack([it[key] for it in items]) for key in ("ids", "logits", "kappa", "lse")}

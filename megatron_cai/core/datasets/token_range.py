"""Token ids checked against the vocabulary, once per ``.bin``, cached next to the index cache.

The smallest and largest token id of a ``.bin`` (and where the largest sits) are computed in one
chunked pass the first time a dataset is opened, and stored as
``<cache dir>/<md5>-token_range.json`` keyed by the content fingerprints of the ``.idx``/``.bin``
(core/datasets/fingerprint.py: the whole ``.idx``, a sampled ``.bin``). Later starts read that small file
and the fingerprint's bytes (the ``.idx`` and at most 4 MiB of the ``.bin``). An id outside ``[0, vocab_size)`` is one
``IndexedDatasetError`` naming the file, the document and the id; without it, ids between the
vocabulary and its padded size train with an infinite loss, and larger ids crash inside the embedding
(a device-side assert on CUDA).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

import numpy as np

from megatron_cai.core.datasets.fingerprint import prefix_fingerprint
from megatron_cai.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetError, get_bin_path
from megatron_cai.core.datasets.utils import _file_lock, description_hash, to_json, write_text_atomic

logger = logging.getLogger(__name__)

_CHUNK = 1 << 24  # tokens per pass (bounds the temporary memory)


@dataclass
class TokenRange:
    """Extreme token ids of one ``.bin`` and where they first occur (sequence, document, offset)."""

    min_id: int
    max_id: int
    max_sequence: int
    max_document: int
    max_offset: int
    min_sequence: int
    min_document: int
    min_offset: int
    tokens: int


def _locate(ds: IndexedDataset, position: int) -> tuple[int, int, int]:
    """(sequence, document, offset within the sequence) of token ``position`` of the ``.bin``."""
    starts = ds.sequence_pointers // ds.index.dtype_size
    seq = int(np.searchsorted(starts, position, side="right")) - 1
    doc = int(np.searchsorted(ds.document_indices, seq, side="right")) - 1
    return seq, doc, int(position - starts[seq])


def compute_token_range(ds: IndexedDataset) -> TokenRange | None:
    """Scan every token of ``ds``'s ``.bin``; None for an empty file."""
    bin_path = get_bin_path(ds.path_prefix)
    n = os.path.getsize(bin_path) // ds.index.dtype_size
    if n == 0:
        return None
    tokens = np.memmap(bin_path, mode="r", dtype=ds.dtype, shape=(n,))
    best_max, best_min = (None, -1), (None, -1)
    for beg in range(0, n, _CHUNK):
        part = tokens[beg:beg + _CHUNK]
        hi, lo = part.max(), part.min()
        if best_max[0] is None or hi > best_max[0]:
            best_max = (hi, beg + int(part.argmax()))
        if best_min[0] is None or lo < best_min[0]:
            best_min = (lo, beg + int(part.argmin()))
    del tokens
    smax, dmax, omax = _locate(ds, best_max[1])
    smin, dmin, omin = _locate(ds, best_min[1])
    return TokenRange(int(best_min[0]), int(best_max[0]), smax, dmax, omax, smin, dmin, omin, n)


def default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def token_range(ds: IndexedDataset, cache_dir: str | None = None) -> TokenRange | None:
    """The cached ``TokenRange`` of ``ds`` (computed and cached on the first call for these files)."""
    prefix = ds.path_prefix
    description = to_json({"class": "TokenRange", "dataset_path": os.path.abspath(prefix),
                           **prefix_fingerprint(prefix), "format": 2})
    cache_dir = cache_dir or default_cache_dir(prefix)
    path = os.path.join(cache_dir, f"{description_hash(description)}-token_range.json")
    cached = _read(path, description)
    if cached is not None:
        return cached
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        logger.warning("cannot create cache dir %s (%s); checking token ids without caching", cache_dir, e)
        return compute_token_range(ds)
    with _file_lock(path + ".lock"):
        cached = _read(path, description)
        if cached is not None:
            return cached
        result = compute_token_range(ds)
        try:
            write_text_atomic(path, json.dumps({"description": description,
                                                "range": asdict(result) if result else None}))
        except OSError as e:
            logger.warning("could not cache the token range in %s (%s)", cache_dir, e)
    return result


def _read(path: str, description: str) -> TokenRange | None:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        if obj.get("description") != description or not obj.get("range"):
            return None
        return TokenRange(**obj["range"])
    except (OSError, ValueError, TypeError):
        return None


def check_token_ids(ds: IndexedDataset, vocab_size: int, cache_dir: str | None = None) -> None:
    """Raise IndexedDatasetError when a token id of ``ds`` is outside ``[0, vocab_size)``."""
    r = token_range(ds, cache_dir)
    if r is None:
        return
    bin_path = get_bin_path(ds.path_prefix)
    if r.max_id >= vocab_size:
        raise IndexedDatasetError(
            f"{bin_path}: document {r.max_document} (sequence {r.max_sequence}, token {r.max_offset}) holds token "
            f"id {r.max_id}, outside the vocabulary of {vocab_size} ids; preprocess the corpus with the tokenizer "
            f"this run uses (or fix --vocab-size)")
    if r.min_id < 0:
        raise IndexedDatasetError(
            f"{bin_path}: document {r.min_document} (sequence {r.min_sequence}, token {r.min_offset}) holds the "
            f"negative token id {r.min_id}")

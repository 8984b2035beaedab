"""Helpers for the data tests: small indexed datasets and independent reference implementations."""
import numpy as np

from megatron_cai.core.datasets.indexed_dataset import IndexedDatasetBuilder


def write_dataset(prefix: str, docs: list, dtype=np.int32) -> None:
    """One sequence per document."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc))
    builder.finalize(prefix + ".idx")


def random_docs(seed: int, n: int, max_len: int = 30, vocab: int = 1000, eod: int | None = None,
                min_len: int = 1) -> list[np.ndarray]:
    """Random documents; with ``eod`` each ends with it (and contains no other EOD)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        doc = rng.integers(1, vocab, size=length)
        if eod is not None:
            doc = np.where(doc == eod, eod + 1, doc)
            if length:
                doc[-1] = eod
        docs.append(doc)
    return docs


def megatron_sample_index_loop(sizes, document_index, seq_length: int, num_epochs: int,
                               tokens_per_epoch: int) -> np.ndarray:
    """Line-by-line port of the loop in Megatron's helpers.cpp ``build_sample_idx`` (drop last, +1 token)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    doc_idx_index, doc_offset = 0, 0
    out[0] = (0, 0)
    sample = 1
    while sample <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = int(sizes[document_index[doc_idx_index]]) - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                if doc_idx_index == len(document_index) - 1:
                    doc_offset = int(sizes[document_index[doc_idx_index]]) - 1
                    break
                doc_idx_index += 1
                doc_offset = 0
        out[sample] = (doc_idx_index, doc_offset)
        sample += 1
    return out

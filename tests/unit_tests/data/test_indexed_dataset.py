"""MMIDIDX format: bytes written by hand from the spec, round trips, merges and corrupt files."""
import os
import pickle
import struct

import numpy as np
import pytest

from megatron_cai.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
)

MAGIC = b"MMIDIDX\x00\x00"


def hand_written_idx(code: int, lengths: list[int], itemsize: int, doc_indices: list[int]) -> bytes:
    """The .idx bytes exactly as the format table describes them (independent of the writer)."""
    out = MAGIC + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_indices))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    pointer = 0
    for n in lengths:
        out += struct.pack("<q", pointer)
        pointer += n * itemsize
    out += b"".join(struct.pack("<q", d) for d in doc_indices)
    return out


def build(prefix: str, docs: list, dtype) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")


def test_dtype_codes_and_optimal_dtype():
    expected = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6,
                np.float32: 7, np.uint16: 8}
    for dtype, code in expected.items():
        assert DType.code_from_dtype(dtype) == code
        assert DType.dtype_from_code(code) == dtype
        assert DType.size(code) == np.dtype(dtype).itemsize
    assert DType.optimal_dtype(32000) == np.uint16
    assert DType.optimal_dtype(65499) == np.uint16
    assert DType.optimal_dtype(65500) == np.int32  # Megatron's margin: int32 from 65500 on
    assert DType.optimal_dtype(65536) == np.int32
    assert DType.optimal_dtype(65537) == np.int32
    assert DType.optimal_dtype(None) == np.int32


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_idx_and_bin_bytes_match_the_format(tmp_path, dtype, code):
    prefix = str(tmp_path / "ds")
    docs = [[5, 6, 7], [1], [9, 9, 9, 9, 2]]
    build(prefix, docs, dtype)
    itemsize = np.dtype(dtype).itemsize
    with open(prefix + ".idx", "rb") as f:
        assert f.read() == hand_written_idx(code, [3, 1, 5], itemsize, [0, 1, 2, 3])
    fmt = "<H" if dtype == np.uint16 else "<i"
    with open(prefix + ".bin", "rb") as f:
        assert f.read() == b"".join(struct.pack(fmt, t) for doc in docs for t in doc)


def test_reader_on_hand_written_files_with_multi_sequence_documents(tmp_path):
    # Two documents: sentences [10, 11] + [12] and [13, 14, 15]; written without the builder.
    prefix = str(tmp_path / "hand")
    tokens = [10, 11, 12, 13, 14, 15]
    with open(prefix + ".bin", "wb") as f:
        f.write(b"".join(struct.pack("<i", t) for t in tokens))
    with open(prefix + ".idx", "wb") as f:
        f.write(hand_written_idx(4, [2, 1, 3], 4, [0, 2, 3]))
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds.dtype == np.int32
    assert ds[0].tolist() == [10, 11] and ds[1].tolist() == [12] and ds[-1].tolist() == [13, 14, 15]
    assert [x.tolist() for x in ds[0:3]] == [[10, 11], [12], [13, 14, 15]]
    assert ds.get(2, offset=1).tolist() == [14, 15]
    assert ds.get(2, offset=1, length=1).tolist() == [14]
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.sequence_lengths.tolist() == [2, 1, 3]
    assert ds.sequence_pointers.tolist() == [0, 8, 12]
    with pytest.raises(IndexError):
        ds.get(2, offset=2, length=2)
    with pytest.raises(IndexError):
        ds[3]


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65536), (np.int32, 2**31 - 1)])
@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_random_documents(tmp_path, dtype, high, mmap):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, high, size=rng.integers(0, 40)) for _ in range(300)]
    prefix = str(tmp_path / "rt")
    build(prefix, docs, dtype)
    ds = IndexedDataset(prefix, mmap=mmap)
    assert len(ds) == len(docs)
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert ds[i].dtype == dtype
        np.testing.assert_array_equal(ds[i], doc)
    for got, doc in zip(ds[100:150], docs[100:150]):
        np.testing.assert_array_equal(got, doc)
    i = next(i for i, d in enumerate(docs) if len(d) > 5)
    np.testing.assert_array_equal(ds.get(i, 2, 3), docs[i][2:5])
    # Survives pickling (DataLoader workers started with spawn).
    again = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(again[i], docs[i])


def test_add_document_with_sentence_lengths_and_merge(tmp_path):
    a, b, merged = (str(tmp_path / n) for n in ("a", "b", "m"))
    builder = IndexedDatasetBuilder(a + ".bin", np.int32)
    builder.add_document([1, 2, 3, 4], lengths=[1, 3])
    builder.add_document([5])
    builder.finalize(a + ".idx")
    build(b, [[6, 7], [8]], np.int32)
    builder = IndexedDatasetBuilder(merged + ".bin", np.int32)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(merged + ".idx")
    ds = IndexedDataset(merged)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1], [2, 3, 4], [5], [6, 7], [8]]
    assert ds.document_indices.tolist() == [0, 2, 3, 4, 5]
    build(b + "16", [[1]], np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.int32)
    with pytest.raises(ValueError, match="dtype"):
        builder.add_index(b + "16")
    builder.abort()


def test_builder_rejects_ids_that_do_not_fit_and_abort_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "of")
    with pytest.raises(ValueError, match="do not fit"):
        with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
            builder.add_item([1, 70000])
    assert os.listdir(tmp_path) == []


def test_interrupted_rebuild_never_pairs_a_new_bin_with_an_old_idx(tmp_path):
    prefix = str(tmp_path / "p")
    build(prefix, [[1, 2, 3]], np.int32)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    builder.add_document([4, 5])
    # Until finalize the old pair is untouched.
    assert IndexedDataset(prefix)[0].tolist() == [1, 2, 3]
    builder.finalize(prefix + ".idx")
    assert IndexedDataset(prefix)[0].tolist() == [4, 5]


# ---------------------------------------------------------------------------- corrupt files
def _good(tmp_path):
    prefix = str(tmp_path / "c")
    build(prefix, [[1, 2, 3], [4, 5], [6]], np.uint16)
    with open(prefix + ".idx", "rb") as f:
        return prefix, bytearray(f.read())


def _write(path, data):
    with open(path, "wb") as f:
        f.write(bytes(data))


def _expect_error(prefix, path_suffix, match):
    with pytest.raises(IndexedDatasetError, match=match) as info:
        IndexedDataset(prefix)
    assert prefix + path_suffix in str(info.value)


def test_wrong_magic(tmp_path):
    prefix, idx = _good(tmp_path)
    idx[:9] = b"NOTANIDX!"
    _write(prefix + ".idx", idx)
    _expect_error(prefix, ".idx", "magic")


def test_wrong_version(tmp_path):
    prefix, idx = _good(tmp_path)
    idx[9:17] = struct.pack("<Q", 2)
    _write(prefix + ".idx", idx)
    _expect_error(prefix, ".idx", "version 2")


def test_unknown_dtype_code(tmp_path):
    prefix, idx = _good(tmp_path)
    idx[17] = 9
    _write(prefix + ".idx", idx)
    _expect_error(prefix, ".idx", "dtype code 9")


@pytest.mark.parametrize("cut", [1, 8, 30])
def test_truncated_idx(tmp_path, cut):
    prefix, idx = _good(tmp_path)
    _write(prefix + ".idx", idx[:-cut])
    _expect_error(prefix, ".idx", "size mismatch|truncated")


def test_idx_header_only_fragment(tmp_path):
    prefix, idx = _good(tmp_path)
    _write(prefix + ".idx", idx[:20])
    _expect_error(prefix, ".idx", "truncated")


def test_sequence_count_does_not_match_file(tmp_path):
    prefix, idx = _good(tmp_path)
    idx[18:26] = struct.pack("<Q", 4)
    _write(prefix + ".idx", idx)
    _expect_error(prefix, ".idx", "size mismatch")


def test_truncated_bin(tmp_path):
    prefix, _ = _good(tmp_path)
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    _write(prefix + ".bin", data[:-2])
    _expect_error(prefix, ".bin", "truncated")


def test_bin_with_extra_data(tmp_path):
    prefix, _ = _good(tmp_path)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\x00\x00")
    _expect_error(prefix, ".bin", "extra data")


def test_bin_size_not_a_multiple_of_the_dtype(tmp_path):
    prefix, _ = _good(tmp_path)
    with open(prefix + ".bin", "ab") as f:
        f.write(b"\x00")
    _expect_error(prefix, ".bin", "multiple")


def test_pointer_inconsistent_with_lengths(tmp_path):
    prefix, idx = _good(tmp_path)
    n = 3
    off = 34 + 4 * n + 8  # second pointer
    idx[off:off + 8] = struct.pack("<q", 2)
    _write(prefix + ".idx", idx)
    _expect_error(prefix, ".idx", "sequence 1: byte pointer 2")


def test_negative_length(tmp_path):
    prefix, idx = _good(tmp_path)
    idx[34:38] = struct.pack("<i", -3)
    _write(prefix + ".idx", idx)
    _expect_error(prefix, ".idx", "negative length")


def test_document_indices_not_monotone(tmp_path):
    prefix, idx = _good(tmp_path)
    off = 34 + 12 * 3
    idx[off:off + 32] = b"".join(struct.pack("<q", d) for d in (0, 2, 1, 3))
    _write(prefix + ".idx", idx)
    _expect_error(prefix, ".idx", "decrease")


def test_document_indices_out_of_range(tmp_path):
    prefix, idx = _good(tmp_path)
    off = 34 + 12 * 3
    idx[off:off + 32] = b"".join(struct.pack("<q", d) for d in (0, 1, 2, 7))
    _write(prefix + ".idx", idx)
    _expect_error(prefix, ".idx", "end at 3")


def test_missing_bin(tmp_path):
    prefix, _ = _good(tmp_path)
    os.remove(prefix + ".bin")
    assert not IndexedDataset.exists(prefix)
    _expect_error(prefix, ".bin", "not found")

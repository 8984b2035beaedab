"""Content fingerprints of a corpus (core/datasets/fingerprint.py): which bytes a sampled ``.bin`` hash reads
(hand-computed offsets; the bytes the process actually read, from /proc/self/io), what it sees and what it
honestly misses, and that the caches keyed on it notice a same-size replacement whose mtime was kept."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from megatron_cai.core.datasets import fingerprint as fp
from megatron_cai.core.datasets import token_range as tr
from megatron_cai.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    get_bin_path,
    get_idx_path,
)


def _flip(path: str, offset: int, keep_mtime: bool = True) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_sample_offsets_by_hand():
    assert fp.sample_offsets(100, samples=4, sample_bytes=8) == [0, 30, 61, 92]  # span 92: 0, 92/3, 2*92/3, 92
    assert fp.sample_offsets(32, samples=4, sample_bytes=8) == []  # small enough: hashed whole


def test_sampled_digest_is_size_and_windows(tmp_path):
    path = str(tmp_path / "f.bin")
    data = np.random.default_rng(0).integers(0, 256, size=100, dtype=np.uint8).tobytes()
    open(path, "wb").write(data)
    got = fp.file_fingerprint(path, sampled=True, samples=4, sample_bytes=8)
    h = hashlib.blake2b(digest_size=16)  # the definition, written out
    h.update((100).to_bytes(8, "little"))
    for off in (0, 30, 61, 92):
        h.update(data[off:off + 8])
    assert got.digest == f"blake2b-128:{h.hexdigest()}" and got.bytes_read == 32 and got.sampled
    assert fp.file_fingerprint(path, sampled=False).digest == \
        "blake2b-128:" + hashlib.blake2b((100).to_bytes(8, "little") + data, digest_size=16).hexdigest()


@pytest.mark.parametrize("offset, seen", [(0, True), (33, True), (99, True), (20, False), (50, False)])
def test_what_a_sampled_hash_sees_and_misses(tmp_path, offset, seen):
    """Windows [0,8) [30,38) [61,69) [92,100): a byte flipped inside one is seen; one between windows is not
    (the documented limit for a .bin larger than SAMPLES * SAMPLE_BYTES); the whole-file hash sees both."""
    path = str(tmp_path / "f.bin")
    open(path, "wb").write(bytes(range(100)))
    before = fp.file_fingerprint(path, sampled=True, samples=4, sample_bytes=8).digest
    whole = fp.file_fingerprint(path, sampled=False).digest
    _flip(path, offset)
    assert (fp.file_fingerprint(path, sampled=True, samples=4, sample_bytes=8).digest != before) == seen
    assert fp.file_fingerprint(path, sampled=False).digest != whole


def test_mtime_alone_changes_nothing(tmp_path):
    path = str(tmp_path / "f.bin")
    open(path, "wb").write(b"x" * 1000)
    before = fp.file_fingerprint(path, sampled=True).digest
    os.utime(path, ns=(1, 1))
    assert fp.file_fingerprint(path, sampled=True).digest == before


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_cost_is_the_idx_plus_4_mib_of_a_1_gib_bin(tmp_path):
    """A 1 GiB .bin (sparse) and its .idx: the fingerprint reads the whole .idx and 64 x 64 KiB of the .bin,
    measured by the kernel's count of bytes this process read."""
    prefix = str(tmp_path / "big")
    n_docs = 1 << 14
    with IndexedDatasetBuilder(get_bin_path(prefix), np.uint16) as b:
        b.add_document([1, 2])
        b.prepare(get_idx_path(prefix))
        b.publish()
    tokens = (1 << 29) // n_docs  # 1 GiB of uint16 in n_docs documents
    from megatron_cai.core.datasets.indexed_dataset import write_index

    write_index(get_idx_path(prefix), np.uint16, [tokens] * n_docs, list(range(n_docs + 1)))
    with open(get_bin_path(prefix), "r+b") as f:
        f.truncate(1 << 30)
    idx_size = os.path.getsize(get_idx_path(prefix))
    assert len(IndexedDataset(prefix)) == n_docs
    before = _rchar()
    cost = {"idx": fp.file_fingerprint(get_idx_path(prefix), sampled=False).bytes_read,
            "bin": fp.file_fingerprint(get_bin_path(prefix), sampled=True).bytes_read}
    read = _rchar() - before
    assert idx_size == 34 + 4 * n_docs + 8 * n_docs + 8 * (n_docs + 1)  # header, lengths, pointers, documents
    assert cost == {"idx": idx_size, "bin": fp.SAMPLES * fp.SAMPLE_BYTES} == {"idx": 327_722, "bin": 4 << 20}
    assert cost["idx"] + cost["bin"] <= read <= cost["idx"] + cost["bin"] + 64 * 1024, read


def _corpus(prefix: str, docs) -> IndexedDataset:
    with IndexedDatasetBuilder(get_bin_path(prefix), np.uint16) as b:
        for d in docs:
            b.add_document(d)
        b.finalize(get_idx_path(prefix))
    return IndexedDataset(prefix)


def test_vocabulary_cache_notices_a_same_size_replacement_with_mtime_kept(tmp_path):
    prefix, cache = str(tmp_path / "c"), str(tmp_path / "cache")
    docs = [[(3 * i + j) % 100 for j in range(30)] for i in range(10)]
    tr.check_token_ids(_corpus(prefix, docs), 100, cache)  # cached: every id < 100
    ids = np.fromfile(get_bin_path(prefix), dtype=np.uint16)
    ids[7 * 30 + 4] = 4000
    st = os.stat(get_bin_path(prefix))
    ids.tofile(get_bin_path(prefix))
    os.utime(get_bin_path(prefix), ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(get_bin_path(prefix)).st_size == st.st_size
    fp.forget_cached_fingerprints()  # rewritten within this process, maybe within one ctime tick
    with pytest.raises(IndexedDatasetError, match=r"c\.bin: document 7 .* holds token id 4000"):
        tr.check_token_ids(IndexedDataset(prefix), 100, cache)

"""Teacher-sample sidecar store: round trip, byte layout, resume, reproducibility, mismatch errors."""
import hashlib
import json
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from megatron_cai.core.distillation import (
    TeacherSamples,
    TeacherSamplesError,
    TeacherSamplesMismatchError,
    TeacherSamplesWriter,
    counter_gumbel,
    dataset_fingerprint,
    gumbel_topk,
    position_keys,
    shard_seed,
)

SEQ, K, N, SHARD = 5, 4, 7, 3


@pytest.fixture
def idx(tmp_path):
    p = tmp_path / "corpus_text_document.idx"
    p.write_bytes(b"MMIDIDX\x00\x00" + bytes(range(200)))
    return str(p)


def _teacher_logits(start: int, end: int, vocab: int) -> torch.Tensor:
    """A deterministic toy teacher: sample i's logits depend only on i."""
    return torch.stack([torch.randn(SEQ, vocab, generator=torch.Generator().manual_seed(1000 + i)) * 3
                        for i in range(start, end)])


def _writer(path, idx, *, vocab=50, seed=17, k=K, num_samples=N, logits_dtype="float16", **kw):
    return TeacherSamplesWriter(path, k=k, tau=1.5, vocab_size=vocab, seq_length=SEQ,
                                num_samples=num_samples, shard_size=SHARD, seed=seed,
                                dataset_path="/data/corpus_text_document",
                                idx_fingerprint=dataset_fingerprint(idx), logits_dtype=logits_dtype, **kw)


def _sample_shard(w: TeacherSamplesWriter, i: int, noise: str = "counter"):
    start, end = w.shard_range(i)
    logits = _teacher_logits(start, end, w.vocab_size)
    if noise == "counter":
        gumbel = counter_gumbel(w.seed, position_keys(start, end - start, SEQ), w.vocab_size)
        return gumbel_topk(logits, w.k, tau=w.tau, gumbel=gumbel)
    return gumbel_topk(logits, w.k, tau=w.tau, generator=torch.Generator().manual_seed(shard_seed(w.seed, i)))


def _dump(path, idx, noise="counter", **kw) -> list[int]:
    """A toy resumable dump: computes only the pending shards; returns which it computed."""
    w = _writer(path, idx, **kw)
    todo = w.pending_shards()
    for i in todo:
        w.write_shard(i, *_sample_shard(w, i, noise))
    return todo


@pytest.mark.parametrize("vocab,logits_dtype", [(50, "float16"), (70_000, "bfloat16")])
def test_round_trip(tmp_path, idx, vocab, logits_dtype):
    store = tmp_path / "ts"
    assert _dump(store, idx, vocab=vocab, logits_dtype=logits_dtype) == [0, 1, 2]
    ts = TeacherSamples(store, idx_path=idx, seq_length=SEQ, num_samples=N, vocab_size=vocab)
    meta = json.loads((store / "metadata.json").read_text())
    assert meta["ids_dtype"] == ("uint16" if vocab <= 65536 else "int32") and meta["num_shards"] == 3
    sha = hashlib.sha256(open(idx, "rb").read()).hexdigest()
    assert meta["dataset"]["idx_fingerprint"] == "sha256:" + sha
    assert len(ts) == N and ts.k == K and ts.tau == 1.5
    ref = gumbel_topk(_teacher_logits(0, N, vocab), K, tau=1.5,
                      gumbel=counter_gumbel(17, position_keys(0, N, SEQ), vocab))
    dt = torch.float16 if logits_dtype == "float16" else torch.bfloat16
    for i in range(N):
        got = ts.get(i)
        assert got["ids"].dtype == torch.int64 and got["logits"].dtype == dt
        assert torch.equal(got["ids"], ref[0][i]) and torch.equal(got["logits"], ref[1][i].to(dt))
        assert torch.equal(got["kappa"], ref[2][i]) and torch.equal(got["lse"], ref[3][i])
    if vocab > 65536:
        assert int(ref[0].max()) > 65536  # ids beyond uint16 survived
    batch = ts.get_batch([6, 0, 4])
    assert batch["ids"].shape == (3, SEQ, K) and torch.equal(batch["kappa"][0], ref[2][6])
    with pytest.raises(IndexError):
        ts.get(N)
    clone = pickle.loads(pickle.dumps(ts))  # as a DataLoader worker gets it: maps re-opened, not copied
    assert clone._maps == {} and torch.equal(clone.get(5)["ids"], ref[0][5])


def test_shard_bytes_follow_documented_layout(tmp_path, idx):
    """Parse a shard with struct/numpy from the documented layout, independently of the reader."""
    store = tmp_path / "ts"
    _dump(store, idx)
    raw = (store / "shard_00002.bin").read_bytes()  # the last shard: 1 sample
    magic, ver, shard, first, n, seq, k = struct.unpack_from("<8sIIQIII", raw, 0)
    assert (magic, ver, shard, first, n, seq, k) == (b"MCTSHRD1", 1, 2, 6, 1, SEQ, K)
    off = 64
    ids = np.frombuffer(raw, "<u2", n * seq * k, off).reshape(n, seq, k)
    off = -(-(off + ids.nbytes) // 64) * 64
    logits = np.frombuffer(raw, "<f2", n * seq * k, off).reshape(n, seq, k)
    off = -(-(off + logits.nbytes) // 64) * 64
    kappa = np.frombuffer(raw, "<f4", n * seq, off).reshape(n, seq)
    off = -(-(off + kappa.nbytes) // 64) * 64
    lse = np.frombuffer(raw, "<f4", n * seq, off).reshape(n, seq)
    assert off + lse.nbytes == len(raw)
    got = TeacherSamples(store).get(6)
    np.testing.assert_array_equal(ids[0], got["ids"].numpy())
    np.testing.assert_array_equal(logits[0], got["logits"].numpy())
    np.testing.assert_array_equal(kappa[0], got["kappa"].numpy())
    np.testing.assert_array_equal(lse[0], got["lse"].numpy())
    s = _teacher_logits(6, 7, 50)[0].double() / 1.5
    np.testing.assert_allclose(lse[0], torch.logsumexp(s, -1).numpy(), rtol=1e-6)


def test_resume_skips_finished_shards_and_is_reproducible(tmp_path, idx):
    full = tmp_path / "full"
    _dump(full, idx)
    part = tmp_path / "part"
    w = _writer(part, idx)
    for i in (0, 2):
        w.write_shard(i, *_sample_shard(w, i))
    # An interrupted write of shard 1: a temp file, and (worse) a truncated file under the final name.
    (part / "shard_00001.bin.tmp").write_bytes(b"partial")
    assert _writer(part, idx).pending_shards() == [1]
    (part / "shard_00001.bin").write_bytes((full / "shard_00001.bin").read_bytes()[:-10])
    assert _writer(part, idx).pending_shards() == [1]
    with pytest.raises(TeacherSamplesError, match=r"incomplete: 1 of 3 shards .*1 \(size"):
        TeacherSamples(part)
    assert _dump(part, idx) == [1]  # only the unfinished shard is recomputed
    assert _dump(part, idx) == []
    for i in range(3):  # byte-identical to an uninterrupted dump from the same seed
        assert (part / f"shard_{i:05d}.bin").read_bytes() == (full / f"shard_{i:05d}.bin").read_bytes()
    other = tmp_path / "other_seed"
    _dump(other, idx, seed=18)
    assert (other / "shard_00000.bin").read_bytes() != (full / "shard_00000.bin").read_bytes()


def test_any_shard_recomputed_from_seed_and_index_with_torch_generator(tmp_path, idx):
    a, b = tmp_path / "a", tmp_path / "b"
    _dump(a, idx, noise="generator")
    w = _writer(b, idx)
    w.write_shard(1, *_sample_shard(w, 1, noise="generator"))  # shard 1 alone, out of order
    assert (a / "shard_00001.bin").read_bytes() == (b / "shard_00001.bin").read_bytes()
    assert shard_seed(17, 1) != shard_seed(17, 2) and shard_seed(17, 1) != shard_seed(18, 1)


def test_reader_mismatch_errors(tmp_path, idx):
    store = tmp_path / "ts"
    _dump(store, idx)
    other_idx = tmp_path / "other.idx"
    other_idx.write_bytes(b"MMIDIDX\x00\x00" + bytes(range(1, 201)))
    with pytest.raises(TeacherSamplesMismatchError, match="fingerprint.*different corpus"):
        TeacherSamples(store, idx_path=other_idx)
    with pytest.raises(TeacherSamplesMismatchError, match="seq_length is 5 in the store but 6"):
        TeacherSamples(store, seq_length=6)
    with pytest.raises(TeacherSamplesMismatchError, match="number of samples is 7 in the store but 8"):
        TeacherSamples(store, num_samples=8)
    with pytest.raises(TeacherSamplesMismatchError, match="vocab_size is 50 in the store but 51.*tokenizers"):
        TeacherSamples(store, vocab_size=51)
    with pytest.raises(TeacherSamplesMismatchError, match="tau"):
        TeacherSamples(store, tau=1.0)
    TeacherSamples(store, idx_fingerprint=dataset_fingerprint(idx), seq_length=SEQ, num_samples=N,
                   vocab_size=50, k=K, tau=1.5, sampler="gumbel")
    with pytest.raises(TeacherSamplesError, match="not a teacher-sample store"):
        TeacherSamples(tmp_path)


def test_writer_refuses_to_mix_stores_and_bad_input(tmp_path, idx):
    store = tmp_path / "ts"
    _dump(store, idx)
    with pytest.raises(TeacherSamplesMismatchError, match="k: store has 4, requested 5"):
        _writer(store, idx, k=5)
    with pytest.raises(TeacherSamplesMismatchError, match="seed: store has 17, requested 3"):
        _writer(store, idx, seed=3)
    with pytest.raises(TeacherSamplesMismatchError, match="dataset"):
        _writer(store, idx, num_samples=9)
    w = _writer(tmp_path / "new", idx)
    ids, tl, kappa, lse = _sample_shard(w, 0)
    with pytest.raises(TeacherSamplesError, match=r"ids has shape \(2, 5, 4\), expected \(3, 5, 4\)"):
        w.write_shard(0, ids[:2], tl[:2], kappa[:2], lse[:2])
    with pytest.raises(TeacherSamplesError, match=r"token ids outside \[0, 50\)"):
        w.write_shard(0, ids + 50, tl, kappa, lse)
    with pytest.raises(TeacherSamplesError, match="k=60 exceeds vocab_size=50"):
        _writer(tmp_path / "x", idx, k=60)


def test_incomplete_store_and_corrupt_shard(tmp_path, idx):
    store = tmp_path / "ts"
    w = _writer(store, idx)
    w.write_shard(0, *_sample_shard(w, 0))
    with pytest.raises(TeacherSamplesError, match="incomplete: 2 of 3 shards not finished: 1 \\(missing\\)"):
        TeacherSamples(store)
    ts = TeacherSamples(store, allow_incomplete=True)
    assert ts.get(2)["ids"].shape == (SEQ, K)
    with pytest.raises(TeacherSamplesError, match="shard_00001.bin: shard not finished"):
        ts.get(3)
    # A finished shard copied under another shard's name is caught by its header.
    (store / "shard_00001.bin").write_bytes((store / "shard_00000.bin").read_bytes())
    assert w.pending_shards() == [1, 2]
    with pytest.raises(TeacherSamplesError, match="header .*shard=0"):
        TeacherSamples(store)


def test_dataset_fingerprint_tracks_content(tmp_path, idx):
    fp = dataset_fingerprint(idx)
    assert fp == "sha256:" + hashlib.sha256(open(idx, "rb").read()).hexdigest()
    with open(idx, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    assert dataset_fingerprint(idx) != fp
    assert os.path.getsize(idx) == 209

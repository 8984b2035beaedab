"""GPTDataset: indices vs brute force and Megatron's algorithm, splits, masks, visibility, cache."""
import os
import threading

import numpy as np
import pytest
import torch
from testlib.data import megatron_sample_index_loop, random_docs, write_dataset

from megatron_cai.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_cai.core.datasets.indexed_dataset import IndexedDataset
from megatron_cai.core.datasets.utils import parse_and_normalize_split, split_ranges

EOD = 0


def make(tmp_path, docs, name="ds", dtype=np.int32):
    prefix = str(tmp_path / name)
    write_dataset(prefix, docs, dtype)
    return prefix, IndexedDataset(prefix)


def gpt(prefix, ds, num_samples, seq, seed=1234, docs=None, split="train", **kw):
    cfg = GPTDatasetConfig(sequence_length=seq, random_seed=seed, **kw)
    indices = np.arange(len(ds)) if docs is None else np.asarray(docs)
    return GPTDataset(ds, prefix, indices, num_samples, split, cfg)


@pytest.mark.parametrize("seq,num_samples", [(4, None), (16, 7), (7, 200), (3, 130), (64, 40)])
def test_samples_equal_brute_force_concatenation(tmp_path, seq, num_samples):
    docs = random_docs(0, 25, max_len=20)
    prefix, ds = make(tmp_path, docs)
    d = gpt(prefix, ds, num_samples, seq)
    tokens_per_epoch = sum(len(x) for x in docs)
    # Epochs: the fewest whose tokens cover num_samples * seq + 1 (hand loop).
    epochs = 1
    while num_samples is not None and epochs * tokens_per_epoch < num_samples * seq + 1:
        epochs += 1
    assert d.num_epochs == epochs
    assert len(d) == (epochs * tokens_per_epoch - 1) // seq
    if num_samples is not None:
        assert len(d) >= num_samples
    # Each document appears once per epoch in the document index.
    counts = np.bincount(d.document_index, minlength=len(docs))
    assert (counts == epochs).all()
    stream = np.concatenate([docs[i] for i in d.document_index])
    assert sorted(d.shuffle_index.tolist()) == list(range(len(d)))
    for i in range(len(d)):
        j = int(d.shuffle_index[i])
        np.testing.assert_array_equal(d.get_text(i), stream[j * seq: j * seq + seq + 1])
        sample = d[i]
        np.testing.assert_array_equal(sample["tokens"].numpy(), stream[j * seq: j * seq + seq])
        np.testing.assert_array_equal(sample["labels"].numpy(), stream[j * seq + 1: j * seq + seq + 1])


@pytest.mark.parametrize("seq,num_samples", [(5, 50), (9, 300), (2, None), (13, 31)])
def test_sample_index_equals_megatron_loop_even_with_empty_documents(tmp_path, seq, num_samples):
    docs = random_docs(1, 30, max_len=12, min_len=0)
    docs[0] = np.array([], dtype=np.int64)
    prefix, ds = make(tmp_path, docs)
    d = gpt(prefix, ds, num_samples, seq, seed=7)
    ref = megatron_sample_index_loop(ds.sequence_lengths, d.document_index, seq, d.num_epochs,
                                     d.tokens_per_epoch)
    np.testing.assert_array_equal(np.asarray(d.sample_index, dtype=np.int64), ref)


def test_indices_follow_megatron_rng_order(tmp_path):
    docs = random_docs(2, 17, max_len=9)
    prefix, ds = make(tmp_path, docs)
    split_docs = np.arange(3, 15)
    d = gpt(prefix, ds, 3, 8, seed=99, docs=split_docs)
    assert d.num_epochs == 1
    rs = np.random.RandomState(99)
    ref_doc = split_docs.astype(np.int32).copy()
    rs.shuffle(ref_doc)
    np.testing.assert_array_equal(d.document_index, ref_doc)
    ref_shuffle = np.arange(len(d), dtype=np.uint32)
    rs.shuffle(ref_shuffle)
    np.testing.assert_array_equal(d.shuffle_index, ref_shuffle)


def test_separate_final_epoch(tmp_path):
    docs = [np.arange(1, 11)] * 10  # 100 tokens per epoch
    prefix, ds = make(tmp_path, docs)
    seq = 10
    per_epoch = (100 - 1) // seq  # 9
    sans_final = (2 * 100 - 1) // seq  # samples before epoch 3: 19
    d = gpt(prefix, ds, sans_final + 2, seq)  # 2 samples from the 3rd epoch: < 80% of 9
    assert d.num_epochs == 3
    first, last = d.document_index[:20], d.document_index[20:]
    assert sorted(first.tolist()) == sorted(list(range(10)) * 2)
    assert sorted(last.tolist()) == list(range(10))
    assert sorted(d.shuffle_index[:sans_final].tolist()) == list(range(sans_final))
    assert sorted(d.shuffle_index[sans_final:].tolist()) == list(range(sans_final, len(d)))
    # Same RNG order as Megatron: epochs 1-2, then epoch 3, then the two shuffle ranges.
    rs = np.random.RandomState(1234)
    a = np.tile(np.arange(10, dtype=np.int32), 2)
    rs.shuffle(a)
    b = np.arange(10, dtype=np.int32)
    rs.shuffle(b)
    np.testing.assert_array_equal(d.document_index, np.concatenate([a, b]))
    # Needing most of the final epoch does not separate it.
    d2 = gpt(prefix, ds, sans_final + per_epoch - 1, seq)
    assert sorted(d2.shuffle_index[:sans_final + 3].tolist()) != list(range(sans_final + 3))
    rs = np.random.RandomState(1234)
    a = np.tile(np.arange(10, dtype=np.int32), 3)
    rs.shuffle(a)
    np.testing.assert_array_equal(d2.document_index, a)


def test_split_parsing_and_ranges():
    assert parse_and_normalize_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_and_normalize_split("1") == [1.0, 0.0, 0.0]
    assert parse_and_normalize_split("80,20") == pytest.approx([0.8, 0.2, 0.0])
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("6,3,1", 10) == [(0, 6), (6, 9), (9, 10)]
    assert split_ranges("1", 10) == [(0, 10), None, None]
    assert split_ranges("969,30,1", 100) == [(0, 97), (97, 100), (100, 100)]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            parse_and_normalize_split(bad)


def _ltor_reference(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron's _get_ltor_masks_and_position_ids, written out with torch loops."""
    tokens = torch.as_tensor(tokens)
    seq = tokens.numel()
    loss_mask = torch.ones(seq)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(seq)
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    if reset_position_ids or reset_attention_mask:
        prev = 0
        for i in torch.nonzero(tokens == eod).flatten().tolist():
            if reset_attention_mask:
                mask[i + 1:, : i + 1] = False
            if reset_position_ids:
                position_ids[i + 1:] -= i + 1 - prev
                prev = i + 1
    return loss_mask, position_ids, mask


@pytest.mark.parametrize("flags", [(False, False, False), (True, False, False), (False, True, False),
                                   (False, False, True), (True, True, True)])
def test_masks_positions_and_visibility_match_megatron(tmp_path, flags):
    reset_pos, reset_attn, eod_mask = flags
    docs = random_docs(3, 40, max_len=9, vocab=50, eod=EOD)
    prefix, ds = make(tmp_path, docs)
    d = gpt(prefix, ds, 30, 16, eod_token_id=EOD, reset_position_ids=reset_pos,
            reset_attention_mask=reset_attn, eod_mask_loss=eod_mask)
    saw_eod_inside = False
    for i in range(len(d)):
        s = d[i]
        assert s["tokens"].dtype == torch.int64 and s["labels"].dtype == torch.int64
        assert s["loss_mask"].dtype == torch.float32 and s["position_ids"].dtype == torch.int64
        loss_mask, pos, mask = _ltor_reference(s["tokens"], EOD, reset_pos, reset_attn, eod_mask)
        assert torch.equal(s["loss_mask"], loss_mask)
        assert torch.equal(s["position_ids"], pos)
        saw_eod_inside |= bool((s["tokens"][:-1] == EOD).any())
        if not reset_attn:
            assert "visibility_start" not in s and "visibility_limit" not in s
            continue
        start, limit = s["visibility_start"], s["visibility_limit"]
        assert start.dtype == torch.int32 and limit.dtype == torch.int32
        q = torch.arange(16)[:, None]
        visible = (start[None, :] <= q) & (q < limit[None, :])  # [query, key]
        assert torch.equal(visible, mask)
    assert saw_eod_inside


def test_config_needs_eod_for_eod_options():
    with pytest.raises(ValueError, match="EOD"):
        GPTDatasetConfig(sequence_length=8, eod_mask_loss=True)
    with pytest.raises(ValueError, match="split"):
        GPTDatasetConfig(sequence_length=8, split="x")


def test_too_few_tokens_is_a_clear_error(tmp_path):
    prefix, ds = make(tmp_path, [[5]])
    with pytest.raises(ValueError, match="at least 2"):
        gpt(prefix, ds, 3, 4)


# ------------------------------------------------------------------------------------ cache
def _cache_files(directory):
    return sorted(f for f in os.listdir(directory) if f.endswith((".npy", ".txt")))


def test_cache_is_reused_and_rebuilt_when_inputs_change(tmp_path):
    docs = random_docs(4, 20)
    prefix, ds = make(tmp_path, docs)
    cache = tmp_path / "cache" / "GPTDataset_indices"  # the default location
    first = gpt(prefix, ds, 50, 8)
    assert first.built_anew_on_cache_miss and first.cache_dir == str(cache)
    assert len(_cache_files(cache)) == 4  # description + 3 index arrays
    again = gpt(prefix, ds, 50, 8)
    assert not again.built_anew_on_cache_miss
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    for changed in (dict(seed=5), dict(num_samples=60), dict(seq=9)):
        args = dict(num_samples=50, seq=8) | changed
        assert gpt(prefix, ds, **args).built_anew_on_cache_miss
    # A different split range of the same files.
    assert gpt(prefix, ds, 50, 8, docs=np.arange(0, 10)).built_anew_on_cache_miss
    # Rewriting the dataset (new content, new size/mtime) invalidates the entry.
    new_docs = random_docs(5, 20)
    write_dataset(prefix, new_docs)
    ds2 = IndexedDataset(prefix)
    rebuilt = gpt(prefix, ds2, 50, 8)
    assert rebuilt.built_anew_on_cache_miss
    stream = np.concatenate([new_docs[i] for i in rebuilt.document_index])
    j = int(rebuilt.shuffle_index[0])
    np.testing.assert_array_equal(rebuilt.get_text(0), stream[j * 8: j * 8 + 9])


def test_corrupt_cache_entry_is_rebuilt_and_explicit_cache_dir(tmp_path):
    prefix, ds = make(tmp_path, random_docs(6, 20))
    cache = tmp_path / "elsewhere"
    first = gpt(prefix, ds, 40, 8, path_to_cache=str(cache))
    assert first.cache_dir == str(cache) and not (tmp_path / "cache").exists()
    victim = next(f for f in _cache_files(cache) if f.endswith("sample_index.npy"))
    with open(cache / victim, "r+b") as f:
        f.truncate(20)
    again = gpt(prefix, ds, 40, 8, path_to_cache=str(cache))
    assert again.built_anew_on_cache_miss
    np.testing.assert_array_equal(again.sample_index, first.sample_index)
    assert not [f for f in os.listdir(cache) if ".tmp-" in f]


def test_concurrent_builders_build_once(tmp_path):
    prefix, ds = make(tmp_path, random_docs(7, 50))
    results = []

    def worker():
        results.append(gpt(prefix, IndexedDataset(prefix), 500, 8))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.built_anew_on_cache_miss for r in results) == 1
    for r in results[1:]:
        np.testing.assert_array_equal(r.shuffle_index, results[0].shuffle_index)
        np.testing.assert_array_equal(r.sample_index, results[0].sample_index)

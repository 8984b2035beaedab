"""Token ids against the vocabulary: the cached token-id range of a corpus (vs brute force), the dataset
builder's check, and preprocessing refusing ids outside the vocabulary."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from testlib import ROOT

from megatron_cai.core.datasets import token_range as tr
from megatron_cai.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    get_bin_path,
    get_idx_path,
)


def _corpus(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(get_bin_path(prefix), dtype) as b:
        for d in docs:
            b.add_document(d)
        b.finalize(get_idx_path(prefix))
    return IndexedDataset(prefix)


def test_token_range_matches_brute_force_and_is_cached(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=rng.integers(1, 50)).tolist() for _ in range(60)]
    docs[41][3] = 777
    monkeypatch.setattr(tr, "_CHUNK", 64)  # many chunks
    ds = _corpus(str(tmp_path / "c"), docs)
    r = tr.token_range(ds, str(tmp_path / "cache"))
    flat = np.concatenate([np.asarray(d) for d in docs])
    assert (r.max_id, r.min_id, r.tokens) == (flat.max(), flat.min(), flat.size)
    assert (r.max_document, r.max_sequence, r.max_offset) == (41, 41, 3)
    with pytest.raises(IndexedDatasetError, match=r"c\.bin: document 41 \(sequence 41, token 3\) holds token id 777"):
        tr.check_token_ids(ds, 500, str(tmp_path / "cache"))
    tr.check_token_ids(ds, 778, str(tmp_path / "cache"))

    def no_scan(_ds):
        raise AssertionError("scanned again")

    monkeypatch.setattr(tr, "compute_token_range", no_scan)  # later starts read the cache: O(1)
    assert tr.token_range(IndexedDataset(str(tmp_path / "c")), str(tmp_path / "cache")) == r
    docs[0][0] = 999  # a rewritten corpus invalidates the entry
    monkeypatch.undo()
    ds2 = _corpus(str(tmp_path / "c"), docs)
    os.utime(get_bin_path(str(tmp_path / "c")), ns=(1, 1))
    assert tr.token_range(ds2, str(tmp_path / "cache")).max_id == 999


def test_builder_checks_the_vocabulary(tmp_path):
    from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
    from megatron_cai.core.datasets.gpt_dataset import GPTDatasetConfig

    _corpus(str(tmp_path / "c"), [[1, 2, 3, 90] * 10, [5, 6] * 10])
    cfg = GPTDatasetConfig(sequence_length=8, split="1,0,0", vocab_size=90)
    with pytest.raises(IndexedDatasetError, match="document 0 .* token id 90"):
        build_train_valid_test_datasets(str(tmp_path / "c"), "1,0,0", [4, 0, 0], cfg)
    cfg = GPTDatasetConfig(sequence_length=8, split="1,0,0", vocab_size=91)
    assert build_train_valid_test_datasets(str(tmp_path / "c"), "1,0,0", [4, 0, 0], cfg)[0] is not None




def test_preprocess_refuses_ids_outside_the_vocabulary(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import preprocess_data

    real = preprocess_data.build_tokenizer

    def build(**kw):
        tok = real(**kw)
        tok.tokenize = lambda text: [int(w) if int(w) != 7 else tok.vocab_size + 2 for w in text.split()]
        return tok

    monkeypatch.setattr(preprocess_data, "build_tokenizer", build)
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1 2 3"}\n{"text": "4 7 5"}\n')
    with pytest.raises(preprocess_data.PreprocessError, match=r"in\.jsonl:2: key 'text': token id 103 is outside"):
        preprocess_data.preprocess(str(path), str(tmp_path / "out"), "NullTokenizer", vocab_size=100,
                                   progress=False, log=lambda m: None, skip_bad_lines=True)
    assert not os.path.exists(tmp_path / "out_text_document.idx")

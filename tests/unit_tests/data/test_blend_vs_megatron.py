"""Unweighted and weighted multi-prefix --data-path blends against the installed megatron-core's
BlendedMegatronDatasetBuilder, sample for sample."""
import numpy as np
import pytest
from testlib.data import random_docs, write_dataset

from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
from megatron_cai.core.datasets.gpt_dataset import GPTDatasetConfig

SEQ = 16


class _Tok:
    """What megatron-core's GPTDataset reads from a tokenizer."""

    eod = 0
    pad = -1
    vocab_size = 1000

    def __getattr__(self, name):  # unique_identifiers and the like
        return None


def _corpora(tmp_path, sizes):
    prefixes = []
    for i, n in enumerate(sizes):
        p = str(tmp_path / f"corpus{i}")
        write_dataset(p, random_docs(10 + i, n, max_len=60, vocab=1000, eod=0))
        prefixes.append(p)
    return prefixes


def _megatron(blend, split, sizes, cache):
    builder_mod = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MGPTDatasetConfig

    cfg = MGPTDatasetConfig(random_seed=1234, sequence_length=SEQ, blend=blend, split=split,
                            path_to_cache=cache, tokenizer=_Tok(), reset_position_ids=False,
                            reset_attention_mask=False, eod_mask_loss=False, mid_level_dataset_surplus=0.005)
    return builder_mod.BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()


def _assert_same(ours, theirs, split_name):
    assert len(ours) == len(theirs), f"{split_name}: {len(ours)} samples here, {len(theirs)} in megatron-core"
    np.testing.assert_array_equal(np.asarray(ours.dataset_index), np.asarray(theirs.dataset_index))
    np.testing.assert_array_equal(np.asarray(ours.dataset_sample_index), np.asarray(theirs.dataset_sample_index))
    for i in range(len(ours)):
        d, s = int(theirs.dataset_index[i]), int(theirs.dataset_sample_index[i])
        text = theirs.datasets[d]._query_document_sample_shuffle_indices(s)[0]
        np.testing.assert_array_equal(ours.datasets[d].get_text(s), text, err_msg=f"{split_name} sample {i}")


@pytest.mark.parametrize("sizes_requested", [(2000, 120, 20), (300, 20, 5)])
def test_unweighted_blend_matches_megatron_core(tmp_path, sizes_requested):
    prefixes = _corpora(tmp_path, (1200, 400, 700))
    split = "949,40,11"  # every prefix has documents in every split (megatron-core asserts on empty ones)
    theirs = _megatron((prefixes, None), split, list(sizes_requested), str(tmp_path / "mcache"))
    ours = build_train_valid_test_datasets(prefixes, split, sizes_requested,
                                           GPTDatasetConfig(sequence_length=SEQ, split=split,
                                                            path_to_cache=str(tmp_path / "cache")))
    for name, a, b in zip(("train", "valid", "test"), ours, theirs):
        assert (a is None) == (b is None), name
        if a is not None:
            _assert_same(a, b, name)


def test_weighted_blend_still_matches_megatron_core(tmp_path):
    prefixes = _corpora(tmp_path, (300, 200))
    split = "98,2,0"
    theirs = _megatron((prefixes, [0.3, 0.7]), split, [500, 30, 0], str(tmp_path / "mcache"))
    ours = build_train_valid_test_datasets(["0.3", prefixes[0], "0.7", prefixes[1]], split, (500, 30, 0),
                                           GPTDatasetConfig(sequence_length=SEQ, split=split,
                                                            path_to_cache=str(tmp_path / "cache")))
    for name, a, b in zip(("train", "valid"), ours[:2], theirs[:2]):
        _assert_same(a, b, name)


def test_unweighted_blend_past_one_epoch_keeps_going(tmp_path):
    """Where Megatron's blend would run out (more samples than one epoch), ours extends the components."""
    prefixes = _corpora(tmp_path, (20, 10))
    train, _, _ = build_train_valid_test_datasets(prefixes, "1", (1000, 0, 0),
                                                  GPTDatasetConfig(sequence_length=SEQ, split="1",
                                                                   path_to_cache=str(tmp_path / "cache")))
    assert len(train) == 1000
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert all(c <= len(d) for c, d in zip(counts, train.datasets))

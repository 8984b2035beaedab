"""Blending (Megatron's greedy interleave) and ``build_train_valid_test_datasets``' --data-path rules."""
import numpy as np
import pytest
from testlib.data import write_dataset

from megatron_cai.core.datasets.blended_dataset import BlendedDataset, build_blending_indices
from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
from megatron_cai.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_cai.core.datasets.indexed_dataset import IndexedDatasetError
from megatron_cai.core.datasets.utils import get_blend_from_list


def greedy_reference(weights, size):
    """Straight from the description: pick argmax_i w_i * max(s, 1) - count_i, first index on ties."""
    counts = [0] * len(weights)
    chosen, nth = [], []
    for s in range(size):
        errors = [w * max(s, 1) - c for w, c in zip(weights, counts)]
        i = errors.index(max(errors))
        chosen.append(i)
        nth.append(counts[i])
        counts[i] += 1
    return chosen, nth


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.3, 0.7], [0.1, 0.2, 0.3, 0.4], [0.9, 0.05, 0.05]])
def test_blending_indices_match_reference_and_proportions(weights):
    size = 997
    dataset_index, sample_index = build_blending_indices(weights, size)
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64
    chosen, nth = greedy_reference(weights, size)
    assert dataset_index.tolist() == chosen and sample_index.tolist() == nth
    for prefix in (10, 100, size):
        counts = np.bincount(dataset_index[:prefix], minlength=len(weights))
        assert np.all(np.abs(counts - np.asarray(weights) * prefix) <= 1.0)
        assert np.all(counts <= np.ceil(np.asarray(weights) * prefix))


def _corpus(tmp_path, name, token, n_docs=30, length=10):
    """A dataset whose every token equals ``token`` (so samples reveal their source)."""
    prefix = str(tmp_path / name)
    write_dataset(prefix, [np.full(length, token)] * n_docs)
    return prefix


def test_weighted_blend_draws_in_proportion_and_is_cached(tmp_path):
    a, b = _corpus(tmp_path, "a", 1), _corpus(tmp_path, "b", 2, n_docs=10)
    cfg = GPTDatasetConfig(sequence_length=8, split="1")
    train, valid, test = build_train_valid_test_datasets(["0.25", a, "0.75", b], "1", (400, 0, None), cfg)
    assert isinstance(train, BlendedDataset) and valid is None and test is None
    assert len(train) >= 400
    sources = [int(train[i]["tokens"][0]) for i in range(len(train))]
    assert abs(sources.count(1) / len(train) - 0.25) < 0.01
    for i in range(0, len(train), 37):  # blended sample i is sample k of component d
        d, k = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        assert np.array_equal(train[i]["tokens"].numpy(), train.datasets[d][k]["tokens"].numpy())
    # The 10-document corpus b had to be repeated over epochs to supply 75%.
    assert train.datasets[1].num_epochs > 1
    assert train.built_anew_on_cache_miss
    again, _, _ = build_train_valid_test_datasets(["0.25", a, "0.75", b], "1", (400, 0, None), cfg)
    assert not again.built_anew_on_cache_miss
    np.testing.assert_array_equal(again.dataset_index, train.dataset_index)


def test_unweighted_list_is_weighted_by_one_epoch_samples(tmp_path):
    """Megatron: each prefix weighs the samples of one epoch, (tokens - 1) // seq; the blend is capped there."""
    from megatron_cai.core.datasets.indexed_dataset import IndexedDataset

    a, b = _corpus(tmp_path, "a", 1, n_docs=30), _corpus(tmp_path, "b", 2, n_docs=10)
    epoch = [(int(IndexedDataset(p).sequence_lengths.sum()) - 1) // 8 for p in (a, b)]
    cfg = GPTDatasetConfig(sequence_length=8)
    train, _, _ = build_train_valid_test_datasets([a, b], "1", (20, 0, 0), cfg)
    assert train.weights == pytest.approx([epoch[0] / sum(epoch), epoch[1] / sum(epoch)])
    assert len(train) == 20


def test_single_prefix_and_split_membership(tmp_path):
    prefix = str(tmp_path / "one")
    write_dataset(prefix, [np.full(12, d + 1) for d in range(10)])
    cfg = GPTDatasetConfig(sequence_length=6)
    train, valid, test = build_train_valid_test_datasets(prefix, "6,3,1", (100, 50, 10), cfg)
    assert all(isinstance(x, GPTDataset) for x in (train, valid, test))
    for ds, ids in ((train, {1, 2, 3, 4, 5, 6}), (valid, {7, 8, 9}), (test, {10})):
        seen = set()
        for i in range(len(ds)):
            seen |= set(ds[i]["tokens"].tolist()) | set(ds[i]["labels"].tolist())
        assert seen == ids
    # A zero-weight split, a zero-sample request and an empty split give None.
    train, valid, test = build_train_valid_test_datasets(prefix, "8,2,0", (10, 0, 10), cfg)
    assert train is not None and valid is None and test is None
    _, _, test = build_train_valid_test_datasets(prefix, "969,30,1", (10, 10, 10), cfg)
    assert test is None  # round(0.999 * 10) == 10: no test documents


def test_data_path_forms_and_errors(tmp_path):
    assert get_blend_from_list("p") == (["p"], None)
    assert get_blend_from_list(["p", "q"]) == (["p", "q"], None)
    assert get_blend_from_list(["1", "p", "3", "q"]) == (["p", "q"], [1.0, 3.0])
    with pytest.raises(ValueError, match="mix"):
        get_blend_from_list(["1", "p", "q"])
    with pytest.raises(ValueError, match="weights"):
        get_blend_from_list(["-1", "p", "2", "q"])
    cfg = GPTDatasetConfig(sequence_length=8)
    missing = str(tmp_path / "nothing_here")
    with pytest.raises(IndexedDatasetError, match="nothing_here"):
        build_train_valid_test_datasets([missing], "1", (10, 0, 0), cfg)


def test_component_too_short_is_reported(tmp_path):
    a = _corpus(tmp_path, "a", 1)
    cfg = GPTDatasetConfig(sequence_length=8)
    train, _, _ = build_train_valid_test_datasets(a, "1", (None, 0, 0), cfg)
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset([train, train], [0.5, 0.5], 3 * len(train), "train", str(tmp_path / "c"))

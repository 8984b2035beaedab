"""MegatronPretrainingSampler and the pretraining loader: DP slicing and exact resume."""
import numpy as np
import pytest
import torch
from testlib.data import random_docs, write_dataset

from megatron_cai.core.datasets.data_samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from megatron_cai.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_cai.core.datasets.indexed_dataset import IndexedDataset


def test_dp_ranks_take_their_slice_of_each_block():
    mbs, dp, total = 2, 3, 20
    per_rank = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    # Block k covers global indices [6k, 6k + 6); rank r gets [6k + 2r, 6k + 2r + 2).
    for r in range(dp):
        assert per_rank[r] == [[6 * k + 2 * r, 6 * k + 2 * r + 1] for k in range(3)]
        assert len(MegatronPretrainingSampler(total, 0, mbs, r, dp)) == 3
    # drop_last=False yields the tail 18, 19 to rank 0 only.
    tails = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp, drop_last=False))[3:] for r in range(dp)]
    assert tails == [[[18, 19]], [], []]


@pytest.mark.parametrize("dp", [1, 2])
def test_resume_from_consumed_samples_continues_the_same_stream(dp):
    mbs, total = 3, 50
    full = {r: list(MegatronPretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)}
    for steps in (1, 4):
        consumed = steps * mbs * dp
        for r in range(dp):
            resumed = list(MegatronPretrainingSampler(total, consumed, mbs, r, dp))
            assert resumed == full[r][steps:]


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="exhausted"):
        MegatronPretrainingSampler(10, 10, 2, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)
    with pytest.raises(ValueError, match="no samples"):
        MegatronPretrainingSampler(0, 0, 2, 0, 1)


def test_loader_yields_stacked_dict_batches_and_resumes_exactly(tmp_path):
    prefix = str(tmp_path / "d")
    write_dataset(prefix, random_docs(0, 40, eod=0))
    cfg = GPTDatasetConfig(sequence_length=16, eod_token_id=0, reset_position_ids=True,
                           reset_attention_mask=True, eod_mask_loss=True)
    ds = GPTDataset(IndexedDataset(prefix), prefix, np.arange(40), 64, "train", cfg)
    mbs = 4
    batches = list(build_pretraining_data_loader(ds, 0, mbs))
    assert len(batches) == len(ds) // mbs
    first = batches[0]
    assert set(first) == {"tokens", "labels", "loss_mask", "position_ids", "visibility_start",
                          "visibility_limit"}
    assert first["tokens"].shape == (mbs, 16) and first["tokens"].dtype == torch.int64
    assert first["loss_mask"].dtype == torch.float32 and first["visibility_limit"].dtype == torch.int32
    for k in range(mbs):  # batch rows are dataset items 0..3 in order
        for key, value in ds[k].items():
            assert torch.equal(first[key][k], value)
    # Resume after 3 micro-batches: identical continuation.
    resumed = list(build_pretraining_data_loader(ds, 3 * mbs, mbs))
    assert len(resumed) == len(batches) - 3
    for a, b in zip(resumed, batches[3:]):
        assert all(torch.equal(a[key], b[key]) for key in a)
    # Two DP ranks together read the same samples as one rank with twice the batch.
    r0 = list(build_pretraining_data_loader(ds, 0, 2, 0, 2))
    r1 = list(build_pretraining_data_loader(ds, 0, 2, 1, 2))
    joined = torch.cat([r0[0]["tokens"], r1[0]["tokens"]])
    assert torch.equal(joined, batches[0]["tokens"])
    assert build_pretraining_data_loader(None, 0, 2) is None


def test_loader_with_workers_matches_in_process(tmp_path):
    prefix = str(tmp_path / "w")
    write_dataset(prefix, random_docs(1, 30))
    ds = GPTDataset(IndexedDataset(prefix), prefix, np.arange(30), 20, "train",
                    GPTDatasetConfig(sequence_length=8))
    plain = list(build_pretraining_data_loader(ds, 4, 2))
    workers = list(build_pretraining_data_loader(ds, 4, 2, num_workers=2))
    assert len(plain) == len(workers)
    for a, b in zip(plain, workers):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])

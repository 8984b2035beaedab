"""What the world size decides (training/flags/layout.py): the interleaved schedule's micro-batch groups are checked at
start-up with megatron-core's rules, for every micro-batch count of the run, and reach the parallel config."""
from __future__ import annotations

import pytest

from megatron_cai.training.arguments import parse_config
from megatron_cai.training.config import ArgumentError

# PP 4 x VP 2 on 4 ranks (DP 1): the global batch is the micro-batch count
BASE = ["--num-layers", "8", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "4", "--mock-data",
        "--vocab-size", "64", "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
GROUP = "--microbatch-group-size-per-virtual-pipeline-stage"


def _config(*extra: str):
    return parse_config(BASE + list(extra), world_size=4)


def test_five_microbatches_in_a_group_of_five():
    config = _config("--global-batch-size", "5", GROUP, "5")
    assert config.training.num_microbatches == 5
    assert config.parallel.microbatch_group_size_per_vp_stage == 5
    assert config.parallel.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize("extra,message", [
    # the default group (PP 4) with 5 micro-batches: a remainder of 1
    (["--global-batch-size", "5"], "unset \\(= --pipeline-model-parallel-size 4\\) with 5 micro-batches per "
                                   "iteration.*should be 0, or larger than or equal to the pipeline-parallel size, "
                                   "but it is 1"),
    (["--global-batch-size", "5", GROUP, "6"], "should range in \\[PP=4 , M=5\\]"),
    (["--global-batch-size", "5", GROUP, "3"], "should range in \\[PP=4 , M=5\\]"),
    (["--global-batch-size", "7", GROUP, "5"], "but it is 2"),
    # a ramp-up passes through 6 micro-batches, which groups of 5 leave a remainder of 1
    (["--global-batch-size", "10", GROUP, "5", "--rampup-batch-size", "6", "4", "8"], "with 6 micro-batches"),
    (["--global-batch-size", "8", "--eval-global-batch-size", "6"], "with 6 micro-batches"),
])
def test_megatron_core_rules_are_checked_at_start_up(extra, message):
    with pytest.raises(ArgumentError, match=message):
        _config(*extra)


def test_groups_need_no_multiple_of_the_pipeline_size():
    assert _config("--global-batch-size", "9", GROUP, "5").training.num_microbatches == 9  # groups 5 + 4 (>= PP)
    assert _config("--global-batch-size", "8").parallel.microbatch_group_size_per_vp_stage is None

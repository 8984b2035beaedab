"""Uneven pipeline splits train exactly as one process does (Megatron-LM's --decoder-first/last-pipeline-num-layers
and --account-for-embedding/loss-in-pipeline-split, the layers per stage from core.pipeline_parallel.layer_split)."""

import pytest
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train

BASE = TINY_MODEL + [
    "--mock-data",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "4",
    "--lr",
    "3e-3",
    "--log-interval",
    "100",
    "--eval-interval",
    "0",
    "--eval-iters",
    "0",
    "--seed",
    "7",
]


def _worker(rank, world_size, argv):
    held = []
    result = train(argv, world_size, lambda trainer: held.extend(m.module.layer_numbers for m in trainer.model))
    return {**result, "layers": held}


def _run(world_size, extra, layers=None):
    """The run's history; ``layers``: the layers each rank's chunks must hold."""
    results = run_distributed(_worker, world_size, (BASE + extra,))
    if layers is not None:
        assert [r["layers"] for r in sorted(results, key=lambda r: r["rank"])] == layers
    return last_stage_history(results)


def _assert_same(got, reference):
    assert len(got) == len(reference) == 4
    for i, (a, b) in enumerate(zip(got, reference)):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6), f"iteration {i + 1} {key}"


def test_pp2_first_stage_one_layer_matches_one_process():
    """4 layers at PP 2 with --decoder-first-pipeline-num-layers 1: stage 0 holds layer 0, stage 1 layers 1-3."""
    _assert_same(
        _run(
            2, ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"], [[[0]], [[1, 2, 3]]]
        ),
        _run(1, []),
    )


@pytest.mark.slow
def test_pp2_vpp2_embedding_and_loss_counted_matches_one_process():
    """2 layers at PP 2 x VPP 2 with the embedding and the loss counted in the split: the first chunk holds only
    the embedding, the last only the final norm and loss (Megatron-LM's functional-test layout, scaled down)."""
    sizes = ["--num-layers", "2"]
    _assert_same(
        _run(
            2,
            sizes
            + [
                "--pipeline-model-parallel-size",
                "2",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split",
            ],
            [[[], [1]], [[0], []]],
        ),
        _run(1, sizes),
    )

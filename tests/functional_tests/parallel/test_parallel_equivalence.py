"""TP x PP x DP runs match a single-process run with the same global batch and initialisation."""
import pytest
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train

BASE = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5",
                     "--lr", "3e-3", "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0",
                     "--group-query-attention", "--num-query-groups", "2", "--seed", "7"]


def _worker(rank, world_size, argv):
    return train(argv, world_size)


def _run(world_size, extra):
    return last_stage_history(run_distributed(_worker, world_size, (BASE + extra,)))


@pytest.fixture(scope="module")
def reference():
    return _run(1, [])


LAYOUTS = {
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    # One KV head, two TP ranks: the KV projection is replicated and its gradient summed over TP.
    "tp2_mqa_replicated_kv": (2, ["--tensor-model-parallel-size", "2", "--num-query-groups", "1"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2_overlap": (2, ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"]),
    "dp2_distopt": (2, ["--use-distributed-optimizer"]),
    "tp2pp2dp2_all": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                          "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000",
                          "--sequence-parallel"]),
    "tp2pp2dp2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "pp2dp2_interleaved": (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                               "1", "--use-distributed-optimizer", "--overlap-grad-reduce"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_matches_single_process(name, reference):
    world, extra = LAYOUTS[name]
    got = _run(world, extra)
    if "--num-query-groups" in extra:  # another architecture: its own single-process reference
        reference = _run(1, extra[extra.index("--num-query-groups"):][:2])
    assert len(got) == len(reference) == 5
    for i, (a, b) in enumerate(zip(got, reference)):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), f"iteration {i + 1} {key}: {a[key]} vs {b[key]}"

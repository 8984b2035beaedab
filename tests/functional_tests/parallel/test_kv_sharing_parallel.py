"""Cross-layer KV sharing with per-layer windows under TP 2 + SP and PP 2 matches the single-process run (which
equals the explicit reference: tests/unit_tests/model/test_kv_sharing.py); a sharing group split over pipeline
stages stops the run with the error naming both layers; CP 2 and FSDP2 match it too (slow); resuming a sharing
model from a checkpoint is bit-exact."""
import pytest
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train

from megatron_cai.training import checkpoint

KAIJU = ["--group-query-attention", "--num-query-groups", "1", "--window-size", "5", "--window-attn-skip-freq", "2",
         "--kv-share-pattern", "[0,0,2,2]", "--attention-backend", "cpu"]
BASE = TINY_MODEL + KAIJU + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters",
                             "5", "--lr", "3e-3", "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0",
                             "--seed", "7"]


def _worker(rank, world_size, argv):
    return train(argv, world_size)


def _run(world_size, extra):
    return last_stage_history(run_distributed(_worker, world_size, (BASE + extra,)))


@pytest.fixture(scope="module")
def reference():
    return _run(1, [])


@pytest.mark.parametrize("extra", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                   ["--pipeline-model-parallel-size", "2"]], ids=["tp2_sp", "pp2"])
def test_matches_single_process(extra, reference):
    got = _run(2, extra)
    assert len(got) == len(reference) == 5
    for i, (a, b) in enumerate(zip(got, reference)):
        assert a["lm loss"] == pytest.approx(b["lm loss"], rel=1e-6, abs=0), f"iteration {i + 1} loss"
        assert a["grad norm"] == pytest.approx(b["grad norm"], rel=1e-5, abs=0), f"iteration {i + 1} grad norm"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--context-parallel-size", "2"], ["--use-torch-fsdp2"]], ids=["cp2", "fsdp2"])
def test_matches_single_process_with_cp_and_fsdp2(extra, reference):
    """Context parallelism (the shared K/V are the source layer's local chunk, fetched by the sharer's split
    attention like the source's own) and FSDP2 over two data-parallel ranks."""
    got = _run(2, extra)
    assert len(got) == len(reference) == 5
    for i, (a, b) in enumerate(zip(got, reference)):
        assert a["lm loss"] == pytest.approx(b["lm loss"], rel=1e-6, abs=0), f"iteration {i + 1} loss"
        assert a["grad norm"] == pytest.approx(b["grad norm"], rel=1e-5, abs=0), f"iteration {i + 1} grad norm"


def test_group_split_over_pipeline_stages_is_refused():
    """Refused while the flags are read, on every rank alike (no rank builds a model and waits for a peer)."""
    from megatron_cai.training.arguments import parse_config
    from megatron_cai.training.errors import UserError

    with pytest.raises(UserError, match="layer 2 takes K/V from layer 0, which is in another pipeline stage"):
        parse_config(BASE + ["--pipeline-model-parallel-size", "2", "--kv-share-pattern", "[0,0,0,3]"], world_size=2)
    parse_config(BASE + ["--pipeline-model-parallel-size", "2"], world_size=2)  # [0,0,2,2] fits two stages
    with pytest.raises(UserError, match="layer 1 takes K/V from layer 0"):  # virtual stages of one layer each
        parse_config(BASE + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                             "--global-batch-size", "8"], world_size=2)


def test_resume_is_bit_exact(tmp_path):
    straight = [h["lm loss"] for h in _run(1, ["--train-iters", "6"])]
    save = str(tmp_path / "ckpt")
    first = [h["lm loss"] for h in _run(1, ["--train-iters", "6", "--save", save, "--exit-interval", "3"])]
    assert checkpoint.read_tracker(save) == 3
    second = [h["lm loss"] for h in _run(1, ["--train-iters", "6", "--load", save])]
    assert first + second == straight

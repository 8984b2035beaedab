"""Resume after a layout change: save at (TP, PP, DP) = (2, 2, 1), convert, resume; the losses continue
exactly like an uninterrupted run (parallel runs are numerically equivalent in fp32 without dropout)."""
import contextlib
import io
import json
import os
import shutil
import sys

import pytest
import torch
from testlib import TOOLS
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, last_stage_history, train

from megatron_cai.training.checkpoint import ConversionError, reshard_checkpoint

sys.path.insert(0, TOOLS)

# MQA (1 KV head): the KV projection is replicated under TP = 2 and split (trivially) under TP = 1.
BASE = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
                     "--log-interval", "100", "--eval-interval", "0", "--eval-iters", "0", "--seed", "11",
                     "--group-query-attention", "--num-query-groups", "1", "--train-iters", "6"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _worker(rank, world_size, argv):
    return train(argv, world_size)


def _run(world, argv):
    return last_stage_history(run_distributed(_worker, world, (BASE + argv,)))


def _quiet(*a, **k):
    pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 6-iteration run at (2, 2, 1) that also saves at iteration 3 (and 6)."""
    ckpt = str(tmp_path_factory.mktemp("ref") / "ckpt")
    hist = _run(4, TP2PP2 + ["--save", ckpt, "--save-interval", "3"])
    assert len(hist) == 6
    return ckpt, hist


def _assert_continues(got, reference_hist):
    assert len(got) == 3, "resume should run iterations 4..6 only"
    for i, (a, b) in enumerate(zip(got, reference_hist[3:])):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), f"iteration {i + 4} {key}: {a[key]} vs {b[key]}"


def _rank_payloads(root, iteration):
    out = {}
    it = os.path.join(root, f"iter_{iteration:07d}")
    for d in sorted(os.listdir(it)):
        if d.startswith("mp_rank_"):
            out[d] = torch.load(os.path.join(it, d, "model_optim_rng.pt"), map_location="cpu", weights_only=False)
    return out


def test_convert_to_dp2_and_back(reference, tmp_path):
    ckpt, ref = reference
    flat = str(tmp_path / "tp1pp1")
    reshard_checkpoint(ckpt, flat, 1, 1, step=3, log=_quiet)
    meta = json.load(open(os.path.join(flat, "iter_0000003", "metadata.json")))
    assert (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) == (1, 1)
    # The vocabulary is re-padded for TP = 1: 100 -> 104 rows (multiple of 8), was 112 (multiple of 16).
    payload = torch.load(os.path.join(flat, "iter_0000003", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    assert payload["model"]["model0"]["embedding.word_embeddings.weight"].shape[0] == 104
    assert "output_layer.weight" not in payload["model"]["model0"]  # tied: no copy with a single stage
    assert payload["iteration"] == 3 and payload["consumed_train_samples"] == 24

    _assert_continues(_run(2, ["--load", flat, "--use-distributed-optimizer"]), ref)   # (1, 1, 2)
    _assert_continues(train(BASE + ["--load", flat])["history"], ref)                 # (1, 1, 1), in-process

    back = str(tmp_path / "tp2pp2")
    reshard_checkpoint(flat, back, 2, 2, log=_quiet)
    # Back at the original layout, every weight and Adam moment is bit-identical to the saved one.
    orig, again = _rank_payloads(ckpt, 3), _rank_payloads(back, 3)
    assert sorted(orig) == sorted(again) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    for rank in orig:
        a, b = orig[rank], again[rank]
        sd_a, sd_b = a["model"]["model0"], b["model"]["model0"]
        assert sorted(sd_a) == sorted(sd_b)
        tp_rank = int(rank.split("_")[2])
        for name in sd_a:
            rows = None  # local rows that are real vocabulary entries (the padding was rebuilt as zeros)
            if "word_embeddings" in name or name == "output_layer.weight":
                rows = max(0, min(56, 100 - 56 * tp_rank))
            assert torch.equal(sd_a[name][:rows], sd_b[name][:rows]), (rank, name)
        for name, st in a["optimizer"]["param_state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[k], b["optimizer"]["param_state"][name][k]), (rank, name, k)
        assert a["optimizer"]["step"] == b["optimizer"]["step"] == 3
        assert a["opt_param_scheduler"] == b["opt_param_scheduler"]
        assert a["tp_layout"] == b["tp_layout"]
    _assert_continues(_run(4, TP2PP2 + ["--load", back]), ref)


def test_convert_to_interleaved_pipeline(reference, tmp_path):
    ckpt, ref = reference
    import convert_checkpoint  # the CLI

    out = str(tmp_path / "pp2_vpp")
    with contextlib.redirect_stdout(io.StringIO()):
        assert convert_checkpoint.main(["--load", ckpt, "--save", out, "--ckpt-step", "3",
                                        "--target-tensor-parallel-size", "1", "--target-pipeline-model-parallel-size",
                                        "2", "--target-num-layers-per-virtual-pipeline-stage", "1"]) == 0
    meta = json.load(open(os.path.join(out, "iter_0000003", "metadata.json")))
    assert meta["virtual_pipeline_model_parallel_size"] == 2
    stage0 = torch.load(os.path.join(out, "iter_0000003", "mp_rank_00_000", "model_optim_rng.pt"), weights_only=False)
    layers = [sorted({n.split(".")[2] for n in sd if n.startswith("decoder.layers.")})
              for sd in stage0["model"].values()]
    assert layers == [["0"], ["2"]]  # Megatron's interleaved order: rank 0 holds layers 0 and 2
    _assert_continues(_run(2, ["--load", out, "--pipeline-model-parallel-size", "2",
                               "--num-layers-per-virtual-pipeline-stage", "1"]), ref)


def test_impossible_target_layouts(reference, tmp_path):
    ckpt, _ = reference
    with pytest.raises(ConversionError, match="num-attention-heads 4 is not divisible"):
        reshard_checkpoint(ckpt, str(tmp_path / "x"), 3, 1, step=3, log=_quiet)
    with pytest.raises(ConversionError, match="num-layers 4 is not divisible"):
        reshard_checkpoint(ckpt, str(tmp_path / "x"), 1, 3, step=3, log=_quiet)
    with pytest.raises(ConversionError, match="iter_0000005"):
        reshard_checkpoint(ckpt, str(tmp_path / "x"), 1, 1, step=5, log=_quiet)
    broken = str(tmp_path / "broken")
    shutil.copytree(ckpt, broken)
    os.remove(os.path.join(broken, "iter_0000006", "mp_rank_01_001", "model_optim_rng.pt"))
    with pytest.raises(ConversionError, match="mp_rank_01_001.*missing"):
        reshard_checkpoint(broken, str(tmp_path / "x"), 1, 1, log=_quiet)

"""--ckpt-format torch_dist (torch.distributed.checkpoint): resume into another TP x PP x DP x VPP layout with
no conversion step, bit-exact in the same layout (Squinch residuals, RNG), FSDP2, the torch <-> torch_dist
converter, --auto-detect-ckpt-format and the errors for damaged or mismatched checkpoints."""
import os
import sys

import pytest
import torch
from testlib import TOOLS
from testlib.distributed import run_distributed
from testlib.train import last_stage_history, train

from functional_tests.parallel.test_parallel_equivalence import BASE as EQUIV_BASE
from megatron_cai.training import checkpoint
from megatron_cai.training.checkpoint import load_torch

sys.path.insert(0, TOOLS)

# GQA (2 query groups: K/V split over TP=2), SwiGLU (fused [gate, up] fc1 sections), tied embeddings (a
# copy on the last pipeline stage), vocabulary padding that depends on TP (100 -> 104 at TP 1, 112 at TP 2).
BASE = [a for a in EQUIV_BASE if a not in ("--train-iters", "5", "--squared-relu")] + ["--swiglu", "--ckpt-format",
                                                                                        "torch_dist"]
ITERS, HALF = 10, 5
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]
FSDP = ["--use-torch-fsdp2"]


def _worker(rank, world_size, argv):
    return train(argv, world_size)


def _run(world, argv):
    return last_stage_history(run_distributed(_worker, world, (argv,)))


def _close(got, ref, rel=1e-5):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=rel), f"iteration {i + 1} {key}: {a[key]} vs {b[key]}"


def _exact(got, ref):
    assert [(h["lm loss"], h["grad norm"]) for h in got] == [(h["lm loss"], h["grad norm"]) for h in ref]


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted single-process run (no checkpoint)."""
    return _run(1, BASE + ["--train-iters", str(ITERS)])


@pytest.fixture(scope="module")
def saved_tp2pp2(tmp_path_factory):
    """(TP, PP, DP) = (2, 2, 1) with the distributed optimizer, saving torch_dist at iterations 5 and 10."""
    save = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    hist = _run(4, BASE + TP2PP2 + DISTOPT + ["--train-iters", str(ITERS), "--save", save,
                                              "--save-interval", str(HALF)])
    return save, hist


def _resume(save, world, extra):
    return _run(world, BASE + extra + ["--train-iters", str(ITERS), "--load", save, "--ckpt-step", str(HALF)])


RESHARD = {  # name: (world, flags)
    "tp1pp1dp4": (4, DISTOPT),
    "tp2pp1dp2": (4, DISTOPT + ["--tensor-model-parallel-size", "2"]),
    "tp1pp2dp2_interleaved": (4, DISTOPT + ["--pipeline-model-parallel-size", "2",
                                            "--num-layers-per-virtual-pipeline-stage", "1"]),
    "fsdp2_tp1pp1dp4": (4, FSDP),
}


def test_saved_layout_matches_reference(saved_tp2pp2, reference):
    _close(saved_tp2pp2[1], reference)
    it = os.path.join(saved_tp2pp2[0], "iter_0000005")
    assert os.path.isfile(os.path.join(it, ".metadata")) and not any(n.startswith("mp_rank") for n in os.listdir(it))


@pytest.mark.parametrize("name", list(RESHARD))
def test_resume_in_another_layout(name, saved_tp2pp2, reference):
    """Saved at (2, 2, 1); resumed directly (no conversion) in another layout: the next 5 iterations match
    the uninterrupted single-process run to 1e-5."""
    world, extra = RESHARD[name]
    _close(_resume(saved_tp2pp2[0], world, extra), reference[HALF:])


def test_resume_same_layout_is_bit_exact(saved_tp2pp2):
    _exact(_resume(saved_tp2pp2[0], 4, TP2PP2 + DISTOPT), saved_tp2pp2[1][HALF:])


SQUINCH = ["--squinch", "--hidden-dropout", "0.1"]


@pytest.mark.parametrize("world,extra", [
    (2, SQUINCH + DISTOPT),
    (4, SQUINCH + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    (2, SQUINCH + FSDP),
], ids=["dp2_distopt", "pp2dp2_interleaved", "fsdp2_dp2"])
def test_same_layout_bit_exact_with_squinch(tmp_path, world, extra):
    """8 iterations straight == 4, save torch_dist, exit, resume, 4 (Squinch error feedback and dropout on:
    the residuals and the RNG must be restored exactly)."""
    args = BASE + extra + ["--train-iters", "8"]
    straight = _run(world, args)
    save = str(tmp_path / "ckpt")
    first = _run(world, args + ["--save", save, "--exit-interval", "4"])
    second = _run(world, args + ["--load", save])
    _exact(first, straight[:4])
    _exact(second, straight[4:])


def test_fsdp2_resume_other_dp_and_ddp(tmp_path, reference):
    """FSDP2 at DP=2 saves; resumes bit-exactly in the same layout, and to 1e-5 at DP=4 and as DDP."""
    save = str(tmp_path / "ckpt")
    hist = _run(2, BASE + FSDP + ["--train-iters", str(ITERS), "--save", save, "--save-interval", str(HALF)])
    _close(hist, reference)
    saved = checkpoint.read_dcp_metadata(os.path.join(save, "iter_0000005")).state_dict_metadata
    for key in ("embedding.word_embeddings.weight", "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"):
        rows = sorted(c.offsets[0] for c in saved[key].chunks)  # each DP rank wrote its own shard's rows
        assert len(rows) >= 2 and rows[0] == 0, (key, rows)
    _exact(_resume(save, 2, FSDP), hist[HALF:])
    _close(_resume(save, 4, FSDP), reference[HALF:])
    _close(_resume(save, 2, ["--tensor-model-parallel-size", "2"]), reference[HALF:])


# ------------------------------------------------------------------------------ per-rank state policy
def _rng_worker(rank, world_size, argv):
    held = {}

    def hook(trainer):
        held["rng"] = torch.get_rng_state()
    train(argv, world_size, trainer_hook=hook)
    return held["rng"]


def test_other_layout_keeps_fresh_rng_and_logs_once(saved_tp2pp2, capfd):
    """In another layout the saved per-rank RNG is not applied: each rank starts from a fresh run's state."""
    args = BASE + ["--train-iters", str(HALF + 1), "--hidden-dropout", "0.1"]
    fresh = run_distributed(_rng_worker, 2, (args,))
    capfd.readouterr()
    resumed = run_distributed(_rng_worker, 2, (args + ["--load", saved_tp2pp2[0], "--ckpt-step", str(HALF)],))
    out = capfd.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(fresh, resumed))
    lines = [line for line in out.splitlines() if "per-rank RNG state" in line]
    assert len(lines) == 1 and "not restored" in lines[0], out[-2000:]


# ---------------------------------------------------------------------------------------- conversion
def _convert(*argv):
    import convert_checkpoint

    return convert_checkpoint.main(list(argv))


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory):
    """A torch-format checkpoint at (TP, PP, DP) = (2, 1, 2) with Squinch residuals and dropout."""
    save = str(tmp_path_factory.mktemp("torchfmt") / "ckpt")
    args = [a if a != "torch_dist" else "torch" for a in BASE] + ["--tensor-model-parallel-size", "2", "--squinch",
                                                                  "--hidden-dropout", "0.1", "--train-iters", "8"]
    hist = _run(4, args + ["--save", save, "--save-interval", "4"])
    return save, args, hist


def test_torch_to_dist_and_back_round_trip(torch_ckpt, tmp_path, capfd):
    src, args, hist = torch_ckpt
    dist_dir, back = str(tmp_path / "dist"), str(tmp_path / "back")
    assert _convert("--load", src, "--save", dist_dir, "--target-ckpt-format", "torch_dist", "--ckpt-step", "4") == 0
    assert checkpoint.detect_format(dist_dir, 4) == "torch_dist"
    assert _convert("--load", dist_dir, "--save", back, "--target-ckpt-format", "torch") == 0
    assert checkpoint.detect_format(back, 4) == "torch"
    for rank_dir in ("mp_rank_00", "mp_rank_01"):
        a = load_torch(os.path.join(src, "iter_0000004", rank_dir, "model_optim_rng.pt"))
        b = load_torch(os.path.join(back, "iter_0000004", rank_dir, "model_optim_rng.pt"))
        for k, t in a["model"]["model0"].items():
            assert torch.equal(t, b["model"]["model0"][k]), k
        for k, st in a["optimizer"]["param_state"].items():
            for m in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[m], b["optimizer"]["param_state"][k][m]), (k, m)
        assert a["optimizer"]["step"] == b["optimizer"]["step"] and a["opt_param_scheduler"] == b["opt_param_scheduler"]
        for r in range(2):
            ra = load_torch(os.path.join(src, "iter_0000004", rank_dir, f"reducer_dp_{r:03d}.pt"))
            rb = load_torch(os.path.join(back, "iter_0000004", rank_dir, f"reducer_dp_{r:03d}.pt"))
            assert all(torch.equal(x, y) for sa, sb in zip(ra, rb)
                       for x, y in zip(sa["residuals"].values(), sb["residuals"].values()))
    # the converted torch_dist checkpoint resumes bit-exactly in the saving layout (RNG and residuals kept)
    resumed = _run(4, [a if a != "torch" else "torch_dist" for a in args] + ["--load", dist_dir])
    _exact(resumed, hist[4:])
    # in another layout (TP 1, DP 2) the saved residuals and RNG are not applied, with one line
    capfd.readouterr()
    other = BASE + ["--squinch", "--hidden-dropout", "0.1", "--train-iters", "8", "--load", dist_dir]
    assert len(_run(2, other)) == 4
    lines = [ln for ln in capfd.readouterr().out.splitlines() if "do not apply" in ln]
    assert len(lines) == 1 and "Squinch error-feedback residuals" in lines[0] and "without residuals" in lines[0]


def test_auto_detect_and_format_mismatch(torch_ckpt, saved_tp2pp2, reference):
    src, args, hist = torch_ckpt
    with pytest.raises(AssertionError, match=r"iter_0000008 is a torch checkpoint but this run reads --ckpt-format "
                                             r"torch_dist: .*--auto-detect-ckpt-format"):
        _run(4, [a if a != "torch" else "torch_dist" for a in args] + ["--load", src])
    # --ckpt-format torch_dist (saves) + --auto-detect-ckpt-format: the torch checkpoint is read as such
    args_dist = [a if a != "torch" else "torch_dist" for a in args]
    hist8 = _run(4, args_dist[:-1] + ["8", "--load", src, "--ckpt-step", "4", "--auto-detect-ckpt-format"])
    _exact(hist8, hist[4:])
    # and a torch-format run reads a torch_dist checkpoint in another layout with the flag
    torch_args = [a if a != "torch_dist" else "torch" for a in BASE]
    got = _run(2, torch_args + ["--train-iters", str(ITERS), "--load", saved_tp2pp2[0], "--ckpt-step", str(HALF),
                                "--auto-detect-ckpt-format"])
    _close(got, reference[HALF:])


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_and_corrupt_metadata_are_named(saved_tp2pp2, tmp_path):
    ckpt = _copy(saved_tp2pp2[0], str(tmp_path / "ckpt"))
    meta = os.path.join(ckpt, "iter_0000005", ".metadata")
    args = BASE + ["--train-iters", str(ITERS), "--load", ckpt, "--ckpt-step", str(HALF)]
    with open(meta, "r+b") as f:
        f.truncate(20)
    with pytest.raises(AssertionError, match=r"iter_0000005/\.metadata does not verify \(truncated\)"):
        _run(1, args)  # the content hashes catch it first
    os.remove(os.path.join(ckpt, "iter_0000005", "checksums.json"))  # loaded unverified: the reader names it
    args += ["--allow-unverified-checkpoint"]
    with pytest.raises(AssertionError, match=r"iter_0000005/\.metadata is corrupt \(20 bytes\)"):
        _run(1, args)
    os.remove(meta)
    with pytest.raises(AssertionError, match=r"iter_0000005/\.metadata is missing: .* not a complete torch_dist"):
        _run(1, args)
    with pytest.raises(AssertionError, match="neither a torch_dist checkpoint .* nor torch-format"):
        _run(1, args + ["--auto-detect-ckpt-format"])
    shard = sorted(f for f in os.listdir(os.path.join(saved_tp2pp2[0], "iter_0000010")) if f.endswith(".distcp"))[0]
    os.remove(os.path.join(ckpt, "iter_0000010", shard))
    with pytest.raises(AssertionError, match=rf"iter_0000010/{shard} does not verify \(missing\)"):
        _run(1, BASE + ["--train-iters", str(ITERS + 1), "--load", ckpt])
    os.remove(os.path.join(ckpt, "iter_0000010", "checksums.json"))  # loaded unverified: the reader names it
    with pytest.raises(AssertionError, match=r"cannot read torch_dist checkpoint .*iter_0000010 on rank 0"):
        _run(1, BASE + ["--train-iters", str(ITERS + 1), "--load", ckpt, "--allow-unverified-checkpoint"])


def test_tracker_written_last_and_no_tmp_left(saved_tp2pp2):
    save = saved_tp2pp2[0]
    assert checkpoint.read_tracker(save) == ITERS
    assert sorted(os.listdir(save)) == ["iter_0000005", "iter_0000010", "latest_checkpointed_iteration.txt"]


def test_no_save_optim_and_finetune(tmp_path, capfd):
    save = str(tmp_path / "ckpt")
    _run(1, BASE + ["--train-iters", "2", "--save", save, "--no-save-optim"])
    saved = checkpoint.read_dcp_metadata(os.path.join(save, "iter_0000002")).state_dict_metadata
    assert not any(k.startswith("optimizer.") for k in saved) and "embedding.word_embeddings.weight" in saved
    capfd.readouterr()
    resumed = _run(1, BASE + ["--train-iters", "3", "--load", save])
    assert len(resumed) == 1 and "holds no optimizer state" in capfd.readouterr().out
    tuned = _run(1, BASE + ["--train-iters", "3", "--load", save, "--finetune"])
    assert len(tuned) == 3  # weights only: from iteration 0

"""torch_dist checkpoints of experts split over ranks: saved at EP 2 x TP 2 (sequence parallel, expert TP 2,
the distributed optimizer, swiglu's [gate, up] expert fc1 split in sections), resumed at EP 4 x TP 1 and at EP 1
(one process) and at EP 2 under FSDP2; saved under FSDP2 at EP 2 (experts sharded over expert DP) and resumed
in one process: the 3 resumed iterations equal the uninterrupted single-process run to 1e-5, and every expert
appears in the checkpoint once, with its global shape."""
from __future__ import annotations

import os

import pytest
from testlib.distributed import run_distributed
from testlib.train import last_stage_history, train, with_activation

from functional_tests.moe.test_expert_parallel import RUN
from megatron_cai.training import checkpoint

ITERS, HALF = 6, 3
BASE = with_activation(RUN, "--swiglu") + ["--ckpt-format", "torch_dist", "--train-iters", str(ITERS)]
SAVER = ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--use-distributed-optimizer"]
KEYS = ("lm loss", "load_balancing_loss", "z_loss", "grad norm")


def _worker(rank, world, argv):
    return train(argv, world)


def _run(world, argv):
    return last_stage_history(run_distributed(_worker, world, (argv,)))


def _close(got, ref):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        for key in KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-5), f"iteration {i + 1} {key}: {a[key]} vs {b[key]}"


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted single-process run (every expert on one rank, no checkpoint)."""
    return _run(1, BASE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, reference):
    save = str(tmp_path_factory.mktemp("moe_dcp") / "ckpt")
    _close(_run(4, BASE + SAVER + ["--save", save, "--save-interval", str(HALF)]), reference)
    return save


@pytest.mark.slow
def test_experts_saved_with_global_shape(saved):
    meta = checkpoint.read_dcp_metadata(os.path.join(saved, f"iter_{HALF:07d}")).state_dict_metadata
    fc1 = "decoder.layers.1.mlp.experts.fc1_weight"
    for key in (fc1, "optimizer.state.exp_avg." + fc1):
        assert list(meta[key].size) == [4, 48, 32]  # 4 experts x [gate 24 | up 24] x hidden 32
        # EP 2 x expert TP 2 x 2 sections: 8 pieces, each expert row block and section written once
        offsets = sorted(tuple(c.offsets) for c in meta[key].chunks)
        assert offsets == sorted((e, s, 0) for e in (0, 2) for s in (0, 12, 24, 36))


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [
    (4, ["--expert-model-parallel-size", "4"]),
    (1, []),
    (4, ["--expert-model-parallel-size", "2", "--use-torch-fsdp2"]),
], ids=["ep4_tp1", "ep1", "ep2_fsdp2"])
def test_resume_at_another_expert_layout(saved, reference, world, extra):
    resumed = _run(world, BASE + extra + ["--load", saved, "--ckpt-step", str(HALF)])
    _close(resumed, reference[HALF:])


@pytest.mark.slow
def test_saved_under_fsdp2_at_ep2_resumes_at_ep1(reference, tmp_path):
    """FSDP2 at EP 2 (world 4: experts sharded over expert DP 2, dense parameters over DP 4) saves each expert's
    shards at their global place: one process resumes from it as from the uninterrupted run."""
    save = str(tmp_path / "ckpt")
    fsdp = ["--expert-model-parallel-size", "2", "--use-torch-fsdp2"]
    _close(_run(4, BASE + fsdp + ["--save", save, "--save-interval", str(HALF)]), reference)
    _close(_run(1, BASE + ["--load", save, "--ckpt-step", str(HALF)]), reference[HALF:])


def _refused_worker(rank, world, argv):
    from megatron_cai.training.checkpoint import CheckpointError

    try:
        train(argv, world)
    except CheckpointError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_torch_format_checkpoint_refused_when_experts_are_split(tmp_path):
    """A torch-format checkpoint (per-TP-rank files, every expert in each) cannot fill experts split over EP:
    --auto-detect-ckpt-format finds one and the load refuses it by name, pointing at the converter."""
    save = str(tmp_path / "ckpt")
    train_args = BASE[:-4] + ["--train-iters", "1"]  # BASE without its format and --train-iters
    _run(1, train_args + ["--ckpt-format", "torch", "--save", save])
    errors = run_distributed(_refused_worker, 2, (train_args + ["--ckpt-format", "torch_dist", "--load", save,
                                                                "--auto-detect-ckpt-format",
                                                                "--expert-model-parallel-size", "2"],))
    assert all(e is not None and "torch-format checkpoint" in e and "--target-ckpt-format torch_dist" in e
               for e in errors), errors


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_converted_to_torch_format_resumes_at_ep1(saved, reference, tmp_path, tp):
    """tools/convert_checkpoint.py --target-ckpt-format torch --target-tensor-parallel-size TP gathers the experts
    saved over EP 2 x expert TP 2 into full tensors, whole on every TP rank (a torch-format run holds experts at
    expert TP 1): a torch-format EP 1 run at TP resumes from it as from the original."""
    import contextlib
    import io
    import sys

    from testlib import TOOLS

    sys.path.insert(0, TOOLS)
    import convert_checkpoint

    out = str(tmp_path / "torch")
    with contextlib.redirect_stdout(io.StringIO()):
        assert convert_checkpoint.main(["--load", saved, "--save", out, "--ckpt-step", str(HALF),
                                        "--target-ckpt-format", "torch", "--target-tensor-parallel-size",
                                        str(tp)]) == 0
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    resumed = _run(tp, BASE[:-4] + ["--train-iters", str(ITERS), "--ckpt-format", "torch", "--load", out]
                   + (layout if tp == 2 else []))
    _close(resumed, reference[HALF:])

"""DiLoCo through the training loop: the seam to parallel state (H = 1 equals plain DP), and checkpoints (a
run killed with an outer all-reduce in flight resumes bit-exactly)."""
from __future__ import annotations

import torch
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL, train

ARGS = TINY_MODEL + ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
                     "--min-lr", "3e-4", "--weight-decay", "0.01", "--clip-grad", "1.0", "--log-interval", "100",
                     "--eval-interval", "0", "--eval-iters", "0", "--train-iters", "10", "--seed", "7"]
SEAM = ["--diloco-inner-steps", "1", "--diloco-islands", "1", "--diloco-outer-bits", "32", "--diloco-outer-lr", "1",
        "--diloco-outer-momentum", "0"]


def _worker(rank, world_size, argv):
    box = {}
    out = train(argv, world_size, trainer_hook=lambda t: box.setdefault("trainer", t))
    weights = torch.cat([m.buffer.param_data.clone() for m in box["trainer"].model])
    return {"losses": [h["lm loss"] for h in out["history"]], "weights": weights,
            "diloco": box["trainer"].state.extra.get("diloco")}


def test_h1_one_island_lr1_no_momentum_equals_plain_dp():
    plain = run_distributed(_worker, 2, (ARGS,))
    seam = run_distributed(_worker, 2, (ARGS + SEAM,))
    assert seam[0]["diloco"]["outer_steps"] == 10
    assert len(plain[0]["losses"]) == 10
    for a, b in zip(plain[0]["losses"], seam[0]["losses"]):
        assert abs(a - b) <= 1e-6, (plain[0]["losses"], seam[0]["losses"])
    for p, s in zip(plain, seam):  # the weights: the outer step's anchor - (anchor - w) rounds where |w| << |anchor|
        assert (p["weights"] - s["weights"]).abs().max().item() <= 1e-5


ISLANDS = ["--diloco-islands", "2", "--diloco-inner-steps", "4", "--diloco-fragments", "2", "--diloco-overlap-steps",
           "1", "--diloco-outer-bits", "6", "--diloco-outer-lr", "0.7", "--diloco-outer-momentum", "0.9",
           "--train-iters", "12"]


class _Killed(Exception):
    pass


def _killed_worker(rank, world_size, argv, kill_at):
    """Train until the outer step due after inner step ``kill_at``; die there, before it lands (the process's
    state is lost: only the checkpoint remains)."""
    def hook(trainer):
        after_step = trainer.diloco.after_step

        def dying(iteration, last=False):
            if iteration == kill_at:
                raise _Killed
            after_step(iteration, last)

        trainer.diloco.after_step = dying

    try:
        train(argv, world_size, trainer_hook=hook)
    except _Killed:
        return kill_at
    return None


def test_resume_after_a_kill_mid_outer_step_is_bit_exact(tmp_path):
    """2 islands x 1 rank, Squinch outer steps, K = 2 fragments overlapped by one inner step: fragment 0 is sent
    after iteration 6 and lands after 7. The first run saves at 6 with that all-reduce in flight and is killed at
    7, before it lands; the resumed run equals the uninterrupted one bit for bit (both islands' weights,
    losses, counters). The run ends with the final average: both islands hold the islands' mean."""
    whole = run_distributed(_worker, 2, (ARGS + ISLANDS,))
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "6"]
    assert run_distributed(_killed_worker, 2, (ARGS + ISLANDS + save, 7)) == [7, 7]
    resumed = run_distributed(_worker, 2, (ARGS + ISLANDS + save + ["--load", str(tmp_path / "ckpt")],))
    assert resumed[0]["losses"] == whole[0]["losses"][6:]
    assert resumed[1]["losses"] == whole[1]["losses"][6:]
    for w, r in zip(whole, resumed):
        assert torch.equal(w["weights"], r["weights"])
    assert torch.equal(whole[0]["weights"], whole[1]["weights"])  # the final average: one model
    # 12 inner steps, each fragment every 4: fragment 0 after 2, 6, 10 (landing at 3, 7, 11), fragment 1 after 4,
    # 8, 12 (the last one lands in the final average, which then averages both fragments once more)
    assert whole[0]["diloco"]["outer_steps"] == 6
    assert whole[0]["diloco"]["final_averages"] == 1
    own = run_distributed(_worker, 2, (ARGS + ISLANDS + ["--no-diloco-final-average"],))
    assert own[0]["losses"] == whole[0]["losses"]
    assert not torch.equal(own[0]["weights"], own[1]["weights"])  # without it, the islands differ at the end
    assert own[0]["diloco"]["outer_steps"] == 5 and own[0]["diloco"]["final_averages"] == 0
    timings = ("link_busy_s", "wait_s")
    assert {k: v for k, v in resumed[0]["diloco"].items() if k not in timings} == \
        {k: v for k, v in whole[0]["diloco"].items() if k not in timings}


def _anchors_worker(rank, world_size, argv):
    box = {}

    def hook(trainer):
        box["anchor"] = torch.cat([f.anchor for f in trainer.diloco.outer.fragments])
        box["weights"] = torch.cat([m.buffer.param_data.clone() for m in trainer.model])

    train(argv, world_size, trainer_hook=hook)
    return box


def test_switching_diloco_on_at_a_plain_checkpoint_anchors_the_loaded_weights(tmp_path):
    ckpt = ["--save", str(tmp_path / "ckpt"), "--train-iters", "2"]
    saved = run_distributed(_worker, 1, (ARGS + ckpt,))[0]["weights"]
    seam = ["--diloco-inner-steps", "2", "--diloco-fragments", "2", "--diloco-outer-lr", "0.5"]
    resume = ["--load", str(tmp_path / "ckpt"), "--train-iters", "3"]  # the hook looks before the 3rd step
    got = run_distributed(_anchors_worker, 1, (ARGS + ckpt + seam + resume,))[0]
    assert torch.equal(got["weights"], saved)
    assert torch.equal(got["anchor"], saved)

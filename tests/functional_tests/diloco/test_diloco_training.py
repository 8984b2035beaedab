"""DiLoCo through the training loop: the seam to parallel state (H = 1 equals plain DP), and checkpoints (a
resume with an outer all-reduce in flight is bit-exact)."""
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

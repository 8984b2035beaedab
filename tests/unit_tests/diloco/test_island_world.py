"""Each DiLoCo island is its own inner-loop job: 2 islands x 2 ranks over gloo.

- The step's read-back (training/step_readback.py): the gradient norm and the non-finite check are the
  island's own (hand-computed sums), while an exit vote on one rank reaches every rank of every island.
- The optimizers' norms (core/optimizer/clip_grads.py) sum over the island, not the world.
- The start (core/diloco/start.py): only the buffers that differ from island 0's cross the link.
"""
from __future__ import annotations

import math

import torch

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.diloco.start import bit_fingerprint, start_from_island_0
from megatron_cai.core.optimizer.clip_grads import GlobalNormClipping
from megatron_cai.training.step_readback import read_step


class _Grads(GlobalNormClipping):
    """The norm over one given gradient (the base class's reduction, nothing else)."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad

    def moment_tensors(self):
        return []

    def owned_grads(self):
        return [self.grad]

    def norm_grads(self):
        return [self.grad]

    def norm_params(self):
        return [self.grad]

    def grad_device(self):
        return self.grad.device


def _worker(rank: int, world: int):
    ps.initialize_model_parallel(1, 1, islands=2)
    try:
        loss = float("nan") if rank == 3 else 1.0 + rank
        stats = [{"lm loss": torch.tensor(loss)}]
        read = read_step(torch.tensor(float(rank + 1), dtype=torch.float64), stats, exit_signal=rank == 1,
                         device=torch.device("cpu"))
        norm = _Grads(torch.full((4,), float(rank + 1))).grad_norm()
        same = torch.linspace(-1, 1, 50)
        other = torch.linspace(-1, 1, 50, dtype=torch.bfloat16) * (1 if ps.get_island_rank() == 0 else 2)
        sent = start_from_island_0([same, other], ps.get_outer_group(), ps.get_outer_global_ranks()[0])
        return read.grad_norm, read.nonfinite_loss, read.exit_requested, read.losses, norm, sent, other
    finally:
        ps.destroy_model_parallel()


def test_an_island_is_its_own_inner_world_and_exits_are_the_worlds():
    from testlib.distributed import run_distributed

    results = run_distributed(_worker, 4)
    for rank, (grad_norm, nonfinite, exit_requested, losses, norm, sent, other) in enumerate(results):
        island = rank // 2
        mates = (1, 2) if island == 0 else (3, 4)  # each rank's norm_sq is rank + 1
        assert math.isclose(grad_norm, math.sqrt(sum(mates))), (rank, grad_norm)
        assert math.isclose(norm, math.sqrt(4 * sum(m * m for m in mates))), (rank, norm)
        assert nonfinite == (island == 1), rank  # rank 3's NaN skips island 1's step, not island 0's
        assert exit_requested, rank  # rank 1's signal stops every island
        if island == 0:
            assert losses["lm loss"] == 1.5  # the island's DP mean
        assert sent == [1], rank  # the seeded buffer is equal everywhere and stays put
        assert torch.equal(other, torch.linspace(-1, 1, 50, dtype=torch.bfloat16)), rank


def test_the_fingerprint_sees_a_changed_or_moved_element():
    w = torch.randn(1000)
    base = bit_fingerprint(w)
    assert torch.equal(base, bit_fingerprint(w.clone()))
    changed = w.clone()
    changed[7] = torch.nextafter(changed[7], torch.tensor(math.inf))  # one bit
    moved = w.clone()
    moved[[3, 900]] = moved[[900, 3]]  # same values, another order
    assert not torch.equal(base, bit_fingerprint(changed))
    assert not torch.equal(base, bit_fingerprint(moved))

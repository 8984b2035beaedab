"""An island that stops mid-run stops the others with one error naming it (engine, and the run's known error)."""
from __future__ import annotations

import datetime

import torch

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.diloco import DilocoConfig, DilocoOuter, FlatWeights, IslandGroups, IslandLostError
from megatron_cai.training.errors import format_known_error


def _worker(rank: int, world: int, overlap: int):
    ps.initialize_model_parallel(1, 1, islands=2, timeout=datetime.timedelta(seconds=30))
    groups = IslandGroups(islands=2, island=ps.get_island_rank(), outer_group=ps.get_outer_group())
    w = torch.zeros(64)
    outer = DilocoOuter(DilocoConfig(islands=2, inner_steps=2, overlap_steps=overlap, outer_bits=32),
                        FlatWeights([w]), groups)
    try:
        for t in range(1, 5):
            if rank == 1 and t == 2:
                return "left before its first outer all-reduce"  # its process ends: island 1 is gone
            w.add_(0.01 * (rank + 1))
            outer.after_inner_step(t)
    except IslandLostError as e:
        return str(e), t
    finally:
        outer.close()
    return "no error"


def test_a_lost_island_is_named_by_the_survivors():
    from testlib.distributed import run_distributed

    from megatron_cai.training.features.diloco import IslandLost

    for overlap in (0, 1):
        message, step = run_distributed(_worker, 2, args=(overlap,))[0]
        assert "island 1 stopped answering" in message, message
        assert "fragment 0 failed on island 0" in message and "resume from the last checkpoint" in message
        assert step == 2 + overlap  # found where the update was due: at the send, or one inner step later
        line = format_known_error(IslandLost(message), rank=0, world=2)
        assert line.startswith("error: [rank 0] the outer all-reduce of fragment 0 failed on island 0")
        assert format_known_error(IslandLost(message), rank=1, world=2) is not None  # every rank that saw it

"""The expert groups (EP, expert TP, TP x EP, expert DP) and the TP x CP / TP x DP x CP groups the router reduces
over are megatron-core 0.19.2's RankGenerator's, for every rank of several layouts."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_cai.core import parallel_state as ps

pytest.importorskip("megatron.core")

LAYOUTS = [  # world, tp, pp, cp, ep, etp
    (8, 1, 1, 1, 2, None), (8, 2, 1, 1, 2, None), (8, 2, 2, 1, 2, 1), (16, 2, 2, 2, 4, 1), (16, 1, 2, 2, 2, 2),
    (8, 1, 1, 2, 4, 1), (16, 4, 1, 1, 2, 2),
]


def _megatron_groups(world, tp, pp, cp, ep, etp):
    from megatron.core.parallel_state import RankGenerator

    etp = etp or tp
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    return {"ep": expert.get_ranks("ep"), "etp": expert.get_ranks("tp"), "tp_ep": expert.get_ranks("tp-ep"),
            "edp": expert.get_ranks("dp"), "tp_cp": dense.get_ranks("tp-cp"),
            "tp_dp_cp": dense.get_ranks("tp-cp-dp"), "dp_cp": dense.get_ranks("dp-cp")}


def _our_groups(monkeypatch, world, tp, pp, cp, ep, etp, rank):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(ps, "new_group", lambda ranks=None, **kw: tuple(ranks))
    ps.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    try:
        return {name: list(ps._s().ranks[name]) for name in ("ep", "etp", "tp_ep", "edp", "tp_cp", "tp_dp_cp",
                                                              "dp_cp")}
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "w{}-tp{}-pp{}-cp{}-ep{}-etp{}".format(*v))
def test_expert_groups_match_megatron_rank_generator(monkeypatch, layout):
    theirs = _megatron_groups(*layout)
    for rank in range(layout[0]):
        ours = _our_groups(monkeypatch, *layout, rank)
        for name, groups in theirs.items():
            mine = [g for g in groups if rank in g]
            assert mine == [ours[name]], (name, rank, ours[name], mine)


def test_an_impossible_expert_layout_names_the_flags():
    with pytest.raises(ps.ParallelLayoutError, match="expert-model-parallel-size 3"):
        ps.check_expert_layout(8, 1, 1, 3)

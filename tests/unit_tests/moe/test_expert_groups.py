"""The expert groups (EP, expert TP, TP x EP, expert DP) and the TP x CP / TP x DP x CP groups the router reduces
over are megatron-core 0.19.2's RankGenerator's, for every rank of several layouts, in megatron-core's default
order and under --use-tp-pp-dp-mapping (its 'tp-cp-ep-pp-dp')."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_cai.core import parallel_state as ps

pytest.importorskip("megatron.core")

LAYOUTS = [  # world, tp, pp, cp, ep, etp
    (8, 1, 1, 1, 2, None), (8, 2, 1, 1, 2, None), (8, 2, 2, 1, 2, 1), (16, 2, 2, 2, 4, 1), (16, 1, 2, 2, 2, 2),
    (8, 1, 1, 2, 4, 1), (16, 4, 1, 1, 2, 2),
]


MEGATRON_ORDERS = {ps.DEFAULT_ORDER: "tp-cp-ep-dp-pp", ps.TP_PP_DP_ORDER: "tp-cp-ep-pp-dp"}


def _megatron_groups(world, tp, pp, cp, ep, etp, order=ps.DEFAULT_ORDER):
    from megatron.core.parallel_state import RankGenerator

    etp = etp or tp
    theirs = MEGATRON_ORDERS[order]
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=theirs)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=theirs)
    return {"ep": expert.get_ranks("ep"), "etp": expert.get_ranks("tp"), "tp_ep": expert.get_ranks("tp-ep"),
            "edp": expert.get_ranks("dp"), "tp_cp": dense.get_ranks("tp-cp"),
            "tp_dp_cp": dense.get_ranks("tp-cp-dp"), "dp_cp": dense.get_ranks("dp-cp")}


def _our_groups(monkeypatch, world, tp, pp, cp, ep, etp, rank, order=ps.DEFAULT_ORDER):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(ps, "new_group", lambda ranks=None, **kw: tuple(ranks))
    ps.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, order=order)
    try:
        return {name: list(ps._s().ranks[name]) for name in ("ep", "etp", "tp_ep", "edp", "tp_cp", "tp_dp_cp",
                                                              "dp_cp")}
    finally:
        ps.destroy_model_parallel()


def _pipeline_groups_differ(world, tp, pp, cp, ep, etp):
    """megatron-core's rule for a pp-inner order: the dense and expert DP sizes must agree when PP > 1."""
    return pp > 1 and world // (tp * pp * cp) != world // ((etp or tp) * ep * pp)


@pytest.mark.parametrize("order", [ps.DEFAULT_ORDER, ps.TP_PP_DP_ORDER])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: "w{}-tp{}-pp{}-cp{}-ep{}-etp{}".format(*v))
def test_expert_groups_match_megatron_rank_generator(monkeypatch, layout, order):
    if order == ps.TP_PP_DP_ORDER and _pipeline_groups_differ(*layout):
        with pytest.raises(ps.ParallelLayoutError, match="--use-tp-pp-dp-mapping"):
            _our_groups(monkeypatch, *layout, 0, order)
        return
    theirs = _megatron_groups(*layout, order)
    for rank in range(layout[0]):
        ours = _our_groups(monkeypatch, *layout, rank, order)
        for name, groups in theirs.items():
            mine = [g for g in groups if rank in g]
            assert mine == [ours[name]], (name, rank, ours[name], mine)


def test_an_impossible_expert_layout_names_the_flags():
    with pytest.raises(ps.ParallelLayoutError, match="expert-model-parallel-size 3"):
        ps.check_expert_layout(8, 1, 1, 3)

"""--use-tp-pp-dp-mapping: the rank groups are megatron-core 0.19.2's RankGenerator's, for its default order
(tp-cp-ep-dp-pp) and the mapped one (tp-cp-ep-pp-dp), over layouts with TP, CP, DP and PP > 1."""
from __future__ import annotations

import typing

import pytest

from megatron_cai.core import parallel_state as ps
from megatron_cai.training.arguments import parse_config

if not hasattr(typing, "override"):  # megatron-core 0.19.2 targets Python >= 3.12
    typing.override = lambda f: f
mps = pytest.importorskip("megatron.core.parallel_state")

LAYOUTS = [(2, 1, 2, 2), (2, 2, 1, 2), (1, 2, 2, 2), (2, 2, 2, 2), (4, 1, 3, 2), (1, 1, 4, 2), (2, 3, 2, 1)]
KINDS = {"tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp-cp", "pp": "pp", "mp": "tp-pp"}


@pytest.mark.parametrize("mapping", [False, True])
@pytest.mark.parametrize("tp,cp,dp,pp", LAYOUTS)
def test_groups_are_megatron_cores(tp, cp, dp, pp, mapping):
    theirs = mps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp,
                               order="tp-cp-ep-pp-dp" if mapping else "tp-cp-ep-dp-pp")
    ours = ps.rank_layouts(tp, cp, dp, pp, ps.TP_PP_DP_ORDER if mapping else ps.DEFAULT_ORDER)
    for kind, token in KINDS.items():
        assert sorted(map(sorted, ours[kind])) == sorted(map(sorted, theirs.get_ranks(token))), kind


def test_the_orders_differ_where_dp_and_pp_both_exceed_one():
    assert ps.rank_layouts(1, 1, 2, 2, ps.DEFAULT_ORDER)["dp"] == [[0, 1], [2, 3]]
    assert ps.rank_layouts(1, 1, 2, 2, ps.TP_PP_DP_ORDER)["dp"] == [[0, 2], [1, 3]]


def test_the_flag_reaches_the_parallel_config():
    base = ["--mock-data", "--vocab-size", "64", "--train-iters", "2"]
    assert parse_config(base + ["--use-tp-pp-dp-mapping"], world_size=1).parallel.use_tp_pp_dp_mapping
    assert not parse_config(base, world_size=1).parallel.use_tp_pp_dp_mapping


@pytest.mark.parametrize("order", [ps.DEFAULT_ORDER, ps.TP_PP_DP_ORDER])
def test_the_order_applies_inside_each_diloco_island(monkeypatch, order):
    import torch.distributed as dist

    world, islands, tp, pp = 16, 2, 2, 2  # two islands of 8 ranks: TP 2 x DP 2 x PP 2 each
    expected = ps.rank_layouts(tp, 1, 2, pp, order)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(ps, "new_group", lambda ranks=None, **kw: tuple(ranks))
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        ps.initialize_model_parallel(tp, pp, islands=islands, order=order)
        try:
            offset = (rank // 8) * 8
            for kind in ("tp", "dp", "pp", "mp"):
                mine = [[r + offset for r in g] for g in expected[kind] if rank - offset in g]
                assert [list(ps._s().ranks[kind])] == mine, (kind, rank)
            assert list(ps._s().ranks["outer"]) == [rank % 8, rank % 8 + 8]
        finally:
            ps.destroy_model_parallel()

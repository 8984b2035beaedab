"""DiLoCo's outer loop (megatron_cai.core.diloco) against the hand-written single-process reference:
2 islands x 1 rank and 2 islands x 2 ranks (sliced outer all-reduce) over gloo; fp32, bf16 and Squinch."""
from __future__ import annotations

import torch

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.diloco import DilocoConfig, DilocoOuter, FlatWeights
from megatron_cai.training.features.diloco import island_groups

from .reference import diloco, inner_step

N = 203  # not a multiple of the Squinch block, nor of 2 slices
STEPS = 12
FINAL_STEPS = 14  # the end of the final-average test is between two outer steps of every case
CASES = [  # (H, K, tau, lr, momentum, bits, alpha)
    (4, 1, 0, 0.7, 0.9, 32, 0.0),
    (4, 2, 1, 0.7, 0.9, 32, 0.0),
    (4, 2, 1, 0.5, 0.8, 6, 0.0),
    (3, 3, 2, 0.7, 0.0, 16, 0.5),
    (4, 2, 0, 1.0, 0.9, 6, 0.0),
]


def _w0() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, N)


def _run(case, final_average: bool = False, steps: int = STEPS) -> torch.Tensor:
    H, K, tau, lr, mu, bits, alpha = case
    cfg = DilocoConfig(islands=ps.get_num_islands(), inner_steps=H, outer_lr=lr, outer_momentum=mu,
                       outer_bits=bits, fragments=K, overlap_steps=tau, local_weight=alpha)
    w = _w0()
    halves = [w[:70], w[70:]]  # two "model chunks"
    outer = DilocoOuter(cfg, FlatWeights(halves), island_groups())  # the training seam's view of parallel_state
    for t in range(1, steps + 1):
        w.copy_(inner_step(w, ps.get_island_rank(), t))
        outer.after_inner_step(t)
    if final_average:
        outer.average_islands()
    outer.close()
    return w.clone(), outer.stats.bytes_sent


def _worker(rank: int, world: int, islands: int, final_average: bool | None = None):
    """Each case's (weights, bytes sent) and the layout; ``final_average`` not None: FINAL_STEPS steps, ending
    with the islands' average or not."""
    ps.initialize_model_parallel(1, 1, islands=islands)
    try:
        if final_average is not None:
            return [_run(c, final_average, FINAL_STEPS) for c in CASES]
        layout = (ps.get_data_parallel_global_ranks(with_context_parallel=True), ps.get_outer_global_ranks(),
                  ps.get_data_shard(), ps.get_island_rank())
        return [_run(c) for c in CASES] + [layout]
    finally:
        ps.destroy_model_parallel()


def _check(results, islands: int, slices: int, final_average: bool | None = None) -> None:
    steps = STEPS if final_average is None else FINAL_STEPS
    for k, case in enumerate(CASES):
        H, K, tau, lr, mu, bits, alpha = case
        want = diloco(_w0(), islands, steps, H=H, K=K, tau=tau, lr=lr, mu=mu, bits=bits, alpha=alpha, slices=slices,
                      final_average=bool(final_average))
        for rank, per_case in enumerate(results):
            got = per_case[k][0]
            island = rank // slices
            assert torch.equal(got, want[island]), (case, rank, (got - want[island]).abs().max())


def test_two_islands_one_rank_each_equal_the_reference():
    from testlib.distributed import run_distributed

    results = run_distributed(_worker, 2, args=(2,))
    _check(results, islands=2, slices=1)
    # the islands' weights agree right after a whole-model outer step (K = 1, no overlap, t = 12)
    assert torch.equal(results[0][0][0], results[1][0][0])
    # bytes per rank over the run: fp32 ring 2 (N-1)/N x 4 B, Squinch ~6 bits + rows' headers
    assert results[0][0][1] == 3 * N * 4  # 3 outer steps of the whole model, 2 islands
    assert results[0][2][1] < results[0][1][1] / 4


def test_two_islands_of_two_ranks_slice_the_outer_reduction():
    from testlib.distributed import run_distributed

    results = run_distributed(_worker, 4, args=(2,))
    _check(results, islands=2, slices=2)
    # island i = ranks 2i, 2i + 1 (their DP group); the outer groups pair the same slot; 4 data shards
    assert [r[-1] for r in results] == [([0, 1], [0, 2], (0, 4), 0), ([0, 1], [1, 3], (1, 4), 0),
                                        ([2, 3], [0, 2], (2, 4), 1), ([2, 3], [1, 3], (3, 4), 1)]


def test_the_final_average_makes_the_islands_one_model():
    """After the last iteration every rank of every island holds the same weights: with fp32 the mean of the
    islands' own weights (the updates in flight landed first), with 6 and 16 bits the reference's wire."""
    from testlib.distributed import run_distributed

    averaged = run_distributed(_worker, 4, args=(2, True))
    _check(averaged, islands=2, slices=2, final_average=True)
    own = run_distributed(_worker, 4, args=(2, False))
    for k, case in enumerate(CASES):
        H, K, tau, lr, mu, bits, alpha = case
        for rank in range(1, 4):
            assert torch.equal(averaged[rank][k][0], averaged[0][k][0]), (case, rank)
        if bits == 32 and tau == 0:  # nothing in flight at the end: the plain mean of the islands' own weights
            mean = (own[0][k][0] + own[2][k][0]) / 2
            assert not torch.equal(own[0][k][0], own[2][k][0])
            assert torch.allclose(averaged[0][k][0], mean, atol=1e-6), (case, (averaged[0][k][0] - mean).abs().max())
        # the end costs one more pass of the whole model over the link
        assert averaged[0][k][1] > own[0][k][1]

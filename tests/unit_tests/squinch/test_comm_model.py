"""The step-time model (core/distributed/comm_model.py) against hand-computed cases.

Every expected value below is worked out by hand from the cost table in the module docstring (ms and
bytes written out), not by calling the model's own helpers.
"""
from dataclasses import replace

import pytest

from megatron_cai.core.distributed.comm_model import (
    BackwardTimeline,
    CodecCost,
    Collective,
    OpCost,
    ReducerMode,
    Tier,
    Topology,
    collective_time,
    launches_per_bucket,
    predict,
    wire_bytes,
)

MS = 1e-3
# a slow link: 1 ms per step, 1 MB/s; a codec of round numbers; nothing costs launches unless asked
SLOW = Tier(OpCost(alpha_s=1 * MS, bytes_per_s=1e6))
FAST = Tier(OpCost(alpha_s=0.0, bytes_per_s=1e12))
CPU = CodecCost(encode_elems_per_s=1e6, decode_accumulate_elems_per_s=2e6, decode_elems_per_s=4e6,
                memory_bytes_per_s=1e12, launch_s=0.0, on_host=True)
GPU = CodecCost(encode_elems_per_s=1e6, decode_accumulate_elems_per_s=2e6, decode_elems_per_s=4e6,
                memory_bytes_per_s=1e12, launch_s=0.0, on_host=False, launch_overlaps_work=True)


def dp2(inter=SLOW):
    return Topology(dp=2, ranks_per_node=1, intra=FAST, inter=inter)


def test_fp32_all_reduce_without_overlap():
    # one bucket of 1024 elements (a multiple of lcm(16, 128)): 4096 B; ring all-reduce at n = 2:
    # 2 steps x 1 ms + 2(1/2) x 4096 B / 1e6 B/s = 2 + 4.096 ms; the 1/DP scale costs 8192 B / 1e12 B/s.
    tl = BackwardTimeline((1024,), (10 * MS,), 10 * MS, 2 * MS)
    p = predict(tl, dp2(), CPU, ReducerMode("fp32", overlap=False))
    assert p.step_s == pytest.approx((10 + 2 + 4.096 + 2) * MS + 8192 / 1e12)
    assert p.exposed_s == pytest.approx(6.096 * MS + 8192 / 1e12)
    assert p.rank_bytes == 4096 and p.node_bytes == 4096


def test_bf16_overlap_two_buckets_queue_on_the_link():
    # bf16 buckets of 1024 elements (2048 B): each all-reduce 2 ms + 2.048 ms = 4.048 ms on the link.
    # Ready at 1 ms and 2 ms: the first runs 1 -> 5.048, the second waits for the link: 5.048 -> 9.096;
    # backward ends at 6 ms, so the sync ends at 9.096 and the step at 9.096 + 1 ms (+ the first scale,
    # 2 x 2048 B / 1e12 B/s, which delays both on the link).
    tl = BackwardTimeline((1024, 1024), (1 * MS, 2 * MS), 6 * MS, 1 * MS)
    p = predict(tl, dp2(), GPU, ReducerMode("bf16", overlap=True))
    sc = 4096 / 1e12
    assert p.step_s == pytest.approx(10.096 * MS + sc, rel=1e-12)
    assert [e[3:] for e in p.events] == [pytest.approx((1 * MS + sc, 5.048 * MS + sc), rel=1e-12),
                                         pytest.approx((5.048 * MS + sc, 9.096 * MS + sc), rel=1e-12)]
    # without overlap: one 2048-element bucket at 6 ms: 2 + 4.096 ms
    q = predict(tl, dp2(), GPU, ReducerMode("bf16", overlap=False))
    assert q.step_s == pytest.approx((6 + 6.096 + 1) * MS)


def test_squinch_flat_stages_on_the_host():
    # DP 2, one bucket of 2048 elements, shard 1024: encode 2048 el / 1e6 = 2.048 ms; a2a of 2 wire rows of
    # 768 B payload + 1 flag byte, padded to 16 B = 784 B: 1 step + (1/2) x 1568 B / 1e6 = 1 + 0.784 ms;
    # decode-accumulate 2048 / 2e6 = 1.024 ms; re-encode 1024 / 1e6 = 1.024 ms; all-gather of 784 B:
    # 1 step + 784 B / 1e6 = 1.784 ms; decode 2048 / 4e6 = 0.512 ms. All serial on the host after backward.
    tl = BackwardTimeline((2048,), (10 * MS,), 10 * MS, 0.0)
    p = predict(tl, dp2(), CPU, ReducerMode("squinch", overlap=False))
    scale = 2 * 2048 * 4 / 1e12
    assert p.step_s == pytest.approx((10 + 2.048 + 1.784 + 1.024 + 1.024 + 1.784 + 0.512) * MS + scale)
    assert p.rank_bytes == 784 + 784  # what SquinchReducer counts: a2a (n-1)/n x 1568, all-gather (n-1) x 784


def test_progress_starts_the_second_phase_at_the_next_hand_over():
    # Two Squinch buckets of 2048 elements on the host (CPU), ready at 20 and 30 ms, backward ends 40 ms;
    # each a2a / all-gather takes 1 + 0.784 ms (wire rows of 784 B, as in the test above).
    # Bucket 0: encode 20 -> 22.048, a2a 22.048 -> 23.832. Host (delayed 2.048 ms) hands bucket 1 over at
    # 32.048: progress() finds bucket 0's a2a done: decode-acc + re-encode 32.048 -> 34.096, all-gather
    # 34.096 -> 35.880 on the link; then bucket 1: encode 34.096 -> 36.144, a2a waits for the link:
    # 36.144 -> 37.928. Backward resumes at 36.144 and ends at 40 + 6.144 = 46.144 ms; wait():
    # bucket 0 decode 46.144 -> 46.656; bucket 1 decode-acc + re-encode -> 48.704, all-gather -> 50.488,
    # decode -> 51.000.
    tl = BackwardTimeline((2048, 2048), (20 * MS, 30 * MS), 40 * MS, 0.0)
    p = predict(tl, dp2(), CPU, ReducerMode("squinch", overlap=True, stages="progress"))
    scale = 2 * 2048 * 4 / 1e12
    assert p.step_s == pytest.approx(51.000 * MS + 2 * scale, abs=1e-9)
    assert p.host_in_backward_s == pytest.approx(6.144 * MS + 2 * scale, abs=1e-9)
    # "wait": bucket 0's second phase only after backward: backward ends at 40 + 4.096 ms; then
    # b0: decode-acc + re-encode 44.096 -> 46.144, all-gather -> 47.928, decode -> 48.440;
    # b1: its a2a (34.144 -> 35.928) is long done: decode-acc + re-encode -> 50.488, all-gather -> 52.272,
    # decode -> 52.784.
    w = predict(tl, dp2(), CPU, ReducerMode("squinch", overlap=True, stages="wait"))
    assert w.step_s == pytest.approx(52.784 * MS + 2 * scale, abs=1e-9)


def test_chained_stages_start_when_the_collective_completes():
    # On a stream (GPU): bucket 0 encode 20 -> 22.048, a2a -> 23.832; chained: its second phase starts at
    # 23.832 only when something polls; the hand-over of bucket 1 at 30 ms runs it from 23.832 (the
    # stream was idle): decode-acc + re-encode -> 25.880, all-gather -> 27.664. "progress" starts it at
    # the poll time (30 ms) instead, and the step ends later.
    tl = BackwardTimeline((2048, 2048), (20 * MS, 30 * MS), 40 * MS, 0.0)
    chained = predict(tl, dp2(), GPU, ReducerMode("squinch", stages="chained"))
    polled = predict(tl, dp2(), GPU, ReducerMode("squinch", stages="progress"))
    ag0 = [e for e in chained.events if e[0] == 0 and e[1] == "all-gather"][0]
    assert ag0[3] == pytest.approx(25.880 * MS + 2 * 2048 * 4 / 1e12, abs=1e-9)
    ag0p = [e for e in polled.events if e[0] == 0 and e[1] == "all-gather"][0]
    assert ag0p[3] == pytest.approx(32.048 * MS, abs=1e-9)
    # the compute stream is never delayed on a GPU: backward ends at 40 ms; bucket 1: encode from 30
    # (stream free at 32.048) ... the sync ends when its last decode ends
    assert chained.host_in_backward_s == 0.0 and chained.step_s <= polled.step_s


def test_wire_bytes_of_flat_and_hierarchical_squinch_at_eight_per_node():
    # 16 ranks, 8 per node (2 nodes), S bytes per rank: an all-to-all cannot pre-reduce inside a node, so a
    # node sends 8 x (1/2) S across; a ring all-reduce sends 2 (15/16) S per node; an all-gather of s
    # per rank: 15 s per node (the ring's crossing hop).
    S = 1_600_000
    assert wire_bytes(Collective("all_to_all", "uint8", S, 16, 8)) == (15 / 16 * S, 4 * S)
    assert wire_bytes(Collective("allreduce", "bf16", S, 16, 8)) == (2 * 15 / 16 * S, 2 * 15 / 16 * S)
    assert wire_bytes(Collective("all_gather", "uint8", S / 16, 16, 8)) == (15 * S / 16, 15 * S / 16)
    assert wire_bytes(Collective("all_to_all", "uint8", S, 4, 4)) == (3 / 4 * S, 0.0)  # one node


def test_hierarchical_beats_flat_across_nodes_of_eight():
    # 64 ranks, 8 per node, one 64M-element fp32 bucket, no overlap, links only (free codec, no latency).
    # Flat: a2a per node 8 x 7/8 x Sc, all-gather 63 x Sc/64; hierarchical: 7/8 x Sc each way, where
    # Sc = 64 rows x (6 x 1M / 8 + 1 flag byte, padded to 16 B) = 64 x 786,448 B. bf16 ring: 2 x 63/64 x 128 MB.
    link = Tier(OpCost(0.0, 1e9))
    topo = Topology(dp=64, ranks_per_node=8, intra=Tier(OpCost(0.0, 1e15)), inter=link)
    free = CodecCost(1e18, 1e18, 1e18, 1e18, 0.0, on_host=False, launch_overlaps_work=True)
    tl = BackwardTimeline((64 * 2**20,), (1.0,), 1.0, 0.0)
    row = 6 * 2**20 // 8 + 16  # payload + flag byte, padded to 16 B
    sc = 64 * row
    flat = predict(tl, topo, free, ReducerMode("squinch", overlap=False))
    hier = predict(tl, topo, free, ReducerMode("squinch", hierarchical=True, overlap=False))
    bf16 = predict(tl, topo, free, ReducerMode("bf16", overlap=False))
    assert flat.node_bytes == pytest.approx(8 * 7 / 8 * sc + 63 * sc / 64)
    # hierarchical: the inter-node all-to-all of 8 rows per local rank: each of the 8 groups sends 7/8 of
    # its slice (8 wire rows) per node, and as much back
    assert hier.node_bytes == pytest.approx(8 * (7 / 8 * 8 * row + 7 * row))
    assert bf16.node_bytes == pytest.approx(2 * 63 / 64 * 2 * 64 * 2**20)
    assert flat.exposed_s == pytest.approx(flat.node_bytes / 1e9, rel=1e-3)
    assert hier.exposed_s < bf16.exposed_s < flat.exposed_s


def test_per_rank_launches_at_512_ranks():
    # encode_rows loops over 512 rows (+2), decode_sum_into 3, the owner's re-encode 1 row (+1),
    # decode_rows_into 512 rows (+2), the 1/DP scale 1: 1033 launches; one launch per codec step: 11.
    topo = Topology(dp=512, ranks_per_node=8, intra=FAST, inter=SLOW)
    per_rank = CodecCost(1e9, 1e9, 1e9, 1e12, launch_s=5e-6, per_rank_launches=True, on_host=False)
    per_bucket = CodecCost(1e9, 1e9, 1e9, 1e12, launch_s=5e-6, per_rank_launches=False, on_host=False)
    mode = ReducerMode("squinch")
    assert launches_per_bucket(512 * 1024, topo, per_rank, mode) == 1 + 514 + 3 + 2 + 514
    assert launches_per_bucket(512 * 1024, topo, per_bucket, mode) == 1 + 3 + 3 + 2 + 3


def test_latency_steps_and_node_share():
    # ring all-reduce over 8 ranks, one per node: 14 steps of 10 us; NCCL's tree: 2 x 3 steps
    link = Tier(OpCost(10e-6, 1e30))
    ring = Topology(dp=8, ranks_per_node=1, intra=FAST, inter=link)
    tree = Topology(dp=8, ranks_per_node=1, intra=FAST, inter=link, tree_latency=True)
    c = Collective("allreduce", "fp32", 4, 8, 1)
    assert collective_time(ring, c)[1] == pytest.approx(14 * 10e-6)
    assert collective_time(tree, c)[1] == pytest.approx(6 * 10e-6)
    # an inter-node group with one rank per node, in a DP group with 4 per node, gets a quarter of the link
    topo = Topology(dp=8, ranks_per_node=4, intra=FAST, inter=Tier(OpCost(0.0, 1e6)))
    assert collective_time(topo, Collective("all_to_all", "uint8", 1000, 2, 1))[1] == pytest.approx(500 / 0.25e6)


def test_per_op_costs_and_uniform_timeline():
    tier = Tier(OpCost(1.0, 1.0), {"allreduce_bf16": OpCost(2.0, 3.0), "all_gather": OpCost(4.0, 5.0)})
    assert tier.cost("allreduce", "bf16").bytes_per_s == 3.0
    assert tier.cost("allreduce", "fp32").bytes_per_s == 1.0
    assert tier.cost("all_gather", "uint8").alpha_s == 4.0
    # 2.5 buckets' worth of elements over 2 micro-batches of (1 s forward, 2 s backward): the last backward
    # starts at 3 + 1 = 4 s; buckets of 100, 100, 50 ready at 4 + 2 x 100/250, 4 + 2 x 200/250, 6 s
    tl = BackwardTimeline.uniform(250, 100, 1.0, 2.0, 0.5, microbatches=2)
    assert tl.bucket_elems == (100, 100, 50)
    assert tl.ready_s == pytest.approx((4.8, 5.6, 6.0)) and tl.backward_end_s == 6.0 and tl.compute_s == 6.5
    with pytest.raises(ValueError):
        BackwardTimeline((1, 2), (2.0, 1.0), 3.0, 0.0)
    with pytest.raises(ValueError):
        ReducerMode("bf16", hierarchical=True)


def test_token_bucket_shaper_lets_a_burst_through_after_idle():
    # tbf: 1000 B of burst, refilled at 1e6 B/s. Three fp32 buckets of 256 elements (1024 B, all-reduce
    # at n = 2 sends 1024 B): ready at 0, 0 and 10 ms; each costs 2 x 1 ms + bytes not covered by tokens.
    # b0: full bucket: 2 + 24 B / 1e6 = 2.024 ms (0 -> 2.024); b1 right behind it, empty bucket:
    # 2 + 1.024 = 3.024 ms (2.024 -> 5.048); b2 at 10 ms: refilled min(1000, 4.952 ms x 1e6 B/s) = 1000 B:
    # 2.024 ms (10 -> 12.024).
    shaped = Tier(OpCost(1 * MS, 1e6), burst_bytes=1000, refill_bytes_per_s=1e6)
    free = CodecCost(1e18, 1e18, 1e18, 1e18, 0.0, on_host=False, launch_overlaps_work=True)
    tl = BackwardTimeline((256, 256, 256), (0.0, 0.0, 10 * MS), 10 * MS, 0.0)
    p = predict(tl, dp2(shaped), free, ReducerMode("fp32"))
    assert [e[3:] for e in p.events] == [pytest.approx((0, 2.024 * MS)), pytest.approx((2.024 * MS, 5.048 * MS)),
                                         pytest.approx((10 * MS, 12.024 * MS))]


def test_transport_cpu_overlapping_backward_delays_compute_on_the_host():
    # Two fp32 buckets of 256 elements (all-reduce sends 1024 B at n = 2: 2 + 1.024 ms on the link), the
    # transport costing 1 us of host CPU per byte: 1.024 ms per all-reduce, taken from backward while they
    # overlap it, and the all-reduce waits as long for a core (backward holds them all). b0 is issued at 0
    # and would end at 3.024; the host reaches b1's hand-over 1.024 ms late, at 11.024, and b0's end moves
    # to 4.048; b1: 11.024 -> 14.048 + 1.024 = 15.072, inside backward too; backward ends at
    # 20 + 2 x 1.024 = 22.048 ms.
    link = Tier(OpCost(1 * MS, 1e6, cpu_s_per_byte=1e-6))
    free = CodecCost(1e18, 1e18, 1e18, 1e18, 0.0, on_host=True)
    tl = BackwardTimeline((256, 256), (0.0, 10 * MS), 20 * MS, 1 * MS)
    p = predict(tl, dp2(link), free, ReducerMode("fp32"))
    assert [e[3:] for e in p.events] == [pytest.approx((0, 4.048 * MS), abs=1e-12),
                                         pytest.approx((11.024 * MS, 15.072 * MS))]
    assert p.step_s == pytest.approx(23.048 * MS) and p.host_in_backward_s == pytest.approx(2.048 * MS)
    # A transfer that outlasts backward ends later by what it took from backward: one bucket ready at 0,
    # backward ending at 1 ms; of the all-reduce's 1.024 ms of CPU spread over 0 -> 3.024 ms, 1/3.024 falls
    # inside backward (0.3386 ms): backward ends at 1.3386, the all-reduce at 3.024 + 0.3386 = 3.3626 ms.
    short = BackwardTimeline((256,), (0.0,), 1 * MS, 0.0)
    stolen = 1.024 * MS * 1 / 3.024
    one = predict(short, dp2(link), free, ReducerMode("fp32"))
    assert one.host_in_backward_s == pytest.approx(stolen) and one.step_s == pytest.approx(3.024 * MS + stolen)
    # on an accelerator (the reducer on its own stream) compute is not delayed
    gpu = predict(tl, dp2(link), replace(free, on_host=False), ReducerMode("fp32"))
    assert gpu.step_s == pytest.approx(21 * MS)


def test_issue_time_grows_with_the_bytes_a_rank_sends():
    # 0.1 ms to issue plus 1 ns per byte a rank sends: an all-to-all of 1000 B over 2 ranks sends 500 B,
    # a ring all-reduce of 4000 B sends 2 x (2 - 1) / 2 x 4000 = 4000 B
    topo = dp2(Tier(OpCost(0.0, 1e6, issue_s=1e-4, issue_s_per_byte=1e-9)))
    assert collective_time(topo, Collective("all_to_all", "uint8", 1000, 2, 1))[2] == pytest.approx(1e-4 + 500e-9)
    assert collective_time(topo, Collective("allreduce", "fp32", 4000, 2, 1))[2] == pytest.approx(1e-4 + 4000e-9)

"""bench/context_parallel.py's exact counts against hand-computed values on a plain causal sequence.

Zig-zag at CP = 2, chunks of L/2 (L = T/2 tokens per rank): rank 0 holds chunks 0 and 3, rank 1 chunks
1 and 2. Rank 0's queries in chunk 3 see chunks 1 and 2 (L keys received); rank 1's see chunk 0 (L/2).
Each rank puts on the wire twice what it sends (forward, and again in backward) plus the dK/dV of what
it received: rank 0 2(L/2) + L = 2L, rank 1 2L + L/2 = 2.5L; the dense ring 3L each.
"""
from __future__ import annotations

import os
import sys

import pytest
from testlib import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

from harness.scripts import load_module  # noqa: E402

B = load_module("bench/context_parallel.py")  # by path: bench/gpu/context_parallel.py is "context_parallel" too


def test_causal_bytes_and_flops_by_hand():
    seq, local = 512, 256
    rows = B.exact_rows("plain causal", seq, 2)
    assert [r["total_bytes"] // B.KEY_BYTES for r in rows] == [2 * local, 5 * local // 2]
    assert [r["forward_bytes"] // B.KEY_BYTES for r in rows] == [local // 2, local]
    assert all(r["dense_total_bytes"] == 3 * local * B.KEY_BYTES for r in rows)
    assert all(r["imbalance"] == 1.0 for r in rows)
    assert sum(r["visible_pairs"] for r in rows) == seq * (seq + 1) // 2
    (single,) = B.exact_rows("plain causal", seq, 1)
    tiles = 4 * 5 // 2  # 128 x 128 tiles on or below the diagonal of a 4 x 4 grid
    assert single["flops"] == tiles * 128 * 128 * B.FLOPS_PER_PAIR
    assert single["dense_flops"] == seq * seq * B.FLOPS_PER_PAIR


def test_summary_and_acceptance_lines():
    rows = [r for cp in (1, 2, 4) for r in B.exact_rows("packed documents", 2048, cp, seed=0)]
    summary = B.summarize(rows)
    assert [s["cp"] for s in summary] == [1, 2, 4]
    worst = max(r["total_bytes"] / r["dense_total_bytes"] for r in rows if r["cp"] == 4)
    assert summary[-1]["bytes_ratio"]["max"] == pytest.approx(worst)
    (line,) = B.acceptance(summary)
    assert line.startswith("packed documents, CP 4, T 2048") and line.endswith("met")


def test_issue_thresholds_at_t16k_cp4():
    """The acceptance targets at the bench's own size (T = 16k, CP = 4), from the plan and split that the
    attention executes: on packed documents of mean length T/16 each rank sends at most 0.3x the bytes of a
    dense ring and computes at most 0.3x its attention FLOPs; zig-zag imbalance <= 1.05 on plain causal and the
    work-balanced split's <= 1.15 on packed trees."""
    seq, cp = 16384, 4
    docs = B.exact_rows("packed documents", seq, cp, seed=0)
    assert len(docs) == cp and docs[0]["chunks"] > 2 * cp  # the work-balanced split, not the zig-zag
    assert max(r["total_bytes"] / r["dense_total_bytes"] for r in docs) <= 0.3
    assert max(r["flops"] / r["dense_flops"] for r in docs) <= 0.3
    causal = B.exact_rows("plain causal", seq, cp)
    assert causal[0]["chunks"] == 2 * cp and causal[0]["imbalance"] <= 1.05
    trees = B.exact_rows("packed trees", seq, cp, seed=0)
    assert 1.0 <= trees[0]["imbalance"] <= 1.15
    assert sum(r["visible_pairs"] for r in trees) == int(B.visible_keys_per_query(*B.intervals(
        B.batch_of("packed trees", seq, 0)))[0].sum())  # the ranks' pairs partition the row's

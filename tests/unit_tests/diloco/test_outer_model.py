"""The outer loop's step-time model against hand-computed windows."""
from __future__ import annotations

import pytest

from megatron_cai.core.diloco.outer_model import (
    OuterLink,
    allreduce_s,
    min_inner_steps,
    utilisation,
    window_s,
    wire_bytes,
)


def test_wire_bytes_and_allreduce_time():
    assert wire_bytes(1000, 2, 32) == 4000  # 2 (N-1)/N x 1000 x 4 B
    assert wire_bytes(1000, 8, 6) == pytest.approx(2 * 7 / 8 * 750)
    assert wire_bytes(1000, 1, 32) == 0
    link = OuterLink(bytes_per_s=1000.0, alpha_s=0.01)
    assert allreduce_s(1000, 2, 32, link, codec_s=0.5) == pytest.approx(0.02 + 4.0 + 0.5)


@pytest.mark.parametrize("H, K, tau, t_f, want", [
    (10, 1, 0, 1.0, 11.0),   # one blocking all-reduce per window
    (10, 2, 4, 0.5, 10.0),   # each fragment hidden behind 4 inner steps
    (2, 2, 0, 3.0, 8.0),     # blocking after every step
    (10, 1, 5, 20.0, 25.0),  # link-bound: the send waits for the update 20 s after it; 5 steps to the next send
    (4, 2, 1, 1.5, 5.0),     # each fragment lands 0.5 s late: two stalls of 0.5 s
])
def test_window_time(H, K, tau, t_f, want):
    assert window_s(1.0, H, K, tau, t_f) == pytest.approx(want)
    assert utilisation(1.0, H, K, tau, t_f) == pytest.approx(H / want)


def test_least_inner_steps_for_90_percent():
    assert min_inner_steps(1.0, 1, 2.0) == 3  # H = 3, overlap 2 hides 2 s; H = 2 waits 1 s of 3
    assert min_inner_steps(1.0, 4, 2.0) == 8  # fragments of 0.5 s: H = 4 has no overlap (2 s stalled of 6)
    assert min_inner_steps(1.0, 1, 1e9, limit=1000) is None

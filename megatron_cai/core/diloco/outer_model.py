"""Step-time model of DiLoCo's outer loop (the comm_model of the inner step, extended to the outer one).

An island's window of H inner steps of ``inner_s`` each carries K fragment all-reduces; fragment f is sent
after its inner step and must land ``overlap`` inner steps later (``DilocoConfig``). Over the slow link
each island sends, per fragment, ``wire_bytes`` = 2 (N - 1) / N x elements x bits / 8 (the reduce-scatter
and the all-gather, each element once per island), plus ``2 (N - 1)`` latencies. The all-reduces run one
after another on the link (one worker); the inner loop waits when an update is due before its all-reduce
has finished::

    link time of a fragment   t_f = alpha * 2 (N - 1) + wire_bytes / link_bytes_per_s + codec_s
    window wall time          simulated: sends at their steps, the link serves them in order,
                              an apply due before its all-reduce ends stalls the inner loop
    compute utilisation       H * inner_s / window wall time

With the overlap a fragment's all-reduce hides behind ``overlap`` inner steps; however it is overlapped,
the link must carry the whole model once per window, so utilisation needs
``K * t_f <= H * inner_s`` (the link-bound limit). Synchronous data parallelism across the same link carries
the gradient every step: ``dp_step_s = inner_s + t_full`` (no overlap across islands).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class OuterLink:
    """The link between islands, per island: bytes/s each way and the latency of one message."""

    bytes_per_s: float
    alpha_s: float = 0.0


def wire_bytes(elements: float, islands: int, bits: int) -> float:
    """Bytes one island sends (and receives) for the outer all-reduce of ``elements`` pseudo-gradient values."""
    return 2 * (islands - 1) / islands * elements * bits / 8 if islands > 1 else 0.0


def allreduce_s(elements: float, islands: int, bits: int, link: OuterLink, codec_s: float = 0.0) -> float:
    """Wall time of one outer all-reduce over the link (plus the codec's time, ``codec_s``)."""
    if islands == 1:
        return codec_s
    return link.alpha_s * 2 * (islands - 1) + wire_bytes(elements, islands, bits) / link.bytes_per_s + codec_s


def window_s(inner_s: float, inner_steps: int, fragments: int, overlap: int, fragment_s: float) -> float:
    """Wall time of one window of ``inner_steps`` in the steady state: sends at the fragments' offsets, the
    link serving them in order, the inner loop stalled until an update due now has arrived."""
    H, K = inner_steps, fragments
    offsets = sorted(H * (f + 1) // K for f in range(K))
    clock, link_free = 0.0, -math.inf
    due: list[tuple[int, float]] = []  # (step at which the update lands, when its all-reduce ends)
    step = 0
    for _ in range(3):  # the third window is the steady state (the link's backlog carried over)
        start_wall = clock
        for s in range(1, H + 1):
            clock += inner_s
            step += 1
            for at, end in [d for d in due if d[0] == step]:
                clock = max(clock, end)
                due.remove((at, end))
            for o in offsets:
                if s == o:
                    begin = max(clock, link_free)
                    link_free = begin + fragment_s
                    due.append((step + overlap, link_free))
                    if overlap == 0:
                        clock = max(clock, link_free)
                        due.remove((step, link_free))
    return clock - start_wall


def utilisation(inner_s: float, inner_steps: int, fragments: int, overlap: int, fragment_s: float) -> float:
    """Fraction of the wall time spent in inner steps."""
    return inner_steps * inner_s / window_s(inner_s, inner_steps, fragments, overlap, fragment_s)


def min_inner_steps(inner_s: float, fragments: int, model_s: float, target: float = 0.9,
                    overlap_of=lambda h, k: max(h // k - 1, 0), limit: int = 100_000) -> int | None:
    """The least H (a multiple of ``fragments``) whose utilisation reaches ``target``; ``model_s``: the whole
    model's all-reduce time (a fragment takes ``model_s / fragments``); ``overlap_of(H, K)``: the overlap
    used at that H (default: up to the next fragment's send). None when none up to ``limit`` does."""
    h = fragments
    while h <= limit:
        if utilisation(inner_s, h, fragments, overlap_of(h, fragments), model_s / fragments) >= target:
            return h
        h = h + fragments if h < 64 * fragments else h * 2 // fragments * fragments
    return None

"""DiLoCo's outer state while an all-reduce is in flight (core/diloco/outer.py): the saved error feedback is the
one the in-flight all-reduce leaves, however late its thread finishes (one island: its 6-bit encode and decode
still update the residual)."""
from __future__ import annotations

import threading

import torch

from megatron_cai.core.diloco import DilocoConfig, DilocoOuter, FlatWeights
from megatron_cai.core.diloco.outer import IslandGroups


def test_a_save_with_an_all_reduce_in_flight_keeps_the_feedback_it_leaves():
    cfg = DilocoConfig(islands=1, inner_steps=4, outer_bits=6, fragments=1, overlap_steps=2)
    w = torch.linspace(-1, 1, 64)
    outer = DilocoOuter(cfg, FlatWeights([w]), IslandGroups())
    release = threading.Event()
    average = outer.reduce.average

    def late_average(x, key):  # the link is slow: the residual changes only after the save was asked for
        release.wait(timeout=30)
        return average(x, key)

    outer.reduce.average = late_average
    for t in range(1, 5):
        w.add_(0.01 * torch.sin(torch.arange(64.0) * t))  # an inner step
        outer.after_inner_step(t)  # t = 4: the fragment is sent, its all-reduce waits in the worker thread
    threading.Timer(0.2, release.set).start()
    saved = outer.state_dict()["feedback"]
    after = outer.feedback.state_dict()
    outer.close()
    assert saved.keys() == after.keys()
    assert saved["residuals"].keys() == after["residuals"].keys() and after["residuals"]
    for key, residual in after["residuals"].items():
        assert torch.equal(saved["residuals"][key], residual), key
    assert any(r.abs().sum() > 0 for r in after["residuals"].values())  # the all-reduce did change them

"""A non-finite mean pseudo-gradient skips the outer step: counted, and the fragment goes back to its anchor (at a
landing) or keeps its weights (in the final average). One island, one process, fp32."""
from __future__ import annotations

import torch

from megatron_cai.core.diloco import DilocoConfig, DilocoOuter, FlatWeights, IslandGroups


def _outer(w: torch.Tensor) -> DilocoOuter:
    cfg = DilocoConfig(islands=1, inner_steps=2, outer_lr=0.7, outer_momentum=0.0, outer_bits=32)
    return DilocoOuter(cfg, FlatWeights([w]), IslandGroups())


def test_a_non_finite_pseudo_gradient_puts_the_fragment_back_at_its_anchor():
    w = torch.linspace(-1.0, 1.0, 10)
    anchor = w.clone()
    outer = _outer(w)
    w.add_(0.5)
    w[3] = float("nan")
    outer.after_inner_step(2)  # the outer step due after inner step 2
    assert outer.stats.skipped == 1 and outer.stats.outer_steps == 0
    assert torch.equal(w, anchor)
    w.sub_(0.25)  # a finite step afterwards is taken: anchor - 0.7 x (anchor - w)
    outer.after_inner_step(4)
    assert outer.stats.outer_steps == 1
    assert torch.allclose(w, anchor - 0.7 * 0.25)


def test_the_final_average_keeps_the_weights_of_a_non_finite_fragment():
    w = torch.linspace(-1.0, 1.0, 10)
    outer = _outer(w)
    w[0] = float("inf")
    before = w.clone()
    outer.average_islands()
    assert outer.stats.skipped == 1 and outer.stats.final_averages == 1
    assert torch.equal(w, before)

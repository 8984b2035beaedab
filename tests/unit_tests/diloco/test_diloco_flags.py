"""The --diloco-* flags: their config, the fragments' schedule, and one report naming every impossible flag."""
from __future__ import annotations

import pytest
from testlib.train import TINY_MODEL

from megatron_cai.core.diloco import DilocoConfig, fragment_bounds
from megatron_cai.training.arguments import parse_config
from megatron_cai.training.config import ArgumentError

BASE = TINY_MODEL + ["--mock-data", "--micro-batch-size", "1", "--train-iters", "4"]


def test_flags_build_the_config():
    cfg = parse_config(BASE + ["--diloco-islands", "2", "--diloco-inner-steps", "20", "--diloco-outer-lr", "0.5",
                               "--diloco-outer-momentum", "0.8", "--diloco-outer-bits", "16", "--diloco-fragments",
                               "4", "--diloco-overlap-steps", "2", "--no-diloco-error-feedback"], world_size=4).diloco
    assert cfg == DilocoConfig(islands=2, inner_steps=20, outer_lr=0.5, outer_momentum=0.8, outer_bits=16,
                               fragments=4, overlap_steps=2, error_feedback=False)
    assert not parse_config(BASE, world_size=1).diloco.enabled


@pytest.mark.parametrize("extra, world, words", [
    (["--diloco-islands", "3", "--diloco-inner-steps", "4"], 4, "does not split into islands"),
    (["--diloco-islands", "2"], 2, "needs --diloco-inner-steps"),
    (["--diloco-inner-steps", "4", "--diloco-overlap-steps", "4"], 1, "--diloco-overlap-steps must be in 0 .. "),
    (["--diloco-inner-steps", "4", "--diloco-fragments", "5"], 1, "--diloco-fragments must be in 1 .. "),
    (["--diloco-inner-steps", "4", "--use-torch-fsdp2"], 1, "--use-torch-fsdp2 is not supported"),
    (["--diloco-islands", "2", "--diloco-inner-steps", "4", "--ckpt-format", "torch_dist", "--save", "x"], 2,
     "--ckpt-format torch only"),
    (["--diloco-outer-bits", "8"], 1, "--diloco-outer-bits"),
    (["--diloco-outer-momentum", "1"], 1, "--diloco-outer-momentum"),
])
def test_impossible_flags_are_named(extra, world, words):
    with pytest.raises(ArgumentError, match=words.replace(".", r"\.")):
        parse_config(BASE + extra, world_size=world)


def test_fragments_are_spread_over_the_inner_steps():
    cfg = DilocoConfig(inner_steps=12, fragments=3)
    assert [cfg.send_offset(f) for f in range(3)] == [4, 8, 0]  # after steps 4, 8, 12 of every 12
    assert fragment_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]

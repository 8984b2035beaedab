"""--cp-comm-type and --hierarchical-context-parallel-sizes: mapped onto this codebase's context-parallel exchange
(one start-up line), with megatron-core's values and rules (a2a+p2p needs the hierarchical sizes; their product is
the CP size)."""
from __future__ import annotations

import pytest

from megatron_cai.training.arguments import ArgumentError, parse_config

BASE = ["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--seq-length", "64", "--attention-dropout", "0",
        "--num-layers", "4", "--position-embedding-type", "rope"]


@pytest.mark.parametrize("extra", [["--cp-comm-type", "a2a"], ["--cp-comm-type", "allgather"],
                                   ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
                                   ["--cp-comm-type", "p2p", "a2a", "allgather", "p2p"]])
def test_megatrons_values_are_mapped(extra):
    config = parse_config(BASE + ["--context-parallel-size", "4"] + extra, world_size=4)
    notes = [n for n in config.logging.megatron_notes if "--cp-comm-type" in n]
    assert len(notes) == 1 and "exchanges only the key/value chunks that some query sees" in notes[0]


@pytest.mark.parametrize("extra,message", [
    (["--cp-comm-type", "ring"], "--cp-comm-type ring: each value must be one of p2p, a2a, allgather, a2a+p2p"),
    (["--cp-comm-type", "a2a+p2p"], "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "3"],
     "--hierarchical-context-parallel-sizes 2 3: their product must be --context-parallel-size 4"),
    (["--cp-comm-type", "p2p", "a2a"], "--cp-comm-type: one value, or one per layer (4); got 2"),
])
def test_megatrons_rules(extra, message):
    with pytest.raises(ArgumentError) as err:
        parse_config(BASE + ["--context-parallel-size", "4"] + extra, world_size=4)
    assert message in str(err.value)


def test_the_default_says_nothing():
    config = parse_config(BASE + ["--context-parallel-size", "2"], world_size=2)
    assert not [n for n in config.logging.megatron_notes if "--cp-comm-type" in n]

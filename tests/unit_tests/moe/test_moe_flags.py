"""Megatron-LM's MoE flags: each parses to megatron-core 0.19.2's value (its own parser), defaults included;
--moe-layer-freq's pattern is read without eval; impossible combinations are one error naming the flags."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import typing

import pytest
from testlib.moe import MEGATRON_ARGS

from megatron_cai.training.arguments import parse_config
from megatron_cai.training.config import ArgumentError
from megatron_cai.training.flags.moe import layer_freq

if not hasattr(typing, "override"):
    typing.override = lambda f: f
margs = pytest.importorskip("megatron.training.arguments")

BASE = ["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--num-layers", "4", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8", "--max-position-embeddings", "8", "--disable-bias-linear"]
SETS = {
    "defaults": ["--num-experts", "8"],
    "deepseek": ["--num-experts", "8", "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-ffn-hidden-size", "24",
                 "--moe-shared-expert-intermediate-size", "24", "--moe-router-load-balancing-type", "seq_aux_loss",
                 "--moe-router-topk", "4", "--moe-token-dispatcher-type", "alltoall", "--moe-router-pre-softmax",
                 "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-4", "--moe-router-group-topk", "2",
                 "--moe-router-num-groups", "4", "--moe-router-topk-scaling-factor", "2.0",
                 "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-bias-update-rate", "1e-3", "--moe-router-dtype", "fp32", "--moe-permute-fusion"],
    "capacity": ["--num-experts", "4", "--moe-layer-freq", "2", "--moe-expert-capacity-factor", "1.5",
                 "--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity", "--moe-z-loss-coeff",
                 "1e-3", "--moe-input-jitter-eps", "0.01", "--moe-shared-expert-intermediate-size", "8",
                 "--moe-shared-expert-gate", "--moe-shared-expert-overlap", "--moe-per-layer-logging",
                 "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01"],
}
FIELDS = MEGATRON_ARGS


def _single(v):
    return v[0] if isinstance(v, list) and len(v) == 1 else v


@pytest.mark.parametrize("name", list(SETS))
def test_moe_flags_parse_to_megatrons_values(name):
    argv = BASE + SETS[name]
    theirs = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    with contextlib.redirect_stderr(io.StringIO()):
        their_args = theirs.parse_args(argv)
    moe = parse_config(argv, world_size=1).model.moe
    assert {f.name for f in dataclasses.fields(moe)} - {"extra"} == set(FIELDS)
    for ours, attr in FIELDS.items():
        megatron = _single(getattr(their_args, attr))
        if ours == "expert_tensor_parallel_size" and megatron == 1:
            megatron = None  # Megatron-LM's parser default 1, its validate_args then sets it to TP: ours is None
        assert getattr(moe, ours) == megatron, (ours, getattr(moe, ours), megatron)


def test_layer_freq_patterns_are_read_without_eval():
    assert layer_freq("3") == 3
    assert layer_freq("([1]*3+[0]*1)*3") == [1, 1, 1, 0] * 3
    assert layer_freq("[0]+[1]*23") == [0] + [1] * 23
    for bad in ("__import__('os').system('true')", "[2]*3", "[1]*(2**40)", "[1]*10**12", "[a]*2", "1 if 1 else 0"):
        with pytest.raises(argparse.ArgumentTypeError):
            layer_freq(bad)


@pytest.mark.parametrize("extra, world, message", [
    (["--num-experts", "8", "--moe-layer-freq", "[1]*3"], 1, "--moe-layer-freq lists 3 layers, the model has 4"),
    (["--num-experts", "8", "--moe-router-topk", "1"], 1, "--moe-router-pre-softmax"),
    (["--num-experts", "8", "--moe-router-enable-expert-bias"], 1, "--moe-router-score-function sigmoid"),
    (["--num-experts", "8", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1,
     "--num-experts 8 is not divisible by --moe-router-num-groups 3"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, "--expert-model-parallel-size 4"),
    (["--expert-model-parallel-size", "2"], 2, "needs --num-experts"),
    (["--num-experts", "8", "--expert-model-parallel-size", "3"], 4, "expert-model-parallel-size 3"),
    (["--num-experts", "8", "--expert-model-parallel-size", "2", "--save", "ck", "--ckpt-format", "torch"], 2,
     "--load needs --ckpt-format torch_dist"),
    (["--num-experts", "8", "--expert-model-parallel-size", "2", "--use-torch-fsdp2", "--squinch",
      "--squinch-hierarchical"], 2, "--use-torch-fsdp2 --squinch-hierarchical"),
    (["--num-experts", "8", "--tensor-model-parallel-size", "2"], 2, "needs --sequence-parallel"),
    (["--num-experts", "8", "--recompute-granularity", "full"], 1, "--recompute-granularity full"),
    (["--num-experts", "8", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], 1,
     "one load-balancing type at a time"),
])
def test_impossible_moe_flags_are_one_error_naming_them(extra, world, message):
    with pytest.raises(ArgumentError, match=message.replace("[", r"\[").replace("(", r"\(")):
        parse_config(BASE + extra, world_size=world)


"""Uneven pipeline splits (--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split)
against megatron-core 0.19.2's own ``get_transformer_layer_offset`` / ``get_num_layers_to_build`` and the checks of
its ``TransformerConfig``, over every small (layers, PP, VPP, first, last, embedding, loss) combination."""

from __future__ import annotations

import itertools
import typing

import pytest
import torch

from megatron_cai.core.pipeline_parallel.layer_split import PipelineSplit, split_problems, stage_layer_numbers

if not hasattr(typing, "override"):
    typing.override = lambda f: f
pytest.importorskip("megatron.core")


def _mcore():
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return TransformerConfig, get_transformer_layer_offset, get_num_layers_to_build


def _mcore_config(layers, pp, vpp, split: PipelineSplit):
    """megatron-core's TransformerConfig for this split, or None where its checks reject it."""
    transformer_config, _, _ = _mcore()
    try:
        return transformer_config(
            num_layers=layers,
            hidden_size=8,
            num_attention_heads=2,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32,
            num_layers_in_first_pipeline_stage=split.num_layers_in_first_pipeline_stage,
            num_layers_in_last_pipeline_stage=split.num_layers_in_last_pipeline_stage,
            account_for_embedding_in_pipeline_split=split.account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split=split.account_for_loss_in_pipeline_split,
        )
    except ValueError:
        return None


def _mcore_layers(config, pp, vpp):
    """megatron-core's layers per (rank, chunk); None where its offset divides by zero middle stages (PP 2 with
    both a first and a last count and VPP: megatron-core 0.19.2 raises ZeroDivisionError there)."""
    _, offset_of, count_of = _mcore()
    out = {}
    for r, v in itertools.product(range(pp), range(vpp or 1)):
        try:
            start = offset_of(config, v if vpp else None, r)
        except ZeroDivisionError:
            return None
        out[r, v] = list(range(start, start + count_of(config, v if vpp else None, r)))
    return out


def _splits():
    for first, last in itertools.product((None, 0, 1, 2, 4), repeat=2):
        if first is not None or last is not None:
            yield PipelineSplit(first, last)
    for emb, loss in ((True, False), (False, True), (True, True)):
        yield PipelineSplit(account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)


CASES = [
    (layers, pp, vpp, split) for layers in (4, 6, 8, 12) for pp in (2, 3, 4) for vpp in (None, 2) for split in _splits()
]


def _partition(held: dict | None, layers: int) -> bool:
    return held is not None and sorted(n for ns in held.values() for n in ns) == list(range(layers))


def test_every_combination_matches_megatron_core():
    """Where we accept a split, megatron-core accepts it and builds, on every (rank, chunk), the layers we build
    there. Where we refuse it, megatron-core refuses it too, or what it would build is no partition of the
    layers (it lets -1 middle layers through its check, for one)."""
    valid = crashed = stricter = 0
    for layers, pp, vpp, split in CASES:
        config = _mcore_config(layers, pp, vpp, split)
        theirs = None if config is None else _mcore_layers(config, pp, vpp)
        if split_problems(layers, pp, vpp, split):
            if config is not None:
                assert not _partition(theirs, layers), (layers, pp, vpp, split)
                stricter += 1
            continue
        assert config is not None, (layers, pp, vpp, split)
        ours = {(r, v): stage_layer_numbers(layers, r, pp, v, vpp, split) for r in range(pp) for v in range(vpp or 1)}
        assert _partition(ours, layers)
        if theirs is None:  # PP 2, VPP, a first and a last count: megatron-core divides by zero middle stages
            crashed += 1
            continue
        assert ours == theirs, (layers, pp, vpp, split)
        valid += 1
    assert valid >= 60 and crashed < 20 and stricter < 20, (valid, crashed, stricter)


def test_megatron_functional_configurations():
    """The two configurations of Megatron-LM's functional tests: 12 layers at PP 4 with 2 first / 2 last, and
    6 layers at PP 4 x VPP 2 with the embedding and the loss counted (two chunks hold no transformer layer)."""
    uneven = PipelineSplit(2, 2)
    assert [stage_layer_numbers(12, r, 4, split=uneven) for r in range(4)] == [
        [0, 1],
        [2, 3, 4, 5],
        [6, 7, 8, 9],
        [10, 11],
    ]
    counted = PipelineSplit(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert [[stage_layer_numbers(6, r, 4, v, 2, counted) for v in range(2)] for r in range(4)] == [
        [[], [3]],
        [[0], [4]],
        [[1], [5]],
        [[2], []],
    ]


def test_a_checkpoint_of_another_split_is_told_apart():
    """torch-format checkpoints hold each stage's layers: a resume at the same (TP, PP, VPP) with another split
    would give layers the wrong weights, so it is refused; a split that holds the same layers (or an old
    checkpoint without the split fields, at an even split) is not."""
    from megatron_cai.core.models.gpt.config import GPTConfig
    from megatron_cai.training.checkpoint import same_stage_layers

    even, uneven = GPTConfig(num_layers=4), GPTConfig(num_layers=4, num_layers_in_first_pipeline_stage=1)
    saved_even = {"model_config": {k: v for k, v in even.to_dict().items() if "pipeline" not in k}}  # an old one
    assert same_stage_layers(saved_even, even, 2, None)
    assert not same_stage_layers(saved_even, uneven, 2, None)
    assert not same_stage_layers({"model_config": uneven.to_dict()}, even, 2, None)
    assert same_stage_layers({"model_config": uneven.to_dict()}, uneven, 2, None)
    # at PP 1 the embedding slot changes nothing
    counted = GPTConfig(num_layers=4, account_for_embedding_in_pipeline_split=True)
    assert same_stage_layers({"model_config": counted.to_dict()}, even, 1, None)

"""Megatron-LM's pipeline-split flags: uneven stages and the virtual pipeline size.

- ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``: layers of the first / last
  pipeline stage (the middle stages share the rest evenly);
- ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the embedding / the
  loss counts as one layer of the split;
- ``--num-layers-per-virtual-pipeline-stage`` or ``--num-virtual-stages-per-pipeline-rank``: the virtual pipeline
  size (uneven first / last stages need the second, as in Megatron-LM);
- ``--microbatch-group-size-per-virtual-pipeline-stage``: the interleaved schedule's groups of micro-batches
  (``core/pipeline_parallel/schedules.py``; checked per micro-batch count in ``training/flags/layout.py``).

The split itself: :mod:`megatron_cai.core.pipeline_parallel.layer_split`. This module adds the flags, derives the
virtual pipeline size as megatron-core's ``validate_args`` does and checks the split as its ``TransformerConfig``
does, every problem named by its flag.
"""

from __future__ import annotations

import argparse
from typing import Any

from ...core.pipeline_parallel.layer_split import PipelineSplit, split_problems

__all__ = ["add_arguments", "model_fields", "pipeline_split", "virtual_pipeline_size", "layout_problems"]


def add_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="virtual pipeline chunks per pipeline rank (interleaved schedule); the alternative to "
        "--num-layers-per-virtual-pipeline-stage, and the one uneven first / last stages take",
    )
    g.add_argument(
        "--microbatch-group-size-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="interleaved schedule: consecutive micro-batches that run through a virtual pipeline stage before the "
        "next stage's (between the pipeline size and the micro-batches per iteration; default: the pipeline size)",
    )
    g.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="transformer layers of the first pipeline stage; the middle stages share the rest evenly",
    )
    g.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="transformer layers of the last pipeline stage; the middle stages share the rest evenly",
    )
    g.add_argument(
        "--account-for-embedding-in-pipeline-split",
        action="store_true",
        help="the embedding counts as one layer of the pipeline split (the first chunk holds one "
        "transformer layer fewer)",
    )
    g.add_argument(
        "--account-for-loss-in-pipeline-split",
        action="store_true",
        help="the output layer and loss count as one layer of the pipeline split (the last chunk "
        "holds one transformer layer fewer)",
    )


def pipeline_split(args: argparse.Namespace) -> PipelineSplit:
    return PipelineSplit(
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
        args.account_for_embedding_in_pipeline_split,
        args.account_for_loss_in_pipeline_split,
    )


def model_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of the split."""
    split = pipeline_split(args)
    return {
        "num_layers_in_first_pipeline_stage": split.num_layers_in_first_pipeline_stage,
        "num_layers_in_last_pipeline_stage": split.num_layers_in_last_pipeline_stage,
        "account_for_embedding_in_pipeline_split": split.account_for_embedding_in_pipeline_split,
        "account_for_loss_in_pipeline_split": split.account_for_loss_in_pipeline_split,
    }


def virtual_pipeline_size(args: argparse.Namespace) -> int | None:
    """Virtual chunks per pipeline rank (None: one), as megatron-core's ``validate_args`` derives it; assumes
    :func:`layout_problems` found nothing."""
    if args.num_virtual_stages_per_pipeline_rank is not None:
        vpp = args.num_virtual_stages_per_pipeline_rank
    elif args.num_layers_per_virtual_pipeline_stage is not None:
        vpp = _slots(args) // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage
    else:
        return None
    return vpp if vpp > 1 else None


def layout_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the split and the virtual pipeline flags; [] when they fit."""
    pp, per_chunk = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    split = pipeline_split(args)
    if per_chunk is not None and args.num_virtual_stages_per_pipeline_rank is not None:
        return ["--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank: set one"]
    if per_chunk is not None and split.first_last:
        return [
            "--decoder-first/last-pipeline-num-layers take --num-virtual-stages-per-pipeline-rank for virtual "
            "pipelining, not --num-layers-per-virtual-pipeline-stage (Megatron-LM's rule)"
        ]
    if (per_chunk is not None or args.num_virtual_stages_per_pipeline_rank is not None) and pp < 2:
        return ["virtual pipelining needs --pipeline-model-parallel-size > 1"]
    if args.num_virtual_stages_per_pipeline_rank is not None and args.num_virtual_stages_per_pipeline_rank < 1:
        return [f"--num-virtual-stages-per-pipeline-rank {args.num_virtual_stages_per_pipeline_rank} must be >= 1"]
    if per_chunk is not None and (_slots(args) % pp or (_slots(args) // pp) % per_chunk):
        return [
            f"num-layers {args.num_layers}{_slot_text(split)} cannot be cut into {pp} pipeline stages of chunks "
            f"of --num-layers-per-virtual-pipeline-stage {per_chunk} layers"
        ]
    if split.even and args.num_virtual_stages_per_pipeline_rank is not None:
        if args.num_layers % pp or (args.num_layers // pp) % args.num_virtual_stages_per_pipeline_rank:
            return [
                f"num-layers {args.num_layers} cannot be cut into {pp} pipeline stages of "
                f"--num-virtual-stages-per-pipeline-rank {args.num_virtual_stages_per_pipeline_rank} chunks"
            ]
    return split_problems(args.num_layers, pp, virtual_pipeline_size(args), split)


def _slots(args: argparse.Namespace) -> int:
    return args.num_layers + args.account_for_embedding_in_pipeline_split + args.account_for_loss_in_pipeline_split


def _slot_text(split: PipelineSplit) -> str:
    slots = split.account_for_embedding_in_pipeline_split + split.account_for_loss_in_pipeline_split
    return f" (+{slots} for the embedding / loss)" if slots else ""

"""Three Megatron-LM flags mapped onto what runs here, with Megatron-LM's own rules.

- ``--overlap-param-gather-with-optimizer-step``: Megatron starts the first chunk's parameter all-gather inside
  the optimizer step. Here the distributed optimizer's all-gather starts at ``--overlap-param-gather``'s points
  and each forward waits for its bucket's gather, so the parameters every forward reads are the same; only when
  the gather overlaps changes. Megatron's prerequisites are checked (the distributed optimizer,
  ``--overlap-param-gather``, an interleaved pipeline).
- ``--num-distributed-optimizer-instances N``: Megatron keeps N copies of the optimizer, each sharded over
  DP x CP / N ranks, and all-reduces gradients across copies. Here one instance sharded over all DP x CP ranks
  computes the same update (less optimizer memory per rank). Megatron's rule: DP x CP divisible by N.
- ``--fp8-recipe tensorwise``: per-tensor current scaling (Transformer Engine's ``Float8CurrentScaling``): each
  GEMM operand is scaled by the FP8 maximum over its own absolute maximum. That is FP8 QAT with
  ``--qat-clamp absmax --qat-granularity tensor`` and per-tensor weight scales (another --qat-clamp than the
  default, or another granularity, conflicts). ``delayed`` keeps the QAT clamp
  rules (``--qat-clamp``); ``mxfp8``, ``blockwise`` and ``custom`` are refused.
"""

from __future__ import annotations

import argparse

from .report import FlagProblems

FP8_RECIPES_REFUSED = ("mxfp8", "blockwise", "custom")


def check(args: argparse.Namespace, vpp: int | None, problems: FlagProblems) -> None:
    """Megatron-LM's rules for these flags (``vpp``: the virtual pipeline size, None for none)."""
    if args.overlap_param_gather_with_optimizer_step:
        needs = [
            ("--use-distributed-optimizer", args.use_distributed_optimizer),
            ("--overlap-param-gather", args.overlap_param_gather),
            ("an interleaved pipeline (--num-layers-per-virtual-pipeline-stage)", vpp is not None),
        ]
        for what, given in needs:
            if not given:
                problems.conflict(f"--overlap-param-gather-with-optimizer-step needs {what} (Megatron-LM's rule)")
    instances = args.num_distributed_optimizer_instances
    if instances > 1 and not args.use_distributed_optimizer:
        problems.conflict(f"--num-distributed-optimizer-instances {instances} needs --use-distributed-optimizer")


def check_instances(args: argparse.Namespace, dp_cp: int, problems: FlagProblems) -> None:
    """megatron-core's rule once DP is known: DP x CP divisible by the number of instances."""
    instances = args.num_distributed_optimizer_instances
    if dp_cp % instances:
        problems.conflict(
            f"--num-distributed-optimizer-instances {instances} does not divide the data-parallel x "
            f"context-parallel size {dp_cp} (megatron-core's rule)"
        )


def resolve_fp8_recipe(args: argparse.Namespace, problems: FlagProblems) -> None:
    """``--fp8-recipe tensorwise``: FP8 QAT with per-tensor absmax scales (``args`` modified)."""
    if args.fp8_recipe in FP8_RECIPES_REFUSED:
        problems.add(
            "refused",
            f"--fp8-recipe {args.fp8_recipe}: the FP8 recipes here are delayed (FP8 QAT with --qat-clamp) and "
            "tensorwise (per-tensor current scaling)",
        )
    if args.fp8_recipe != "tensorwise":
        return
    if args.qat != "fp8":
        problems.conflict("--fp8-recipe tensorwise needs FP8 training (--fp8-format or --qat fp8)")
    if args.qat_clamp not in ("rms", "absmax") or args.qat_granularity != "tensor":  # given, and not per tensor
        problems.conflict(
            f"--fp8-recipe tensorwise scales each tensor by its absmax; it conflicts with --qat-clamp "
            f"{args.qat_clamp} --qat-granularity {args.qat_granularity}"
        )
    args.qat_clamp = "absmax"

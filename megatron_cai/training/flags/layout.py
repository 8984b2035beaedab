"""What the world size decides from the flags: data parallelism, the global batch, the micro-batches per
iteration, the virtual pipeline size and the length of training; checked as megatron-core checks them (the
parallel layout; the interleaved schedule's micro-batch groups for every micro-batch count of a batch ramp-up)."""

from __future__ import annotations

import argparse

from ...core.parallel_state import ParallelLayoutError, check_layout
from ...core.pipeline_parallel.schedules import interleaving_problem
from ..config import ArgumentError
from . import pipeline_split
from .megatron_features import batch_schedule, step_schedule_global_batch

__all__ = ["Layout", "interleaving_problems"]


class Layout:
    """What the world size decides: DP, the global batch, micro-batches per step, VPP and the length."""

    def __init__(self, args: argparse.Namespace, world_size: int) -> None:
        tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
        if world_size < 1:
            raise ArgumentError(f"the world size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.num_query_groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        dp_guess = max(world_size // max(tp * pp * max(cp, 1), 1), 1)
        self.global_batch_size = (args.global_batch_size or step_schedule_global_batch(args)
                                  or args.micro_batch_size * dp_guess)
        problems = pipeline_split.layout_problems(args)
        try:  # the split module checks the layers per stage and chunk
            self.data_parallel_size = check_layout(
                world_size, tp, pp, num_layers=args.num_layers if pipeline_split.pipeline_split(args).even else None,
                num_attention_heads=args.num_attention_heads, num_query_groups=self.num_query_groups,
                global_batch_size=self.global_batch_size, micro_batch_size=args.micro_batch_size, cp=cp)
        except ParallelLayoutError as e:
            problems.insert(0, str(e))
        if problems:
            raise ArgumentError("; ".join(problems))
        self.num_microbatches = self.global_batch_size // (args.micro_batch_size * self.data_parallel_size)
        eval_gbs = args.eval_global_batch_size
        if eval_gbs is not None and (eval_gbs < 1 or eval_gbs % (args.micro_batch_size * self.data_parallel_size)):
            raise ArgumentError(f"--eval-global-batch-size {eval_gbs} is not a positive multiple of micro batch x DP "
                                f"= {args.micro_batch_size * self.data_parallel_size}")
        self.vpp = pipeline_split.virtual_pipeline_size(args)
        if (args.train_iters is None) == (args.train_samples is None):
            raise ArgumentError("set exactly one of --train-iters and --train-samples")
        if args.train_iters is not None:
            self.train_iters = args.train_iters
        else:  # Megatron's update_train_iters: whole global batches only (floor)
            self.train_iters = args.train_samples // self.global_batch_size
            if self.train_iters == 0:
                raise ArgumentError(f"--train-samples {args.train_samples} is less than one global batch "
                                    f"(--global-batch-size {self.global_batch_size}): nothing to train")
        self.microbatches = batch_schedule(args, self.global_batch_size, args.micro_batch_size,
                                          self.data_parallel_size)
        ramp = self.microbatches.rampup is not None or self.microbatches.step_schedule is not None
        if ramp and args.train_samples is not None:
            self.train_iters = self.microbatches.train_iters(args.train_samples)
        if self.vpp is not None:
            eval_counts = {eval_gbs // (args.micro_batch_size * self.data_parallel_size)} if eval_gbs else set()
            counts = self.microbatches.microbatch_counts() | eval_counts
            problems = interleaving_problems(args, counts)
            if problems:
                raise ArgumentError("; ".join(problems))


def interleaving_problems(args: argparse.Namespace, microbatch_counts: set[int]) -> list[str]:
    """megatron-core's checks of the interleaved schedule for each number of micro-batches an iteration (or an
    evaluation) runs, named by the flags that set them."""
    pp, group = args.pipeline_model_parallel_size, args.microbatch_group_size_per_virtual_pipeline_stage
    problems = []
    for count in sorted(microbatch_counts):
        problem = interleaving_problem(count, pp, group or pp)
        if problem:
            given = f" {group}" if group else f" unset (= --pipeline-model-parallel-size {pp})"
            problems.append(f"--microbatch-group-size-per-virtual-pipeline-stage{given} with {count} micro-batches "
                            f"per iteration (global batch / (micro batch x DP)): {problem}")
    return problems


"""Flag checks for ``--use-torch-fsdp2`` (one clear error per impossible combination)."""
from __future__ import annotations


def validate_fsdp2_args(args) -> None:
    """Reject flags that do not (yet) work with FSDP2; raise ArgumentError naming the flag."""
    from ...training.arguments import ArgumentError

    if args.save or args.load:
        raise ArgumentError(
            f"--use-torch-fsdp2 cannot {'save' if args.save else 'load'} checkpoints yet: FSDP2 parameters are "
            "DTensor shards, which need the distributed checkpoint format (--ckpt-format torch_dist, not "
            "implemented yet); the per-rank format (torch) is refused. Drop --save/--load, or train without "
            "--use-torch-fsdp2")
    if args.use_distributed_optimizer:
        raise ArgumentError("--use-torch-fsdp2 already shards the optimizer state: drop --use-distributed-optimizer")
    if args.squinch_hierarchical:
        raise ArgumentError("--squinch-hierarchical (HSDP with Squinch across nodes) is not supported with "
                            "--use-torch-fsdp2 yet")

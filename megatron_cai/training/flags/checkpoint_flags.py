"""The checkpointing flags (Megatron-LM's names: ``--save``, ``--load``, ``--ckpt-format``, the non-persistent saves,
...) and our trust flags, and the :class:`CheckpointConfig` they build (``training/checkpoint/`` reads it)."""
from __future__ import annotations

import argparse

from ..config import CheckpointConfig

__all__ = ["add_arguments", "add_checkpoint_trust_flags", "checkpoint_config"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only; start at iteration 0")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"], default="torch",
                   help="torch: one file per model-parallel rank (Megatron-LM's torch layout; loads into the "
                        "same TP/PP layout). torch_dist: torch.distributed.checkpoint, loads into any TP x PP x DP "
                        "x virtual-PP layout (Megatron-LM's default). torch_dcp and fsdp_dtensor are refused")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="--load reads whichever format the checkpoint holds (torch_dist .metadata or torch "
                        "mp_rank_* directories); saves still use --ckpt-format")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in a background thread while training goes on; the tracker moves "
                        "once every rank's write has finished and verified (megatron_cai/training/"
                        "checkpoint/async_save.py)")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="let this run save iterations that --save already holds (another run's, or those after "
                        "--ckpt-step): they are moved aside to iter_N.superseded-<time>, never deleted, and the "
                        "tracker moves only once the new save is complete")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="keep only the checkpoints whose iteration is a multiple of this (and the newest); the "
                        "others of this run are deleted once a newer one is published (Megatron-LM's flag)")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="also save every N iterations to the non-persistent directory (only its newest is kept); "
                        "a resume loads it when it is newer than the persistent one")
    g.add_argument("--non-persistent-ckpt-type", choices=["global", "local", "in_memory"], default=None,
                   help="global: a normal checkpoint in --non-persistent-global-ckpt-dir (default "
                        "<save>/non_persistent); local and in_memory are refused here")
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="where global non-persistent checkpoints go (default <save>/non_persistent)")
    g.add_argument("--non-persistent-local-ckpt-dir", default=None,
                   help="Megatron-LM's per-node directory of local non-persistent checkpoints (local is refused "
                        "here)")
    g.add_argument("--non-persistent-local-ckpt-algo", choices=["fully_parallel", "atomic"],
                   default="fully_parallel", help="Megatron-LM's local-checkpoint algorithm (local is refused here)")
    g.add_argument("--allow-tokenizer-change", action="store_true",
                   help="resume although the tokenizer's content differs from the one the checkpoint was saved "
                        "with (by default an error; --finetune allows it too)")
    add_checkpoint_trust_flags(g)


def add_checkpoint_trust_flags(g: argparse._ActionsContainer) -> None:
    """What a load of a checkpoint accepts (``training/checkpoint/safe_load.py``); the tools that read checkpoints
    add the same three flags to their own parsers."""
    g.add_argument("--trust-checkpoint-code", action="store_true",
                   help="load checkpoint files that are not plain data (torch.load(weights_only=False), DCP's "
                        "unrestricted reader): they may run code; only for checkpoints from a trusted source")
    g.add_argument("--allow-unverified-checkpoint", action="store_true",
                   help="load a checkpoint without a content-hash manifest (or hashed with an algorithm this "
                        "installation lacks), its files unverified")
    g.add_argument("--checkpoint-signing-key", default=None, metavar="FILE",
                   help="a file holding an HMAC key: saves sign their manifest, loads require the signature "
                        "(docs/checkpoints.md)")


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    return CheckpointConfig(
        save=args.save,
        load=args.load,
        save_interval=args.save_interval,
        load_optim=not args.no_load_optim,
        load_rng=not args.no_load_rng,
        save_optim=not args.no_save_optim,
        finetune=args.finetune,
        exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
        ckpt_step=args.ckpt_step,
        ckpt_format=args.ckpt_format,
        async_save=args.async_save,
        auto_detect_ckpt_format=args.auto_detect_ckpt_format,
        overwrite_checkpoints=args.overwrite_checkpoints,
        allow_tokenizer_change=args.allow_tokenizer_change,
        trust_checkpoint_code=args.trust_checkpoint_code,
        allow_unverified_checkpoint=args.allow_unverified_checkpoint,
        checkpoint_signing_key=args.checkpoint_signing_key,
        save_retain_interval=args.save_retain_interval,
        non_persistent_save_interval=args.non_persistent_save_interval,
        non_persistent_ckpt_type=args.non_persistent_ckpt_type,
        non_persistent_global_ckpt_dir=args.non_persistent_global_ckpt_dir,
    )

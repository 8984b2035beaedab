"""The ``--diloco-*`` flags (DiLoCo across islands, docs/diloco.md) and their :class:`DilocoConfig`.

Megatron-LM has no DiLoCo; the names follow its style (``--diloco-islands``, ``--diloco-inner-steps``,
``--diloco-outer-lr``) and torchft's terms (fragments, sync delay as ``--diloco-overlap-steps``).
"""
from __future__ import annotations

import argparse

from ...core.diloco import OUTER_BITS, DilocoConfig
from .report import FlagProblems


def add_diloco_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("DiLoCo across islands (docs/diloco.md)")
    g.add_argument("--diloco-islands", type=int, default=1,
                   help="split the job into this many islands of consecutive ranks (whole nodes); each is a TP x "
                        "PP x CP x DP job and the islands average their pseudo-gradients every H inner steps")
    g.add_argument("--diloco-inner-steps", type=int, default=0,
                   help="H: inner steps between two outer steps of a fragment (0: DiLoCo off)")
    g.add_argument("--diloco-outer-lr", type=float, default=0.7, help="the outer optimizer's learning rate")
    g.add_argument("--diloco-outer-momentum", type=float, default=0.9,
                   help="the outer optimizer's Nesterov momentum (0: plain SGD)")
    g.add_argument("--diloco-outer-bits", type=int, choices=list(OUTER_BITS), default=6,
                   help="pseudo-gradients on the wire: 6 (Squinch v1, error feedback), 16 (bf16, error feedback) "
                        "or 32 (fp32)")
    g.add_argument("--diloco-fragments", type=int, default=1,
                   help="K: Streaming DiLoCo fragments, each synchronised on its own schedule (peak outer "
                        "bandwidth / K)")
    g.add_argument("--diloco-overlap-steps", type=int, default=0,
                   help="tau: inner steps that a fragment's outer all-reduce overlaps before its update lands")
    g.add_argument("--diloco-local-weight", type=float, default=0.0,
                   help="alpha: a fragment's weights become alpha x local + (1 - alpha) x outer when its update "
                        "lands (with overlap, keeps part of the local progress)")
    g.add_argument("--no-diloco-error-feedback", dest="diloco_error_feedback", action="store_false", default=True,
                   help="no error feedback on the 6- and 16-bit outer all-reduce")
    g.add_argument("--no-diloco-final-average", dest="diloco_final_average", action="store_false", default=True,
                   help="after the last training iteration, keep each island's own weights (default: every island's "
                        "weights become the islands' mean before the last evaluation and save)")


def diloco_config(args: argparse.Namespace, world_size: int, problems: FlagProblems) -> DilocoConfig:
    """The :class:`DilocoConfig` of the flags; every impossible combination recorded in ``problems``."""
    cfg = DilocoConfig(islands=args.diloco_islands, inner_steps=args.diloco_inner_steps,
                       outer_lr=args.diloco_outer_lr, outer_momentum=args.diloco_outer_momentum,
                       outer_bits=args.diloco_outer_bits, fragments=args.diloco_fragments,
                       overlap_steps=args.diloco_overlap_steps, local_weight=args.diloco_local_weight,
                       error_feedback=args.diloco_error_feedback, final_average=args.diloco_final_average)
    found = cfg.problems()
    shard = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    if cfg.islands > 1 and world_size % (cfg.islands * shard):
        found.append(f"--diloco-islands {cfg.islands}: the world size {world_size} does not split into islands of "
                     f"whole TP x PP x CP = {shard} model replicas")
    if cfg.enabled and args.use_torch_fsdp2:
        found.append("--diloco-inner-steps with --use-torch-fsdp2 is not supported: DiLoCo reads the flat "
                     "parameter buffers of DDP / the distributed optimizer")
    if cfg.islands > 1 and args.ckpt_format != "torch" and (args.save or args.load):
        found.append(f"--diloco-islands {cfg.islands} saves each island's state in --ckpt-format torch only "
                     f"(got {args.ckpt_format})")
    if cfg.islands > 1 and args.async_save:
        found.append("--async-save with --diloco-islands > 1 is not supported")
    for message in found:
        problems.invalid(message)
    return cfg

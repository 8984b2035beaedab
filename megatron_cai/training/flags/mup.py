"""Maximal Update Parameterization flags (megatron-core 0.19.2's ``--use-mup`` family; semantics in
:mod:`megatron_cai.core.mup`, documented in docs/mup.md).

This module adds the flags, checks them with the one report, and maps them onto the model
(:class:`MupConfig`), optimizer (width multiplier: which parameters and epsilons rescale) and scheduler
(the MuP group's learning-rate multiplier) configs. ``--mup-width-mult`` is accepted without effect (the flag
table): megatron-core recomputes it from the two widths.
"""
from __future__ import annotations

import argparse

from ...core.mup import MupConfig
from ...core.optimizer.config import OptimizerConfig, mup_lr_mult
from .report import FlagProblems

__all__ = ["add_arguments", "check", "model_fields", "optimizer_fields", "scheduler_fields"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Maximal Update Parameterization (megatron-core's MuP, docs/mup.md)")
    g.add_argument("--use-mup", action="store_true",
                   help="MuP: hidden init std / sqrt(m), attention scale 1/d_head, logits x 1/m, Adam learning rate "
                        "and epsilon of hidden matrices / m, with m = --hidden-size / --mup-base-hidden-size")
    g.add_argument("--mup-base-hidden-size", type=int, default=None,
                   help="the base (proxy) model's hidden size from which m is computed (default: --hidden-size, m = 1)")
    g.add_argument("--mup-embedding-mult", type=float, default=1.0, help="MuP: the embedding output x this")
    g.add_argument("--mup-output-mult", type=float, default=1.0,
                   help="MuP: the logits x this (1.0: megatron-core's automatic 1/m)")
    g.add_argument("--mup-base-head-dim", type=float, default=None,
                   help="MuP: softmax scale sqrt(this) / d_head ** --mup-attn-scale-power (default: 1 / d_head ** p)")
    g.add_argument("--mup-attn-scale-power", type=float, default=1.0,
                   help="MuP: the power p of d_head in the softmax scale (1: MuP's 1/d; 0.5: the standard 1/sqrt(d))")


def check(args: argparse.Namespace, problems: FlagProblems) -> None:
    """The cross-flag rules (the values' ranges are config.FLAG_RANGES')."""
    if args.use_mup and args.multi_latent_attention:
        problems.conflict("--use-mup with --multi-latent-attention is not implemented here (MuP applies to "
                          "standard self-attention)")
    if args.use_mup and args.num_experts:
        problems.conflict("--use-mup with --num-experts is not implemented here (MuP applies to dense layers)")


def _config(args: argparse.Namespace) -> MupConfig:
    return MupConfig(args.use_mup, args.mup_base_hidden_size, args.mup_embedding_mult, args.mup_output_mult,
                     args.mup_base_head_dim, args.mup_attn_scale_power)


def model_fields(args: argparse.Namespace) -> dict:
    return {"mup": _config(args)}


def optimizer_fields(args: argparse.Namespace) -> dict:
    return {"mup_width_mult": _config(args).width_mult(args.hidden_size)}


def scheduler_fields(args: argparse.Namespace) -> dict:
    """The MuP group's multiplier of peak and minimum learning rate (megatron-core's max_lr / min_lr overrides)."""
    opt = OptimizerConfig(optimizer=args.optimizer, **optimizer_fields(args))
    return {"mup_lr_mult": mup_lr_mult(opt)}

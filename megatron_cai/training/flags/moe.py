"""Megatron-LM's Mixture-of-Experts flags (its names and defaults) and the :class:`MoEConfig` they build.

``--moe-layer-freq`` takes an int or Megatron's pattern expression (``"([1]*3+[0]*1)*3"``), read by a small
evaluator of list literals, ``+`` and ``*`` (never ``eval``). Flags accepted with no effect here say so in their
help; MoE flags this codebase lacks stay refused by the ``--moe-`` family rule of ``report``.
"""
from __future__ import annotations

import argparse
import ast

from ...core.parallel_state import check_expert_layout
from ...core.transformer.moe.config import DISPATCHERS, DROP_POLICIES, LOAD_BALANCING_TYPES, SCORE_FUNCTIONS, MoEConfig

_MAX_LAYERS = 100_000  # a pattern longer than any model: refused before it is built


def layer_freq(text: str) -> int | list[int]:
    """``--moe-layer-freq``: an int, or a list expression of 0/1 built from list literals, ``+`` and ``*``."""
    text = str(text).strip()
    if text.lstrip("-").isdigit():
        return int(text)

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int) and \
                    len(left) * right > _MAX_LAYERS:
                raise ValueError("too many layers")
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(ast.dump(node))

    try:
        pattern = value(ast.parse(text, mode="eval"))
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an int nor a list of 0/1 built with [..], + and *") from None
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
        raise argparse.ArgumentTypeError(f"{text!r} must give a list of 0 and 1 (one per layer)")
    return pattern


def add_moe_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Mixture of Experts (Megatron-LM's flags)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (None: a dense model)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="each expert's hidden size "
                   "(default --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=layer_freq, default=1,
                   help="an MoE layer every N layers, or a 0/1 pattern per layer such as '([1]*3+[0]*1)*3'")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-router-score-function", choices=SCORE_FUNCTIONS, default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true", help="softmax before the top-k")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="expert groups (group-limited routing)")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="groups each token may use")
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None, help="the router's GEMM and "
                   "routing precision (default: the input's)")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-router-load-balancing-type", nargs="+", choices=LOAD_BALANCING_TYPES, default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert routing bias moved towards the mean load each step")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None, help="None: no token dropping")
    g.add_argument("--moe-token-drop-policy", choices=DROP_POLICIES, default="probs")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="accepted; the shared experts run in the main stream here")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="torch._grouped_mm where the device has it, else one batched GEMM")
    g.add_argument("--moe-permute-fusion", action="store_true", help="accepted; permutation is index_select here")
    g.add_argument("--moe-router-fusion", action="store_true", help="accepted; the router is unfused torch here")
    g.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS, default="allgather")
    g.add_argument("--moe-per-layer-logging", action="store_true", help="TensorBoard tags per MoE layer")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: --tensor-model-"
                   "parallel-size")


def _single(flag: str, value):
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"{flag} {' '.join(map(str, value))}: one load-balancing type at a time here")
        return value[0]
    return value


def moe_config(args: argparse.Namespace) -> MoEConfig | None:
    """The MoE config of ``args`` (None without ``--num-experts``); raises ValueError naming the flag."""
    if args.num_experts is None:
        return None
    cfg = MoEConfig(
        num_experts=args.num_experts, ffn_hidden_size=args.moe_ffn_hidden_size, layer_freq=args.moe_layer_freq,
        router_topk=args.moe_router_topk, router_score_function=args.moe_router_score_function,
        router_pre_softmax=args.moe_router_pre_softmax, router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        router_num_groups=args.moe_router_num_groups, router_group_topk=args.moe_router_group_topk,
        router_dtype=args.moe_router_dtype, input_jitter_eps=args.moe_input_jitter_eps,
        router_load_balancing_type=_single("--moe-router-load-balancing-type", args.moe_router_load_balancing_type),
        aux_loss_coeff=_single("--moe-aux-loss-coeff", args.moe_aux_loss_coeff), z_loss_coeff=args.moe_z_loss_coeff,
        router_enable_expert_bias=args.moe_router_enable_expert_bias,
        router_bias_update_rate=args.moe_router_bias_update_rate,
        expert_capacity_factor=args.moe_expert_capacity_factor, token_drop_policy=args.moe_token_drop_policy,
        pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        shared_expert_gate=args.moe_shared_expert_gate, shared_expert_overlap=args.moe_shared_expert_overlap,
        grouped_gemm=args.moe_grouped_gemm, permute_fusion=args.moe_permute_fusion,
        token_dispatcher_type=args.moe_token_dispatcher_type, per_layer_logging=args.moe_per_layer_logging,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    cfg.validate(args.num_layers)
    return cfg


def expert_sizes(args: argparse.Namespace, world_size: int) -> tuple[int, int | None]:
    """(--expert-model-parallel-size, --expert-tensor-parallel-size) for ``parallel_state``, checked against
    the world size (raises ValueError naming the flags)."""
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if ep > 1 and args.num_experts is None:
        raise ValueError(f"--expert-model-parallel-size {ep} needs --num-experts")
    tp = args.tensor_model_parallel_size
    if args.num_experts is not None and tp > 1 and not args.sequence_parallel:
        raise ValueError(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
                         "(as Megatron-LM's)")
    if (ep > 1 or (etp or tp) != tp) and args.use_torch_fsdp2 and args.squinch_hierarchical:
        raise ValueError(f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp or tp} with "
                         "--use-torch-fsdp2 --squinch-hierarchical: the experts' expert-DP mesh has no intra-node / "
                         "inter-node split here; drop --squinch-hierarchical or use DDP")
    split = args.num_experts is not None and (ep > 1 or (etp or tp) > 1)
    if split and (args.save or args.load) and args.ckpt_format != "torch_dist":
        raise ValueError(f"--expert-model-parallel-size {ep} / expert tensor parallel size {etp or tp} with --save / "
                         f"--load needs --ckpt-format torch_dist (got {args.ckpt_format}: its per-TP-rank files "
                         "would hold one rank's experts only)")
    if args.num_experts is not None and args.moe_token_dispatcher_type == "alltoall" and (etp or tp) > 1:
        raise ValueError("--moe-token-dispatcher-type alltoall with expert tensor parallelism > 1 is not "
                         "implemented here; use allgather or --expert-tensor-parallel-size 1")
    if args.num_experts is not None and args.recompute_granularity == "full":
        raise ValueError("--num-experts with --recompute-granularity full: the recomputed forward would route, "
                         "count and log each MoE layer's tokens twice here; use selective recompute")
    if args.num_experts is not None and args.context_parallel_size > 1 and \
            _single("--moe-router-load-balancing-type", args.moe_router_load_balancing_type) == "seq_aux_loss":
        raise ValueError("--moe-router-load-balancing-type seq_aux_loss with --context-parallel-size > 1 is not "
                         "implemented here (its documents span the CP ranks' zig-zag chunks); use aux_loss")
    check_expert_layout(world_size, args.pipeline_model_parallel_size, etp or tp, ep)
    return ep, etp

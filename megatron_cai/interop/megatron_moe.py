"""MoE layers in megatron-core's layout (local spec, ``SequentialMLP``, expert parallel size 1), for the
Megatron-LM exporter and importer (:mod:`.megatron`).

===============================================  ===========================================================
ours (full tensors)                              megatron-core (per TP rank; expert TP = TP)
===============================================  ===========================================================
``mlp.router.weight`` ``[E, hidden]``            ``mlp.router.weight`` (replicated)
``mlp.router.expert_bias`` ``[E]`` (buffer)      ``mlp.router.expert_bias`` (replicated buffer)
``mlp.experts.fc1_weight`` ``[E, fc1, hidden]``  ``mlp.experts.local_experts.{e}.linear_fc1.weight``: column
                                                 parallel, SwiGLU's [gate_t; up_t] per TP rank as dense fc1
``mlp.experts.fc2_weight`` ``[E, hidden, ffn]``  ``mlp.experts.local_experts.{e}.linear_fc2.weight``: row parallel
``mlp.experts.fc1_bias`` / ``fc2_bias``          ``local_experts.{e}.linear_fc1.bias`` (split) / ``linear_fc2.bias``
``mlp.shared_experts.mlp.linear_fc{1,2}.*``      ``mlp.shared_experts.linear_fc{1,2}.*`` (split as the dense MLP)
``mlp.shared_experts.gate_weight``               ``mlp.shared_experts.gate_weight`` (replicated)
===============================================  ===========================================================

The MoE flags go into the checkpoint's ``args`` under Megatron-LM's names; those that its
``load_args_from_checkpoint`` does not restore are listed in the printed command line.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.models.gpt.config import GPTConfig
from ..core.transformer.moe.config import MoEConfig

# our MoEConfig field -> Megatron-LM's args attribute (its flag's dest)
MEGATRON_MOE_ARGS = {
    "num_experts": "num_experts", "ffn_hidden_size": "moe_ffn_hidden_size", "layer_freq": "moe_layer_freq",
    "router_topk": "moe_router_topk", "router_score_function": "moe_router_score_function",
    "router_pre_softmax": "moe_router_pre_softmax", "router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "router_num_groups": "moe_router_num_groups", "router_group_topk": "moe_router_group_topk",
    "router_dtype": "moe_router_dtype", "input_jitter_eps": "moe_input_jitter_eps",
    "router_load_balancing_type": "moe_router_load_balancing_type", "aux_loss_coeff": "moe_aux_loss_coeff",
    "z_loss_coeff": "moe_z_loss_coeff", "router_enable_expert_bias": "moe_router_enable_expert_bias",
    "router_bias_update_rate": "moe_router_bias_update_rate", "expert_capacity_factor": "moe_expert_capacity_factor",
    "token_drop_policy": "moe_token_drop_policy", "pad_expert_input_to_capacity": "moe_pad_expert_input_to_capacity",
    "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "shared_expert_gate": "moe_shared_expert_gate", "shared_expert_overlap": "moe_shared_expert_overlap",
    "grouped_gemm": "moe_grouped_gemm", "permute_fusion": "moe_permute_fusion",
    "token_dispatcher_type": "moe_token_dispatcher_type", "per_layer_logging": "moe_per_layer_logging",
    "expert_model_parallel_size": "expert_model_parallel_size",
    "expert_tensor_parallel_size": "expert_tensor_parallel_size"}
# what megatron-core 0.19.2's load_args_from_checkpoint restores (the rest must be passed as flags)
_RESTORED = ("num_experts", "layer_freq", "ffn_hidden_size", "router_topk", "token_dispatcher_type",
             "router_pre_softmax", "grouped_gemm", "shared_expert_intermediate_size", "router_score_function",
             "router_enable_expert_bias", "router_topk_scaling_factor")
# fields that shape the forward pass (the others are training or placement settings)
_FORWARD = ("router_num_groups", "router_group_topk", "router_dtype", "expert_capacity_factor", "token_drop_policy",
            "pad_expert_input_to_capacity", "shared_expert_gate")


def megatron_moe_args(config: GPTConfig) -> dict:
    """The MoE entries of a Megatron-LM ``args`` (``num_experts=None`` for a dense model). The checkpoint
    holds every expert on each rank: expert parallel size 1, expert TP = TP; the grouped GEMM off (the local
    spec's ``SequentialMLP`` weight names)."""
    moe = config.moe
    if moe is None:
        return {"num_experts": None}
    out = {theirs: getattr(moe, ours) for ours, theirs in MEGATRON_MOE_ARGS.items()}
    out.update(moe_ffn_hidden_size=moe.ffn_hidden_size or config.ffn_hidden_size, moe_grouped_gemm=False,
               expert_model_parallel_size=1, expert_tensor_parallel_size=None, moe_token_dispatcher_type="allgather")
    return out


def megatron_moe_flags(moe: MoEConfig | None) -> list[str]:
    """Megatron-LM flags for the forward-pass MoE settings its ``--use-checkpoint-args`` does not restore."""
    if moe is None:
        return []
    default, flags = MoEConfig(), []
    for name in _FORWARD:
        value = getattr(moe, name)
        if value == getattr(default, name):
            continue
        flag = "--" + MEGATRON_MOE_ARGS[name].replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def moe_pretrain_flags(moe: MoEConfig | None) -> list[str]:
    """The MoE flags (Megatron-LM's names, ours too) that rebuild ``moe``'s weights and forward pass."""
    if moe is None:
        return []
    default, flags = MoEConfig(), ["--num-experts", str(moe.num_experts)]
    for name in (*MoEConfig.ARCHITECTURE_FIELDS, *_FORWARD, "layer_freq"):
        value = getattr(moe, name)
        if name == "num_experts" or value == getattr(default, name):
            continue
        flag = "--" + MEGATRON_MOE_ARGS[name].replace("_", "-")
        flags += [flag] if value is True else [flag, str(value).replace(" ", "")]
    return flags


def moe_config_from_megatron_args(get: Callable[[str], object], why: list[str]) -> MoEConfig | None:
    """Our MoEConfig from a Megatron-LM checkpoint's ``args`` (``get(name)``); what it cannot hold goes to ``why``."""
    if not get("num_experts"):
        return None
    if (get("expert_model_parallel_size") or 1) > 1:
        why.append(f"--expert-model-parallel-size {get('expert_model_parallel_size')} (MoE files split over expert "
                   f"ranks) is not read here; convert it to expert parallel size 1 in Megatron-LM first")
    if get("moe_grouped_gemm"):
        why.append("--moe-grouped-gemm (TEGroupedMLP's weight names) is not read here")
    fields = {ours: get(theirs) for ours, theirs in MEGATRON_MOE_ARGS.items() if get(theirs) is not None}
    for name in ("router_load_balancing_type", "aux_loss_coeff"):  # Megatron-LM allows one value per type
        value = fields.get(name)
        if isinstance(value, list):
            fields[name] = value[0]
            if len(value) != 1:
                why.append(f"--{MEGATRON_MOE_ARGS[name].replace('_', '-')} {value}: one value only here")
    fields.update(expert_model_parallel_size=1, expert_tensor_parallel_size=None, token_dispatcher_type="allgather",
                  grouped_gemm=False)
    known = {f for f in MoEConfig.__dataclass_fields__}
    return MoEConfig(**{k: v for k, v in fields.items() if k in known})


def is_megatron_moe_tensor(name: str) -> bool:
    return ".mlp.router." in name or ".mlp.experts.local_experts." in name or ".mlp.shared_experts." in name


def moe_from_megatron(shards: dict[str, list[torch.Tensor]], config: GPTConfig,
                      join_fc1: Callable[[list[torch.Tensor]], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full MoE tensors from megatron-core's (global names, one tensor per TP rank): the inverse of
    :func:`moe_to_megatron`. ``join_fc1``: the dense fc1's inverse split."""
    swiglu = config.activation == "swiglu"
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}

    def column(ts: list[torch.Tensor]) -> torch.Tensor:
        return join_fc1(ts) if swiglu else torch.cat(ts, 0)

    def row(ts: list[torch.Tensor], name: str) -> torch.Tensor:
        return torch.cat(ts, 1) if name.endswith("weight") and len(ts) > 1 else ts[0]

    for name, ts in shards.items():
        base, leaf = name.split(".mlp.", 1)
        if leaf.startswith("router.") or leaf == "shared_experts.gate_weight":
            out[name] = ts[0]
        elif leaf.startswith("shared_experts."):
            ours = f"{base}.mlp.shared_experts.mlp.{leaf.removeprefix('shared_experts.')}"
            out[ours] = column(ts) if ".linear_fc1." in ours else row(ts, ours)
        else:  # experts.local_experts.{e}.linear_fc{1,2}.{weight,bias}
            _, _, e, linear, param = leaf.split(".")
            t = column(ts) if linear == "linear_fc1" else row(ts, param)
            experts.setdefault(f"{base}.mlp.experts.{linear.removeprefix('linear_')}_{param}", {})[int(e)] = t
    for name, by_expert in experts.items():
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def is_moe_tensor(name: str) -> bool:
    return ".mlp.router." in name or ".mlp.experts." in name or ".mlp.shared_experts." in name


def moe_to_megatron(name: str, full: torch.Tensor, config: GPTConfig, tp: int,
                    split_fc1: Callable[[torch.Tensor, int], list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """One of our MoE tensors as megatron-core tensors: ``{name: [tensor per TP rank]}``. ``split_fc1``: the
    dense fc1's column-parallel split (SwiGLU's [gate_t; up_t] per rank)."""
    base, leaf = name.split(".mlp.", 1)
    swiglu = config.activation == "swiglu"

    def column(t: torch.Tensor) -> list[torch.Tensor]:
        return split_fc1(t, tp) if swiglu else list(t.chunk(tp, 0))

    if leaf.startswith("router.") or leaf == "shared_experts.gate_weight":
        return {name: [full] * tp}
    if leaf.startswith("shared_experts.mlp."):
        theirs = f"{base}.mlp.shared_experts.{leaf.removeprefix('shared_experts.mlp.')}"
        if ".linear_fc1." in theirs:
            return {theirs: column(full)}
        return {theirs: list(full.chunk(tp, 1)) if theirs.endswith("weight") else [full] * tp}
    experts = f"{base}.mlp.experts.local_experts"
    kind = leaf.removeprefix("experts.")  # fc1_weight, fc2_weight, fc1_bias, fc2_bias
    linear, param = kind.split("_")
    out = {}
    for e in range(full.shape[0]):
        t = full[e]
        if linear == "fc1":
            parts = column(t)
        else:
            parts = list(t.chunk(tp, 1)) if param == "weight" else [t] * tp
        out[f"{experts}.{e}.linear_{linear}.{param}"] = parts
    return out

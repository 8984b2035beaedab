"""megatron-core 0.19.2's MoELayer (local spec, allgather dispatcher) on CPU beside ours, with the same weights,
for the MoE layer's equality tests. Runs inside a one-rank gloo process (megatron-core's parallel_state)."""
from __future__ import annotations

import contextlib
import io
import warnings

import torch
import torch.nn.functional as F

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.transformer.moe.config import MoEConfig
from megatron_cai.core.transformer.moe.moe_layer import DenseShape, MoELayer
from megatron_cai.interop.megatron_moe import MEGATRON_MOE_ARGS as MEGATRON_ARGS

HIDDEN, FFN, LAYERS = 16, 24, 2

# the fields megatron-core's MoELayer reads from its TransformerConfig (named as the args, but num_moe_experts)
_LAYER_FIELDS = ("num_experts", "ffn_hidden_size", "router_topk", "router_score_function", "router_pre_softmax",
                 "router_topk_scaling_factor", "router_num_groups", "router_group_topk", "router_dtype",
                 "router_load_balancing_type", "aux_loss_coeff", "z_loss_coeff", "router_enable_expert_bias",
                 "router_bias_update_rate", "expert_capacity_factor", "token_drop_policy",
                 "pad_expert_input_to_capacity", "shared_expert_intermediate_size", "shared_expert_gate",
                 "token_dispatcher_type")
_FIELDS = {f: "num_moe_experts" if f == "num_experts" else MEGATRON_ARGS[f] for f in _LAYER_FIELDS}


def megatron_layer(cfg: MoEConfig, activation: str, bias: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {theirs: getattr(cfg, ours) for ours, theirs in _FIELDS.items()}
    kw["moe_ffn_hidden_size"] = cfg.ffn_hidden_size or FFN
    swiglu = activation == "swiglu"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2, ffn_hidden_size=FFN,
                                   use_cpu_initialization=True, add_bias_linear=bias, gated_linear_unit=swiglu,
                                   activation_func=F.silu if swiglu else F.gelu, bias_activation_fusion=False,
                                   hidden_dropout=0.0, **kw)
        spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False)
        layer = spec.submodules.mlp(config=config, layer_number=1)
    layer.set_layer_number(1)
    return layer


def our_layer(cfg: MoEConfig, activation: str, bias: bool) -> MoELayer:
    dense = DenseShape(HIDDEN, FFN, LAYERS, activation, bias, 0.02, False)
    return MoELayer(cfg, dense)


def copy_weights(theirs, ours: MoELayer) -> None:
    """megatron-core's weights into ours (experts stacked)."""
    with torch.no_grad():
        ours.router.weight.copy_(theirs.router.weight)
        experts = theirs.experts.local_experts
        ours.experts.fc1_weight.copy_(torch.stack([e.linear_fc1.weight for e in experts]))
        ours.experts.fc2_weight.copy_(torch.stack([e.linear_fc2.weight for e in experts]))
        if ours.experts.fc1_bias is not None:
            ours.experts.fc1_bias.copy_(torch.stack([e.linear_fc1.bias for e in experts]))
            ours.experts.fc2_bias.copy_(torch.stack([e.linear_fc2.bias for e in experts]))
        if ours.shared_experts is not None:
            ours.shared_experts.mlp.linear_fc1.weight.copy_(theirs.shared_experts.linear_fc1.weight)
            ours.shared_experts.mlp.linear_fc2.weight.copy_(theirs.shared_experts.linear_fc2.weight)
            if ours.shared_experts.gate_weight is not None:
                ours.shared_experts.gate_weight.copy_(theirs.shared_experts.gate_weight)


def update_megatron_expert_bias(layer) -> None:
    """What megatron-core's finalize_model_grads does after a step with the expert bias on."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    router = layer.router
    group = ps_megatron_tp_dp_cp()
    router.expert_bias.data = get_updated_expert_bias(router.local_tokens_per_expert, router.expert_bias,
                                                      router.config.moe_router_bias_update_rate, group)
    router.local_tokens_per_expert.zero_()


def ps_megatron_tp_dp_cp():
    from megatron.core import parallel_state as mps

    return mps.get_tensor_and_data_parallel_group(with_context_parallel=True)


def megatron_metrics(layer_number: int = 1) -> dict[str, float]:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    out = {name: float(e.values[layer_number - 1]) for name, e in tracker.metrics.items()}
    tracker.clear()
    return {k: v for k, v in out.items() if v != 0.0}


def init_megatron_single_rank() -> None:
    """megatron-core's and our parallel_state over the one-rank gloo group."""
    from .mcore_cpu import shim_cpu

    shim_cpu()
    from megatron.core import parallel_state as mps

    mps.initialize_model_parallel()
    ps.initialize_model_parallel()

"""Our MoE layer against megatron-core 0.19.2's MoELayer (local spec, allgather dispatcher, CPU) with the same
weights and tokens: forward output, input gradient, every weight gradient and the logged aux-loss values to 1e-5,
over the router's options (top-k, score functions, each load-balancing type, z-loss, expert bias after three
updates, shared experts with gate, capacity with each drop policy, group-limited routing)."""
from __future__ import annotations

import pytest
import torch
from testlib.distributed import run_distributed

pytest.importorskip("megatron.core")

CASES = {
    "top1_softmax_aux": dict(router_topk=1, router_pre_softmax=True, aux_loss_coeff=0.01),
    "top2_softmax_aux": dict(router_topk=2, aux_loss_coeff=0.01),
    "top4_softmax_pre": dict(router_topk=4, router_pre_softmax=True, router_load_balancing_type="none"),
    "top2_sigmoid_seq_aux": dict(router_score_function="sigmoid", router_load_balancing_type="seq_aux_loss",
                                 aux_loss_coeff=0.1, router_topk_scaling_factor=2.5),
    "top2_global_aux_z": dict(router_load_balancing_type="global_aux_loss", aux_loss_coeff=0.05, z_loss_coeff=1e-3),
    "top1_sinkhorn": dict(router_topk=1, router_load_balancing_type="sinkhorn"),
    "top2_sinkhorn_swiglu": dict(router_load_balancing_type="sinkhorn", _activation="swiglu"),
    "top2_grouped_gemm_fallback": dict(aux_loss_coeff=0.01, grouped_gemm=True, _activation="swiglu"),
    "top2_none_fp64": dict(router_load_balancing_type="none", router_dtype="fp64"),
    "top4_groups": dict(router_topk=4, router_num_groups=4, router_group_topk=2, aux_loss_coeff=0.01),
    "capacity_probs": dict(expert_capacity_factor=1.0, token_drop_policy="probs", aux_loss_coeff=0.01),
    "capacity_position": dict(expert_capacity_factor=1.0, token_drop_policy="position"),
    "capacity_pad": dict(expert_capacity_factor=1.0, pad_expert_input_to_capacity=True),
    "shared_gate": dict(shared_expert_intermediate_size=20, shared_expert_gate=True, aux_loss_coeff=0.01,
                        _activation="swiglu"),
    "expert_bias_3_updates": dict(router_score_function="sigmoid", router_enable_expert_bias=True,
                                  router_bias_update_rate=0.05, router_load_balancing_type="none", _steps=4),
}


def _compare(name: str, spec: dict) -> dict:
    from testlib.moe import copy_weights, megatron_layer, megatron_metrics, our_layer, update_megatron_expert_bias

    from megatron_cai.core.transformer.moe.config import MoEConfig

    spec = dict(spec)
    activation = spec.pop("_activation", "gelu_erf")
    bias = spec.pop("_bias", False)
    steps = spec.pop("_steps", 1)
    cfg = MoEConfig(num_experts=8, **spec)
    torch.manual_seed(len(name))
    theirs = megatron_layer(cfg, activation, bias)
    ours = our_layer(cfg, activation, bias)
    for p in theirs.parameters():  # megatron's local init leaves biases at zero: give them values
        torch.nn.init.normal_(p, std=0.3)
    copy_weights(theirs, ours)
    worst = {}
    for step in range(steps):
        x = torch.randn(3, 10, 16)  # [batch, seq, hidden]
        w = torch.randn(3, 10, 16)
        xm = x.transpose(0, 1).contiguous().requires_grad_()
        xo = x.clone().requires_grad_()
        out_m = theirs(xm)[0].transpose(0, 1)
        out_o = ours(xo)
        (out_m * w).sum().backward()
        (out_o * w).sum().backward()
        if step == steps - 1:
            worst["output"] = (out_m - out_o).abs().max().item()
            worst["input_grad"] = (xm.grad.transpose(0, 1) - xo.grad).abs().max().item()
            worst["router_grad"] = (theirs.router.weight.grad - ours.router.weight.grad).abs().max().item()
            fc1 = torch.stack([e.linear_fc1.weight.grad for e in theirs.experts.local_experts])
            worst["fc1_grad"] = (fc1 - ours.experts.fc1_weight.grad).abs().max().item()
            mine = {k: float(v) for k, v in ours.router.metrics.items()}
            theirs_metrics = megatron_metrics()
            worst["metric_names"] = sorted(mine) == sorted(theirs_metrics)
            worst["metrics"] = max([abs(mine[k] - theirs_metrics[k]) for k in mine if k in theirs_metrics] or [0.0])
            worst["metric_count"] = len(mine)
            worst["routed_fraction"] = float(ours.dispatcher.source.numel()) / (30 * cfg.router_topk)
        else:
            megatron_metrics()
        ours.router.metrics.clear()
        if cfg.router_enable_expert_bias:
            update_megatron_expert_bias(theirs)
            ours.router.update_expert_bias()
            worst["bias"] = (theirs.router.expert_bias - ours.router.expert_bias).abs().max().item()
            worst["bias_moved"] = ours.router.expert_bias.abs().max().item()
        for p in (*theirs.parameters(), *ours.parameters()):
            p.grad = None
    return worst


def _worker(rank, world, names):
    from testlib.moe import init_megatron_single_rank

    init_megatron_single_rank()
    return {name: _compare(name, CASES[name]) for name in names}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 1, args=(list(CASES),))[0]


@pytest.mark.parametrize("name", list(CASES))
def test_moe_layer_equals_megatron_core(results, name):
    r = results[name]
    for key in ("output", "input_grad", "router_grad", "fc1_grad", "metrics"):
        assert r[key] < 1e-5, (key, r)
    assert r["metric_names"], r
    spec = CASES[name]
    if spec.get("aux_loss_coeff") or spec.get("z_loss_coeff"):
        assert r["metric_count"] >= 1 + bool(spec.get("z_loss_coeff"))
    if "expert_capacity_factor" in spec and not spec.get("pad_expert_input_to_capacity"):
        assert r["routed_fraction"] < 1.0  # some tokens were dropped: the drop policy mattered
    if spec.get("router_enable_expert_bias"):
        assert r["bias"] < 1e-7 and r["bias_moved"] > 0.1  # three updates of 0.05 moved the bias

"""The top-k router: gate logits, score function, top-k (group-limited, biased, capacity-limited) and the
load-balancing losses, with megatron-core 0.19.2's formulas (``moe_utils`` / ``router.TopKRouter``).

Tokens arrive flattened ``[num_tokens, hidden]`` in Megatron's order (sequence-major: token ``s * b + i``).
The aux losses and the z-loss are not added to the model's output: their gradient is attached to the routing
probabilities (or logits) by :class:`AuxLossAutoScaler`, scaled by the model's :class:`AuxLossGradScale`
(1 / micro-batches, as the main loss), so they reach the router under pipeline parallelism without travelling
to the loss. Their values (divided by their coefficients, as Megatron logs them) accumulate in
``TopKRouter.metrics`` until the training loop reads them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .config import MoEConfig
from .documents import Documents

AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}


@dataclass
class AuxLossGradScale:
    """The gradient that each aux loss receives in backward (the main loss's scale: 1 / micro-batches)."""

    value: float = 1.0


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``output``; in backward, gives ``aux_loss`` the gradient ``scale.value``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: AuxLossGradScale) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale.value
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: float,
                               topk: int, num_experts: int, coeff: float) -> torch.Tensor:
    """Switch Transformer's loss ``E * sum_i f_i * P_i`` (f: routed fraction, P: mean score), times ``coeff``."""
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * (
        num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` (BASE layers' routing)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), dtype=cost.dtype)
    error, d1_old = 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + 1e-8)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + 1e-8)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Top-k among the experts of each token's ``group_topk`` best groups (a group's score: the sum of its
    ``topk / group_topk`` best experts' scores). DeepSeek's device- and node-limited routing."""
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, -1)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)


def capacity_mask(probs: torch.Tensor, routing_map: torch.Tensor, topk: int, factor: float, policy: str):
    """Which (token, expert) pairs fit each expert's capacity ``ceil(tokens * topk / experts * factor)``: the
    highest probabilities (``probs``) or the first tokens (``position``)."""
    tokens, experts = probs.shape
    capacity = math.ceil(tokens * topk / experts * factor)
    if capacity > tokens:
        return torch.ones_like(probs).bool()
    ranked = probs if policy == "probs" else routing_map.int()
    idx = torch.topk(ranked, k=capacity, dim=0, sorted=False)[1]
    return torch.zeros_like(probs).scatter(0, idx, 1).bool()


class TopKRouter(nn.Module):
    def __init__(self, config: MoEConfig, hidden_size: int, grad_scale: AuxLossGradScale, tp_cp_group=None,
                 tp_dp_cp_group=None) -> None:
        super().__init__()
        self.config = config
        self.grad_scale = grad_scale
        self.tp_cp_group, self.tp_dp_cp_group = tp_cp_group, tp_dp_cp_group
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
        if config.router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
            self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_experts), persistent=False)
        else:
            self.expert_bias = self.local_tokens_per_expert = None
        self.global_tokens_per_expert: torch.Tensor | None = None
        self.ga_steps = 0
        self.metrics: dict[str, torch.Tensor] = {}

    # gate ----------------------------------------------------------------------------------------------
    def gating(self, x: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.router_dtype, x.dtype)
        if self.config.router_dtype is None and not torch.is_autocast_enabled(x.device.type):
            return torch.nn.functional.linear(x, self.weight.to(x.dtype))
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype))

    def _jitter(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.config.input_jitter_eps
        if eps is None or not self.training:
            return x
        return x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)

    # top-k ---------------------------------------------------------------------------------------------
    def _topk(self, scores: torch.Tensor):
        c = self.config
        if c.router_group_topk:
            return group_limited_topk(scores, c.router_topk, c.router_num_groups, c.router_group_topk)
        return torch.topk(scores, k=c.router_topk, dim=1, sorted=torch.is_grad_enabled())

    def topk_routing(self, logits: torch.Tensor):
        """(probs, routing_map), both ``[tokens, experts]``: each token's top-k experts and their weights."""
        c, k = self.config, self.config.router_topk
        if c.router_score_function == "softmax":
            if c.router_pre_softmax:
                probs, idx = self._topk(torch.softmax(logits, dim=-1, dtype=torch.float32))
            else:
                top, idx = self._topk(logits)
                probs = torch.softmax(top, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
            if self.expert_bias is not None:
                idx = self._topk(scores + self.expert_bias.float())[1]
                scores = torch.gather(scores, 1, idx)
            else:
                scores, idx = self._topk(scores)
            probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else scores
        if c.router_topk_scaling_factor:
            probs = probs * c.router_topk_scaling_factor
        probs = probs.type_as(logits)
        routing_probs = torch.zeros_like(logits).scatter(1, idx, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, idx, 1).bool()
        return routing_probs, routing_map

    def sinkhorn_routing(self, logits: torch.Tensor):
        k = self.config.router_topk

        def activation(x):
            return torch.sigmoid(x) if k == 1 else torch.softmax(x, dim=-1, dtype=torch.float32).type_as(x)

        if self.training:
            with torch.no_grad():
                idx = torch.topk(sinkhorn(logits.float()), k=k, dim=1)[1]
            logits = activation(logits)
        else:
            logits = activation(logits)
            idx = torch.topk(logits, k=k, dim=1)[1]
        routing_map = torch.zeros_like(logits).int().scatter(1, idx, 1).bool()
        return logits * routing_map, routing_map

    # losses --------------------------------------------------------------------------------------------
    def _record(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self.metrics[name] = self.metrics[name] + value if name in self.metrics else value

    def _attach(self, probs: torch.Tensor, loss: torch.Tensor, name: str) -> torch.Tensor:
        self._record(name, loss / self.config.aux_loss_coeff)
        return AuxLossAutoScaler.apply(probs, loss, self.grad_scale)

    def _aux_scores(self, logits: torch.Tensor):
        if self.config.router_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        idx = torch.topk(scores, k=self.config.router_topk, dim=1)[1]
        return scores, torch.zeros_like(logits).int().scatter(1, idx, 1).bool()

    def document_aux_loss(self, scores: torch.Tensor, routing_map: torch.Tensor, docs: Documents) -> torch.Tensor:
        """``seq_aux_loss`` with each document its own sequence: Switch's loss per document (its tokens'
        routed fractions and mean scores, counts summed over TP x CP), averaged over the documents."""
        c = self.config
        counts = torch.zeros(docs.lengths.numel(), c.num_experts, device=scores.device)
        counts = _all_reduce(counts.index_add_(0, docs.key, routing_map.float()), self.tp_cp_group)
        summed = torch.zeros_like(counts).index_add(0, docs.key, scores.float())
        lengths = docs.lengths.clamp_min(1).float()
        per_doc = (summed * counts).sum(dim=1) * (c.num_experts * c.aux_loss_coeff / c.router_topk) / lengths ** 2
        return per_doc.sum() / docs.count

    def apply_load_balancing_loss(self, probs: torch.Tensor, logits: torch.Tensor, seq_length: int,
                                  sequences: int, docs: Documents | None = None) -> torch.Tensor:
        """Attach the configured aux loss. ``seq_aux_loss`` treats the tokens as ``sequences`` sequences of
        ``seq_length`` tokens each (Megatron's ``[s, b]`` reshape: sequences are the columns), or, given the
        packed rows' ``docs``, each document as its own sequence."""
        c, k = self.config, self.config.router_topk
        kind = c.router_load_balancing_type
        scores, routing_map = self._aux_scores(logits)
        if kind == "seq_aux_loss" and docs is not None:
            return self._attach(probs, self.document_aux_loss(scores, routing_map, docs), AUX_LOSS_NAMES[kind])
        if kind == "seq_aux_loss":
            scores, routing_map = scores.reshape(seq_length, -1), routing_map.reshape(seq_length, -1)
        group = self.tp_dp_cp_group if kind == "global_aux_loss" else self.tp_cp_group
        tokens_per_expert = _all_reduce(routing_map.sum(dim=0), group)
        total = routing_map.shape[0] * _group_size(group)
        if kind == "global_aux_loss":
            self.global_tokens_per_expert = tokens_per_expert.float() + (
                0 if self.global_tokens_per_expert is None else self.global_tokens_per_expert)
            self.ga_steps += 1
            tokens_per_expert = self.global_tokens_per_expert / self.ga_steps
        loss = switch_load_balancing_loss(scores, tokens_per_expert, total, k, c.num_experts, c.aux_loss_coeff)
        if kind == "seq_aux_loss":
            loss = loss / sequences
        return self._attach(probs, loss, AUX_LOSS_NAMES[kind])

    def apply_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.config.z_loss_coeff
        if coeff is None or not self.training or not torch.is_grad_enabled():
            return logits
        coeff = coeff / _group_size(self.tp_cp_group)
        loss = z_loss(logits, coeff)
        self._record("z_loss", loss / coeff)
        return AuxLossAutoScaler.apply(logits, loss, self.grad_scale)

    def reset_global_aux_loss(self) -> None:
        """Start a new global batch for ``global_aux_loss`` (the training loop calls it after each step)."""
        self.global_tokens_per_expert, self.ga_steps = None, 0

    def update_expert_bias(self, group=None) -> None:
        """The aux-loss-free bias step (DeepSeek-V3): each expert's bias moves by the update rate towards the
        mean load, from the tokens counted since the last update summed over ``group`` (TP x DP x CP)."""
        if self.expert_bias is None:
            return
        with torch.no_grad():
            counts = _all_reduce(self.local_tokens_per_expert, group)
            offset = counts.mean() - counts
            self.expert_bias += torch.sign(offset) * self.config.router_bias_update_rate
            self.local_tokens_per_expert.zero_()

    # forward -------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, seq_length: int, sequences: int, docs: Documents | None = None):
        """``x`` ``[tokens, hidden]`` -> (probs, routing_map), ``[tokens, experts]`` each. ``docs``: the packed
        documents of the tokens (``seq_aux_loss`` per document)."""
        c = self.config
        logits = self.apply_z_loss(self.gating(self._jitter(x)))
        if c.router_load_balancing_type == "sinkhorn":
            probs, routing_map = self.sinkhorn_routing(logits)
        else:
            probs, routing_map = self.topk_routing(logits)
        if c.expert_capacity_factor is not None:
            keep = capacity_mask(probs, routing_map, c.router_topk, c.expert_capacity_factor, c.token_drop_policy)
            routing_map = keep if c.pad_expert_input_to_capacity else routing_map & keep
            probs = probs * routing_map
        if self.training and torch.is_grad_enabled() and c.aux_loss_enabled():
            probs = self.apply_load_balancing_loss(probs, logits, seq_length, sequences, docs)
        if self.expert_bias is not None and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

"""The Mixture-of-Experts layer, in a transformer layer's MLP slot: shared experts (if any) on the input, the
router on each token, the dispatcher to the ranks that hold the chosen experts, the experts, and back.

Activations arrive ``[batch, seq, hidden]``; routing works on tokens flattened in megatron-core's order
(sequence-major), so capacity by position and the per-sequence aux loss see the tokens as megatron-core does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ... import parallel_state as ps
from ...tensor_parallel.layers import normal_init, set_param_meta
from .config import MoEConfig
from .documents import Documents, documents
from .experts import GroupedExperts
from .router import AuxLossGradScale, TopKRouter
from .shared_experts import SharedExperts
from .token_dispatcher import AllGatherDispatcher, AllToAllDispatcher


@dataclass
class MoEGroups:
    """The process groups an MoE layer talks over (None: a single rank)."""

    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    ep: object = None
    tp_ep: object = None
    tp_cp: object = None
    tp_dp_cp: object = None

    @classmethod
    def from_parallel_state(cls) -> MoEGroups:
        """This rank's groups; outside a run (the checkpoint converters) one process holds every expert."""
        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
                   ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
                   ps.get_expert_model_parallel_group(), ps.get_expert_tensor_and_model_parallel_group(),
                   ps.get_tensor_and_context_parallel_group(), ps.get_tensor_data_context_parallel_group())


@dataclass
class DenseShape:
    """What the MoE layer takes from the model's config."""

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    activation: str
    add_bias_linear: bool
    init_method_std: float
    sequence_parallel: bool

    @classmethod
    def of(cls, config) -> DenseShape:
        """From a ``GPTConfig``."""
        return cls(config.hidden_size, config.ffn_hidden_size, config.num_layers, config.activation,
                   config.add_bias_linear, config.init_method_std, config.sequence_parallel)


class MoELayer(nn.Module):
    def __init__(self, config: MoEConfig, dense: DenseShape, layer_number: int = 0,
                 groups: MoEGroups | None = None) -> None:
        """``layer_number``: the global (0-based) layer index, under which the aux losses are logged."""
        super().__init__()
        groups = groups or MoEGroups.from_parallel_state()
        self.config, self.layer_number = config, layer_number
        self.sp_rank = ps.get_tensor_model_parallel_rank() if dense.sequence_parallel else 0
        init = normal_init(dense.init_method_std)
        out_init = normal_init(dense.init_method_std / math.sqrt(2.0 * dense.num_layers))
        local = config.num_experts // groups.ep_size
        self.local_experts = range(groups.ep_rank * local, (groups.ep_rank + 1) * local)
        self.router = TopKRouter(config, dense.hidden_size, AuxLossGradScale(), groups.tp_cp, groups.tp_dp_cp)
        set_param_meta(self.router.weight, full_shape=self.router.weight.shape, init_method=init,
                       allreduce_over_tp=dense.sequence_parallel)
        ffn = config.ffn_hidden_size or dense.ffn_hidden_size
        self.experts = GroupedExperts(config.num_experts, self.local_experts, dense.hidden_size, ffn, dense.activation,
                                      dense.add_bias_linear, init, out_init, config.grouped_gemm, groups.etp_rank,
                                      groups.etp_size)
        self.shared_experts = (SharedExperts(dense.hidden_size, config.shared_expert_intermediate_size,
                                             dense.activation, config.shared_expert_gate, init, out_init,
                                             dense.sequence_parallel)
                               if config.shared_expert_intermediate_size else None)
        if config.token_dispatcher_type == "alltoall":
            self.dispatcher = AllToAllDispatcher(config.num_experts, self.local_experts, groups.ep)
        else:
            self.dispatcher = AllGatherDispatcher(config.num_experts, self.local_experts, groups.tp_ep)

    def _documents(self, visibility, local_seq: int) -> Documents | None:
        """The packed documents of this rank's tokens, for ``seq_aux_loss`` (None: one sequence per row)."""
        if self.config.router_load_balancing_type != "seq_aux_loss" or not isinstance(visibility, tuple):
            return None
        start = self.sp_rank * local_seq
        return documents(visibility[1], slice(start, start + local_seq))

    def forward(self, x: torch.Tensor, input_rms=None, visibility=None) -> torch.Tensor:
        """``x`` ``[batch, seq, hidden]`` -> the same shape. ``visibility``: the layer's (start, limit) intervals,
        which delimit the documents of ``seq_aux_loss``. (``input_rms`` is the dense MLP's QAT hint; the
        experts' GEMMs are not quantized.)"""
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        batch, seq, hidden = x.shape
        tokens = x.transpose(0, 1).reshape(-1, hidden)  # megatron's [s, b] order
        probs, routing_map = self.router(tokens, seq_length=seq, sequences=batch,
                                         docs=self._documents(visibility, seq))
        rows, counts, row_probs = self.dispatcher.dispatch(tokens, probs, routing_map)
        out = self.dispatcher.combine(self.experts(rows, counts, row_probs))
        out = out.to(x.dtype).view(seq, batch, hidden).transpose(0, 1)
        return out if shared is None else out + shared

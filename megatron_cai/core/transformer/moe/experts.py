"""The routed experts of one rank: ``E_local`` feed-forward blocks held as stacked weights.

``linear_fc1.weight`` is ``[E_local, fc1_out / ETP, hidden]`` and ``linear_fc2.weight`` ``[E_local, hidden,
ffn / ETP]`` (expert tensor parallelism splits them as column / row parallel linears; the dispatcher's combine
sums the partial outputs). Each row is scaled by its routing probability after the activation, as
megatron-core's expert MLP does (``per_token_scale``).

The GEMMs: without ``--moe-grouped-gemm``, one ``F.linear`` per expert (megatron-core's SequentialMLP); with it,
``torch._grouped_mm`` where the device has it (CUDA, bf16, 16-byte aligned rows), otherwise one batched GEMM
over the tokens padded to the largest expert's count.

Every parameter is marked ``is_expert``: its gradient reduces over the expert-data-parallel group, and its
initialiser draws the full ``[E, ...]`` tensor and keeps this rank's experts and expert-TP slice, so every EP
layout starts from the same weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...tensor_parallel.layers import InitMethod, set_param_meta
from ...tensor_parallel.utils import divide
from ..mlp import relu2


def expert_param(local_shape: tuple[int, ...], global_shape: tuple[int, ...], init: InitMethod,
                 experts: range, etp_rank: int, etp_dim: int | None, etp: int,
                 sections: int = 1) -> nn.Parameter:
    """A stacked expert parameter whose initialiser keeps ``experts`` and this rank's expert-TP slice
    (``sections`` independently split blocks along ``etp_dim``, for swiglu's gate and up)."""

    def init_local(t: torch.Tensor, gen: torch.Generator) -> None:
        full = torch.empty(global_shape)
        init(full, gen)
        full = full[experts.start:experts.stop]
        if etp_dim is not None and etp > 1:
            blocks = full.chunk(sections, dim=etp_dim)
            full = torch.cat([b.chunk(etp, dim=etp_dim)[etp_rank] for b in blocks], dim=etp_dim)
        t.copy_(full)

    param = set_param_meta(nn.Parameter(torch.empty(local_shape)), full_shape=local_shape, init_method=init_local)
    param.is_expert = True
    param.first_expert, param.num_experts = experts.start, global_shape[0]
    param.etp_dim, param.etp_sections = (etp_dim if etp > 1 else None), sections
    param.expert_global_shape = tuple(global_shape)
    return param


def grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and x.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts``) times each expert's ``w[e].T``."""
    if not grouped:
        return torch.cat([F.linear(xe, we) for xe, we in zip(torch.split(x, counts), w)], dim=0)
    wt = w.to(x.dtype).transpose(1, 2)
    if grouped_mm_available(x, wt):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, wt, offs=offsets)
    width = max(counts) if counts else 0
    slot = torch.cat([torch.arange(c, device=x.device) + e * width for e, c in enumerate(counts)])
    padded = x.new_zeros((len(counts) * width, x.shape[1])).index_copy(0, slot, x)
    out = torch.bmm(padded.view(len(counts), width, -1), wt)
    return out.reshape(len(counts) * width, -1).index_select(0, slot)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, experts: range, hidden_size: int, ffn_hidden_size: int, activation: str,
                 bias: bool, init_method: InitMethod, output_init_method: InitMethod, grouped_gemm: bool,
                 etp_rank: int = 0, etp: int = 1) -> None:
        super().__init__()
        self.activation, self.grouped_gemm = activation, grouped_gemm
        self.etp_rank = etp_rank
        gated = activation == "swiglu"
        fc1_out = (2 if gated else 1) * ffn_hidden_size
        local_e, ffn_local = len(experts), divide(ffn_hidden_size, etp, "moe ffn hidden size")
        local_fc1 = (2 if gated else 1) * ffn_local
        sections = 2 if gated else 1
        self.fc1_weight = expert_param((local_e, local_fc1, hidden_size), (num_experts, fc1_out, hidden_size),
                                       init_method, experts, etp_rank, 1, etp, sections)
        self.fc2_weight = expert_param((local_e, hidden_size, ffn_local), (num_experts, hidden_size, ffn_hidden_size),
                                       output_init_method, experts, etp_rank, 2, etp)
        zeros = lambda t, g: t.zero_()  # noqa: E731 - biases start at zero
        self.fc1_bias = (expert_param((local_e, local_fc1), (num_experts, fc1_out), zeros, experts, etp_rank, 1, etp,
                                      sections) if bias else None)
        self.fc2_bias = expert_param((local_e, hidden_size), (num_experts, hidden_size), zeros, experts, 0, None,
                                     1) if bias else None

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        if self.activation == "relu2":
            return relu2(h)
        return F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    @staticmethod
    def _per_row(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return bias.repeat_interleave(torch.tensor(counts, device=bias.device), dim=0)

    def forward(self, rows: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        h = grouped_linear(rows, self.fc1_weight, counts, self.grouped_gemm)
        if self.fc1_bias is not None:
            h = h + self._per_row(self.fc1_bias, counts)
        h = self._act(h)
        h = (h * probs.unsqueeze(-1)).to(h.dtype)
        out = grouped_linear(h, self.fc2_weight, counts, self.grouped_gemm)
        if self.fc2_bias is not None and self.etp_rank == 0:  # partial sums over expert TP: add it once
            out = out + self._per_row(self.fc2_bias, counts) * probs.unsqueeze(-1)
        return out

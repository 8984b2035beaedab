"""The training loop's side of the MoE layers: the aux losses' gradient scale, their logged values, the
expert-bias update and the global aux loss's reset, once per iteration.

The logged values follow megatron-core's ``MoEMetricsTracker``: each router's values (aux loss / coefficient,
summed over micro-batches) are summed over pipeline stages, summed over TP x CP for the load-balancing losses
(each rank holds a part of the sum) or averaged over TP x DP x CP for the z-loss, scaled by 1 / micro-batches,
and averaged over the MoE layers. They join the step's loss statistics (``load_balancing_loss``, ``z_loss``,
...), so they are averaged over DP, read back with the losses in the step's one read, printed on the log
line and written to TensorBoard under the same names as in Megatron-LM; with ``--moe-per-layer-logging`` each
layer's value is also written as ``moe/{name}_layer_{i}``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...core import parallel_state as ps
from ...core.transformer.moe.config import MoEConfig
from ...core.transformer.moe.moe_layer import MoELayer
from ...core.transformer.moe.router import AUX_LOSS_NAMES


def metric_names(config: MoEConfig) -> list[str]:
    names = [AUX_LOSS_NAMES[config.router_load_balancing_type]] if config.aux_loss_enabled() else []
    return names + (["z_loss"] if config.z_loss_coeff is not None else [])


class MoEMetrics:
    def __init__(self, model_chunks: list, config: MoEConfig | None, num_layers: int, device: torch.device) -> None:
        self.layers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, MoELayer)]
        self.names = metric_names(config) if config is not None else []
        self.num_layers, self.device = num_layers, device
        self.num_moe_layers = sum(config.is_moe_layer(i + 1) for i in range(num_layers)) if config else 0
        self.per_layer: torch.Tensor | None = None

    def before_schedule(self, loss_scale: float, num_microbatches: int) -> None:
        """Each aux loss's gradient: the main loss's (the fp16 loss scale / micro-batches), times the CP size as
        the main loss (each CP rank's aux loss is a part of the sequence's, and gradients average over CP)."""
        for layer in self.layers:
            layer.router.grad_scale.value = loss_scale * ps.get_context_parallel_world_size() / num_microbatches

    def add_to_stats(self, stats: list[dict], num_microbatches: int) -> list[dict]:
        """The MoE values reduced as Megatron's tracker does, added to each micro-batch's statistics."""
        if not self.names:
            return stats
        values = torch.zeros(len(self.names), self.num_layers, device=self.device)
        for layer in self.layers:
            for i, name in enumerate(self.names):
                if name in layer.router.metrics:
                    values[i, layer.layer_number] = layer.router.metrics[name].to(self.device)
            layer.router.metrics.clear()
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
        for i, name in enumerate(self.names):
            group = ps.get_tensor_data_context_parallel_group() if name == "z_loss" else \
                ps.get_tensor_and_context_parallel_group()
            if group is not None and dist.get_world_size(group) > 1:
                row = values[i].contiguous()
                dist.all_reduce(row, group=group)
                values[i] = row / dist.get_world_size(group) if name == "z_loss" else row
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(values, group=ps.get_data_parallel_group())
            values /= ps.get_data_parallel_world_size()
        self.per_layer = values / num_microbatches
        means = self.per_layer.sum(dim=1) / max(self.num_moe_layers, 1)
        return [{**s, **{name: means[i] for i, name in enumerate(self.names)}} for s in stats]

    def per_layer_scalars(self) -> dict[str, float]:
        """``moe/{name}_layer_{i}`` for the last step (one host read; only with --moe-per-layer-logging)."""
        if self.per_layer is None:
            return {}
        rows = self.per_layer.tolist()
        return {f"moe/{name}_layer_{i}": v for name, row in zip(self.names, rows) for i, v in enumerate(row)}

    def after_step(self) -> None:
        """Megatron's finalize-step work: the expert bias moves, the global aux loss starts a new batch."""
        for layer in self.layers:
            layer.router.update_expert_bias(ps.get_tensor_data_context_parallel_group())
            layer.router.reset_global_aux_loss()

"""AdamW over FSDP2's parameter shards (``--use-torch-fsdp2``).

``torch.optim.AdamW(fused=True)`` updates the local DTensor shards; no weight decay on 1-D parameters
(as Megatron). The global grad norm, clipping and non-finite check are the DDP path's
(``clip_grads.GlobalNormClipping``), over this rank's shards of the gradients that
``FullyShardedChunk.counted_in_norm`` counts.
"""
from __future__ import annotations

import torch
from torch import nn

from ..distributed.fsdp import FullyShardedChunk, local
from .clip_grads import GlobalNormClipping
from .config import OptimizerConfig, applies_weight_decay, group_lrs


class FullyShardedAdamW(GlobalNormClipping):
    """``torch.optim.AdamW`` over the FSDP2 shards of ``chunks``."""

    def __init__(self, chunks: list[FullyShardedChunk], config: OptimizerConfig) -> None:
        self.model_chunks = chunks
        self.grad_scaler = None  # set by the trainer with --fp16; its state is saved with the optimizer's
        self.config = config
        groups: dict[tuple[bool, str], list[nn.Parameter]] = {}  # (decay, lr kind) -> parameters
        self.counted: list[nn.Parameter] = []
        for c in chunks:
            for name, p in c.module.named_parameters():
                kind = config.lr_kind(name, len(p.shape))  # --decoupled-lr, --use-mup (OptimizerConfig.lr_kind)
                decay = applies_weight_decay(name, c.meta[name].decay, config.apply_wd_to_qk_layernorm)
                groups.setdefault((decay, kind), []).append(p)
                if c.counted_in_norm(name):
                    self.counted.append(p)
        # PyTorch's fused kernel over the local shards (one pass, no per-step host read of the step counts)
        self.optimizer = torch.optim.AdamW(
            [{"params": ps, "weight_decay": config.weight_decay if decay else 0.0, "kind": kind,
              "eps": config.eps_of(kind)}
             for (decay, kind), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))],
            lr=config.lr, betas=config.betas, eps=config.adam_eps, fused=True)
        self.all_params = [p for g in self.optimizer.param_groups for p in g["params"]]

    def owned_grads(self):
        return (local(p.grad) for p in self.all_params if p.grad is not None)

    def norm_grads(self):
        return (local(p.grad) for p in self.counted if p.grad is not None)

    def moment_tensors(self):
        """torch.optim.AdamW's moments of this rank's shards (none before the first step)."""
        return (local(state[k]) for p in self.all_params if (state := self.optimizer.state.get(p))
                for k in ("exp_avg", "exp_avg_sq") if k in state)

    def norm_params(self):
        return (local(p) for p in self.counted)

    def grad_device(self) -> torch.device:
        return local(self.all_params[0]).device

    @torch.no_grad()
    def step(self, lr: float | None = None, decoupled_lr: float | None = None, mup_lr: float | None = None) -> None:
        """One AdamW step at `lr`; the embedding and output layer at `decoupled_lr` when given (--decoupled-lr),
        the MuP group at `mup_lr` (config.group_lrs)."""
        if lr is not None:
            lrs = group_lrs(self.config, lr, decoupled_lr, mup_lr)
            for g in self.optimizer.param_groups:
                g["lr"] = lrs[g["kind"]]
        self.optimizer.step()

    def finish_param_sync(self) -> None:
        """Nothing pending: FSDP2 all-gathers the parameter shards itself in each forward."""
        return None

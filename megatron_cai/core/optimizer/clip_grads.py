"""The global gradient norm, clipping and the non-finite check, shared by both optimizers, and the
contract the Trainer, the divergence check and the checkpoint savers rely on (:class:`GlobalNormClipping`
is the base of ``DistributedAdamW`` and ``FullyShardedAdamW``: no attribute of theirs is probed).

Each optimizer says which gradient tensors it owns (:meth:`GlobalNormClipping.owned_grads`: what it
updates, and what clipping and ``--fp16``'s unscaling multiply) and which count in the global norm
(:meth:`GlobalNormClipping.norm_grads`: each distinct gradient element once over all TP / PP / DP
ranks). The norm is one fp64 sum of squares, all-reduced over the world (over one island with DiLoCo's
islands: each island is its own inner-loop job); the training loop reads it back
with the rest of its step decisions (``training/step_readback.py``), once per iteration.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .. import parallel_state as ps
from .grad_scaler import ConstantGradScaler


class GlobalNormClipping(ABC):
    """``grad_norm``, ``clip_and_check``, ``scale_grads`` and ``unscale_and_check`` over the gradients an
    optimizer owns."""

    grad_scaler: ConstantGradScaler | None = None  # --fp16's loss scaler, set by the trainer
    # Whether ``state_dict()``'s tensors are private to the caller (an asynchronous save then stages no copy).
    state_dict_copies: bool = False

    @abstractmethod
    def moment_tensors(self) -> Iterable[torch.Tensor]:
        """This rank's optimizer state (Adam's first and second moments), checked finite before a save."""

    @abstractmethod
    def owned_grads(self) -> Iterable[torch.Tensor]:
        """Every gradient tensor this rank updates (views into its gradient storage)."""

    @abstractmethod
    def norm_grads(self) -> Iterable[torch.Tensor]:
        """The gradient tensors this rank counts in the global norm."""

    @abstractmethod
    def norm_params(self) -> Iterable[torch.Tensor]:
        """The parameter tensors counted in the norm (local shards, each distinct element once)."""

    @abstractmethod
    def grad_device(self) -> torch.device:
        """Where the gradients live (the norm is summed there)."""

    def scaler_state(self) -> dict:
        """``{"grad_scaler": ...}`` with --fp16 (saved with the optimizer state, as in Megatron), else ``{}``."""
        return {} if self.grad_scaler is None else {"grad_scaler": self.grad_scaler.state_dict()}

    def load_scaler_state(self, state: dict) -> None:
        """Restore :meth:`scaler_state`'s part of a saved optimizer state (a run without --fp16 ignores it)."""
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])

    def _global_sum(self, tensors: Iterable[torch.Tensor], fn) -> float:
        total = torch.zeros((), dtype=torch.float64, device=self.grad_device())
        for t in tensors:
            total += fn(t.reshape(-1))
        if ps.get_island_world_size() > 1:
            dist.all_reduce(total, group=ps.get_island_group())
        return total.item()

    @torch.no_grad()
    def params_norm(self) -> float:
        """Global L2 norm of the parameters, each distinct element once (--log-params-norm; collective)."""
        return math.sqrt(self._global_sum(self.norm_params(), lambda p: torch.dot(p.float(), p.float()).double()))

    @torch.no_grad()
    def num_zeros_in_grad(self) -> int:
        """Zero gradient elements over the distinct parameters (--log-num-zeros-in-grad; collective)."""
        return int(self._global_sum(self.norm_grads(), lambda g: (g == 0).sum().double()))

    def local_norm_sq(self) -> torch.Tensor:
        """This rank's share of the squared global norm: an fp64 device scalar, not reduced, not read."""
        total = torch.zeros((), dtype=torch.float64, device=self.grad_device())
        for g in self.norm_grads():
            g = g.float().reshape(-1)
            total += torch.dot(g, g).double()
        return total

    def grad_norm(self) -> float:
        """Global L2 norm of the DP-mean gradient over all TP/PP/DP ranks of the island (nan when non-finite).

        Reads the device (the training loop folds :meth:`local_norm_sq` into its one read-back instead)."""
        total = self.local_norm_sq()
        if ps.get_island_world_size() > 1:
            dist.all_reduce(total, group=ps.get_island_group())
        value = total.item()
        return math.sqrt(value) if math.isfinite(value) else float("nan")

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiply the owned gradients by `factor` (clipping; --fp16's unscaling is :meth:`unscale_and_check`)."""
        for g in self.owned_grads():
            g.mul_(factor)

    @torch.no_grad()
    def unscale_and_check(self, inv_scale: float) -> torch.Tensor:
        """--fp16: multiply every owned gradient by ``inv_scale`` and flag a non-finite element among them, in one
        pass: PyTorch's AMP kernel (the one ``torch.amp.GradScaler`` runs), here on the local tensors (FSDP2: this
        rank's shards). Covers what the norm does not count (TP-replicated copies, HSDP's other nodes). Returns a
        device scalar, 1 when found; not reduced, not read (the step's read-back sums it over the world, or over the
        island with DiLoCo)."""
        device = self.grad_device()
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in self.owned_grads():
            by_dtype.setdefault(g.dtype, []).append(g)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
        return found_inf[0]

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale the gradients, whose global norm is the finite ``norm``, to ``max_norm`` (0: no clipping)."""
        if max_norm > 0:
            coeff = max_norm / (norm + 1e-6)
            if coeff < 1.0:
                self.scale_grads(coeff)

    def clip_and_check(self, max_norm: float) -> tuple[float, bool]:
        """Compute the grad norm; scale grads to `max_norm` (0 = no clipping). Returns (norm, finite)."""
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return norm, False
        self.clip(norm, max_norm)
        return norm, True

"""Divergence policy: skip non-finite steps, stop a diverged run, never checkpoint a broken state.

- With ``--check-for-nan-in-loss-and-grad`` (on by default, as in Megatron-LM) an iteration whose loss
  or gradient is not finite on any rank skips its optimizer step on every rank.
- ``--max-consecutive-skipped-iterations N`` (default 10; 0 = no bound): after N skipped iterations in
  a row the job stops with a ``DivergenceError`` naming the iteration, the last finite loss and the
  last good checkpoint (printed as one ``error:`` line, exit status 2).
- A save is refused (with a warning) while the last iteration was skipped, or when any parameter or
  Adam state holds a non-finite value, so the tracker stays on the last good checkpoint.
- ``--rerun-mode`` (Megatron's rerun state machine, ``features/rerun.py``) re-runs iterations whose validated
  results are rejected (by error injection, or ``--check-for-large-grads``); it leaves real non-finite values to
  the policy above.
- ``--check-for-spiky-loss``: a finite loss above ``--spiky-loss-factor`` x the running median of the
  last ``--spiky-loss-window`` finite losses is logged and counted (training goes on).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..core.distributed.contracts import ModelChunk
from ..core.optimizer.clip_grads import GlobalNormClipping
from .errors import UserError
from .features.rerun import RerunConfig
from .flags import rerun as rerun_flags


class DivergenceError(UserError, RuntimeError):
    """The run diverged (too many consecutive non-finite iterations); the message says where and what is kept."""


@dataclass(frozen=True)
class DivergenceConfig:
    check_for_nan_in_loss_and_grad: bool = True
    max_consecutive_skipped_iterations: int = 10
    check_for_spiky_loss: bool = False
    spiky_loss_factor: float = 10.0
    spiky_loss_window: int = 100
    rerun: RerunConfig = RerunConfig()  # Megatron's rerun state machine (features/rerun.py)

    def __post_init__(self) -> None:
        if self.max_consecutive_skipped_iterations < 0:
            raise ValueError("--max-consecutive-skipped-iterations must be >= 0 (0: no bound)")
        if self.spiky_loss_factor <= 1.0:
            raise ValueError(f"--spiky-loss-factor must be > 1, got {self.spiky_loss_factor}")
        if self.spiky_loss_window < 1:
            raise ValueError(f"--spiky-loss-window must be >= 1, got {self.spiky_loss_window}")

    @classmethod
    def from_args(cls, args) -> DivergenceConfig:
        """The policy from pretrain_gpt's flags (``add_arguments``)."""
        return cls(check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
                   max_consecutive_skipped_iterations=args.max_consecutive_skipped_iterations,
                   check_for_spiky_loss=args.check_for_spiky_loss, spiky_loss_factor=args.spiky_loss_factor,
                   spiky_loss_window=args.spiky_loss_window, rerun=rerun_flags.rerun_config(args))


def add_arguments(parser) -> None:
    """The divergence flags (Megatron-LM's ``--check-for-nan-in-loss-and-grad`` is on by default)."""
    g = parser.add_argument_group("divergence")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   default=True, help="skip the step when the loss or gradient is not finite on any rank, and "
                                      "stop after --max-consecutive-skipped-iterations such steps in a row")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=10,
                   help="exit (status 2) after this many consecutive non-finite iterations; 0: never")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="log and count losses above --spiky-loss-factor x the running median")
    g.add_argument("--spiky-loss-factor", type=float, default=10.0)
    g.add_argument("--spiky-loss-window", type=int, default=100, help="finite losses in the running median")
    rerun_flags.add_arguments(parser)


def all_ranks_true(local: bool, device: torch.device) -> bool:
    """True when ``local`` is true on every rank (one scalar all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    flag = torch.tensor([1.0 if local else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def all_finite(tensors: list[torch.Tensor], device: torch.device) -> bool:
    """Whether every element of this rank's ``tensors`` is finite, with one host sync (not one per tensor).
    A DTensor is checked on its local shard: the caller's all-reduce covers the other ranks' shards."""
    flags = [torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all().to(device) for t in tensors]
    return bool(torch.stack(flags).all()) if flags else True


def state_finite(model_chunks: list[ModelChunk], optimizer: GlobalNormClipping | None, device: torch.device) -> bool:
    """Collective: whether all parameters and all optimizer state (DDP's or FSDP2's) on every rank are finite."""
    tensors = [p.detach() for m in model_chunks for p in m.module.parameters()]
    if optimizer is not None:
        tensors += list(optimizer.moment_tensors())
    return all_ranks_true(all_finite(tensors, device), device)


class DivergenceMonitor:
    """Counts consecutive skipped iterations and loss spikes; knows the last good checkpoint."""

    def __init__(self, cfg: DivergenceConfig, device: torch.device, last_good_checkpoint: str | None = None) -> None:
        self.cfg = cfg
        self.device = device
        self.consecutive_skipped = 0
        self.last_finite: tuple[int, float] | None = None  # (iteration, loss) on the last pipeline stage
        self.last_good_checkpoint = last_good_checkpoint
        self.spikes = 0
        self._recent: deque[float] = deque(maxlen=cfg.spiky_loss_window)

    def observe(self, iteration: int, losses: dict[str, float], skipped: bool) -> str | None:
        """Record one iteration; returns a log line for a loss spike. Raises DivergenceError at the bound.

        Every rank calls it with the same ``skipped`` (the decision is global), so the collective in the
        error path is reached by all ranks.
        """
        if skipped:
            self.consecutive_skipped += 1
            bound = self.cfg.max_consecutive_skipped_iterations
            if self.cfg.check_for_nan_in_loss_and_grad and bound and self.consecutive_skipped >= bound:
                raise DivergenceError(self._diverged_message(iteration))
            return None
        self.consecutive_skipped = 0
        loss = losses.get("lm loss")
        if loss is None or not math.isfinite(loss):
            return None
        line = None
        if self.cfg.check_for_spiky_loss and len(self._recent) >= min(10, self.cfg.spiky_loss_window):
            median = statistics.median(self._recent)
            if median > 0 and loss > self.cfg.spiky_loss_factor * median:
                self.spikes += 1
                line = (f" iteration {iteration}: loss spike: lm loss {loss:.6E} > {self.cfg.spiky_loss_factor:g} x "
                        f"running median {median:.6E} (loss spikes so far: {self.spikes})")
        self._recent.append(loss)
        self.last_finite = (iteration, loss)
        return line

    def _shared_last_finite(self) -> tuple[int, float] | None:
        """The last finite (iteration, loss), known on the last pipeline stage, made known to every rank."""
        it, loss = self.last_finite if self.last_finite is not None else (-1, float("-inf"))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([float(it), loss], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            it, loss = int(t[0].item()), t[1].item()
        return (it, loss) if it >= 0 else None

    def _diverged_message(self, iteration: int) -> str:
        last = self._shared_last_finite()
        last_txt = f"last finite lm loss {last[1]:.6E} at iteration {last[0]}" if last else "no finite loss yet"
        ckpt = self.last_good_checkpoint or "none (nothing was saved)"
        return (f"training diverged at iteration {iteration}: {self.consecutive_skipped} consecutive iterations "
                f"with a non-finite loss or gradient (--max-consecutive-skipped-iterations "
                f"{self.cfg.max_consecutive_skipped_iterations}); {last_txt}; last good checkpoint: {ckpt}")

    def state_dict(self) -> dict:
        """Saved with the checkpoint's counters: the last finite loss survives a resume."""
        return {"last_finite_loss": list(self.last_finite) if self.last_finite is not None else None,
                "loss_spikes": self.spikes}

    def load_state_dict(self, counters: dict) -> None:
        last = counters.get("last_finite_loss")
        self.last_finite = (int(last[0]), float(last[1])) if last else None
        self.spikes = int(counters.get("loss_spikes") or 0)

    def refuse_save(self, model_chunks: list[ModelChunk], optimizer: GlobalNormClipping | None) -> str | None:
        """Collective: why the current state must not be saved, or None when it may be."""
        if self.consecutive_skipped > 0:
            return f"the last {self.consecutive_skipped} iteration(s) had a non-finite loss or gradient"
        if not state_finite(model_chunks, optimizer, self.device):
            return "parameters or optimizer state hold non-finite values"
        return None

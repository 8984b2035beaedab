"""DiLoCo's outer loop over one island's flat weights: fragments, the outer optimizer, the overlapped all-reduce.

Per fragment ``f`` (a contiguous range of the island's flat fp32 weights; K fragments of about equal size)::

    after inner step t with t % H == offset(f):           # send
        delta = anchor_f - local_f                        # the pseudo-gradient (this rank's slice)
        start  average(delta) over the islands            # in the background when overlap_steps > 0
    after inner step t + overlap_steps:                   # apply
        anchor_f <- SGD(anchor_f, grad=mean delta, lr=outer_lr, momentum, nesterov)   (torch.optim.SGD)
        local_f  <- local_weight * local_f + (1 - local_weight) * anchor_f

Each island is an ordinary TP x PP x CP x DP job whose DP x CP ranks hold the same weights: each of them
owns one slice (1 / (DP x CP)) of every fragment, averages only that slice with the ranks at its position in
the other islands (the ``outer`` group), steps its slice of the anchor and momentum, and all-gathers the new
anchor inside the island. The slow link carries each element once per island.

After the last training iteration, :meth:`DilocoOuter.average_islands` makes the islands one model: the updates
in flight land, then every fragment takes one more outer step with learning rate 1 and no momentum, so that
every island's weights become the islands' mean (through the same wire format and error feedback). DiLoCo's
model is the islands' consensus, not one island's last local steps.

The background all-reduce runs on one worker thread (collectives on the ``outer`` group only, in schedule
order on every rank), so it overlaps the inner steps; its wall time is the link-busy time. A failed
collective stops the run with :class:`IslandLostError` naming the island that stopped answering.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..distributed.squinch_feedback import SquinchFeedback
from .config import DilocoConfig
from .outer_reduce import OuterReduce


class IslandLostError(RuntimeError):
    """An island stopped answering during the outer all-reduce; the message names it."""


@dataclass(frozen=True)
class IslandGroups:
    """Where this rank sits: its island, the outer group across islands, its slice group inside the island."""

    islands: int = 1
    island: int = 0
    outer_group: object = None      # None with one island
    slice_group: object = None      # the island's DP x CP group (None: one rank)
    slice_rank: int = 0
    slice_world: int = 1


@dataclass
class OuterStats:
    """Counters for the log: outer steps applied, bytes sent, seconds the link was busy (the outer all-reduce's
    wall time), seconds the inner loop waited for the outer loop (sends, late all-reduces, updates), outer
    steps skipped (a non-finite mean pseudo-gradient)."""

    outer_steps: int = 0
    bytes_sent: int = 0
    link_busy_s: float = 0.0
    wait_s: float = 0.0
    skipped: int = 0
    final_averages: int = 0


class FlatWeights:
    """The island's weights as one flat index space over several fp32 buffers (one per model chunk)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.starts = [0]
        for b in buffers:
            self.starts.append(self.starts[-1] + b.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def _pieces(self, lo: int, hi: int):
        for b, s in zip(self.buffers, self.starts):
            a, e = max(lo, s), min(hi, s + b.numel())
            if a < e:
                yield b.view(-1)[a - s:e - s], a - lo, e - lo

    def read(self, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.float32, device=self.buffers[0].device)
        for piece, a, e in self._pieces(lo, hi):
            out[a:e] = piece
        return out

    def write(self, lo: int, hi: int, values: torch.Tensor) -> None:
        for piece, a, e in self._pieces(lo, hi):
            piece.copy_(values[a:e])


class Fragment:
    """One fragment: its range, this rank's slice of it, the anchor slice and its outer optimizer."""

    def __init__(self, index: int, lo: int, hi: int, groups: IslandGroups, config: DilocoConfig,
                 weights: FlatWeights) -> None:
        self.index, self.lo, self.hi = index, lo, hi
        self.slice_size = -(-(hi - lo) // groups.slice_world)
        a = min(lo + groups.slice_rank * self.slice_size, hi)
        self.slice_lo, self.slice_hi = a, min(a + self.slice_size, hi)
        self.anchor = torch.zeros(self.slice_size, dtype=torch.float32, device=weights.buffers[0].device)
        self.anchor[:self.slice_hi - self.slice_lo] = weights.read(self.slice_lo, self.slice_hi)
        momentum = config.outer_momentum
        self.optimizer = torch.optim.SGD([self.anchor], lr=config.outer_lr, momentum=momentum,
                                         nesterov=momentum > 0, foreach=False)

    def pseudo_gradient(self, weights: FlatWeights) -> torch.Tensor:
        delta = self.anchor.clone()
        delta[:self.slice_hi - self.slice_lo] -= weights.read(self.slice_lo, self.slice_hi)
        return delta


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """``fragments`` contiguous ranges of about equal size covering ``[0, numel)``."""
    cuts = [numel * k // fragments for k in range(fragments + 1)]
    return list(zip(cuts, cuts[1:]))


class DilocoOuter:
    """The outer loop of one rank: call :meth:`after_inner_step` after every inner step."""

    def __init__(self, config: DilocoConfig, weights: FlatWeights, groups: IslandGroups,
                 lost_island: Callable[[], str] | None = None) -> None:
        self.config, self.weights, self.groups = config, weights, groups
        self.lost_island = lost_island or self._other_islands
        self.feedback = SquinchFeedback(error_feedback=config.error_feedback)
        self.reduce = OuterReduce(config.outer_bits, groups.outer_group, groups.islands, self.feedback)
        self.fragments = [Fragment(i, lo, hi, groups, config, weights)
                          for i, (lo, hi) in enumerate(fragment_bounds(weights.numel, config.fragments))]
        self.pending: dict[int, tuple[int, Future]] = {}  # fragment -> (apply iteration, mean pseudo-gradient)
        self.stats = OuterStats()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="diloco-outer") if config.overlap_steps else None

    # ------------------------------------------------------------------------------------ schedule
    def after_inner_step(self, iteration: int) -> None:
        """``iteration``: inner steps done. Applies the outer updates due now, then sends the fragments due."""
        start = time.perf_counter()
        self._due(iteration)
        self.stats.wait_s += time.perf_counter() - start

    def _due(self, iteration: int) -> None:
        for f in [f for f, (at, _) in self.pending.items() if at == iteration]:
            self._apply(self.fragments[f])
        H = self.config.inner_steps
        for frag in self.fragments:
            if iteration > 0 and iteration % H == self.config.send_offset(frag.index):
                self._send(frag, iteration)

    def _send(self, frag: Fragment, iteration: int) -> None:
        delta = frag.pseudo_gradient(self.weights)
        if self._worker is None:
            future: Future = Future()
            future.set_result(self._average(delta, frag.index))
        else:
            future = self._worker.submit(self._average, delta, frag.index)
        self.pending[frag.index] = (iteration + self.config.overlap_steps, future)
        if not self.config.overlap_steps:
            self._apply(frag)

    def _average(self, delta: torch.Tensor, fragment: int) -> torch.Tensor:
        start = time.perf_counter()
        try:
            self.stats.bytes_sent += self.reduce.average(delta, f"f{fragment}")
        except RuntimeError as e:
            raise IslandLostError(f"the outer all-reduce of fragment {fragment} failed on island "
                                  f"{self.groups.island}: {self.lost_island()} ({str(e).splitlines()[0][:160]}); "
                                  f"resume from the last checkpoint") from e
        self.stats.link_busy_s += time.perf_counter() - start
        return delta

    def _apply(self, frag: Fragment) -> None:
        _, future = self.pending.pop(frag.index)
        mean = future.result()
        if self._skipped(mean):
            mean = torch.zeros_like(mean)
        else:
            frag.anchor.grad = mean
            frag.optimizer.step()
            frag.anchor.grad = None
            self.stats.outer_steps += 1
        full = self._gather_anchor(frag)
        w = self.config.local_weight
        if w:
            full = w * self.weights.read(frag.lo, frag.hi) + (1 - w) * full
        self.weights.write(frag.lo, frag.hi, full)

    def _skipped(self, mean: torch.Tensor) -> bool:
        """A non-finite mean pseudo-gradient: counted, the residuals zeroed. Every rank sees the same mean, so
        every rank skips alike."""
        if bool(torch.isfinite(mean).all()):
            return False
        self.stats.skipped += 1
        self.feedback.reset()
        return True

    def _gather_anchor(self, frag: Fragment) -> torch.Tensor:
        g = self.groups
        if g.slice_world == 1:
            return frag.anchor[:frag.hi - frag.lo]
        full = torch.empty(g.slice_world * frag.slice_size, dtype=torch.float32, device=frag.anchor.device)
        dist.all_gather_into_tensor(full, frag.anchor, group=g.slice_group)
        return full[:frag.hi - frag.lo]

    def _other_islands(self) -> str:
        others = [i for i in range(self.groups.islands) if i != self.groups.island]
        return f"island {others[0]} stopped answering" if len(others) == 1 else \
            f"one of islands {', '.join(map(str, others))} stopped answering"

    def average_islands(self) -> None:
        """The end of training: the updates in flight land, then every island's weights become the islands'
        mean (one outer step per fragment with learning rate 1 and no momentum; the momentum is kept)."""
        start = time.perf_counter()
        for f in sorted(self.pending):
            self._apply(self.fragments[f])
        for frag in self.fragments:
            mean = self._average(frag.pseudo_gradient(self.weights), frag.index)
            if self._skipped(mean):  # every island keeps its own weights of this fragment
                continue
            with torch.no_grad():
                frag.anchor.sub_(mean)
            self.weights.write(frag.lo, frag.hi, self._gather_anchor(frag))
        self.stats.final_averages += 1
        self.stats.wait_s += time.perf_counter() - start

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    # --------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Anchors, outer momentum, error feedback, in-flight results (waited for) and counters.

        The in-flight all-reduces are waited for first: they update the error feedback and the counters in their
        thread, so reading those before would save whatever that thread had reached (a resume then differs)."""
        pending = {f: (at, fut.result().cpu().clone()) for f, (at, fut) in self.pending.items()}
        return {
            "anchors": [f.anchor.detach().cpu().clone() for f in self.fragments],
            "outer_optimizers": [f.optimizer.state_dict() for f in self.fragments],
            "feedback": self.feedback.state_dict(),
            "pending": pending,
            "stats": dict(vars(self.stats)),
            "schedule": {"inner_steps": self.config.inner_steps, "fragments": self.config.fragments,
                         "overlap_steps": self.config.overlap_steps,
                         "bounds": [(f.lo, f.hi, f.slice_lo, f.slice_hi) for f in self.fragments]},
        }

    def load_state_dict(self, state: dict) -> None:
        here = [(f.lo, f.hi, f.slice_lo, f.slice_hi) for f in self.fragments]
        saved = [tuple(b) for b in state["schedule"]["bounds"]]
        if saved != here or state["schedule"]["overlap_steps"] != self.config.overlap_steps:
            raise ValueError(f"the DiLoCo state was saved with fragments {saved} and overlap "
                             f"{state['schedule']['overlap_steps']}; this run has {here} and "
                             f"{self.config.overlap_steps}")
        for frag, anchor, opt in zip(self.fragments, state["anchors"], state["outer_optimizers"]):
            frag.anchor.copy_(anchor)
            frag.optimizer.load_state_dict(opt)
        self.feedback.load_state_dict(state["feedback"])
        self.feedback.attach(self.fragments[0].anchor.device)
        self.pending = {}
        for f, (at, mean) in state["pending"].items():
            future: Future = Future()
            future.set_result(mean.to(self.fragments[0].anchor.device))
            self.pending[int(f)] = (int(at), future)
        self.stats = OuterStats(**state["stats"])

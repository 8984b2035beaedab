"""The training loop's seam to DiLoCo (core/diloco, docs/diloco.md): build the outer loop over the model's flat
parameter buffers, run it after every inner step, log it, and carry its state in the checkpoint.

The Trainer calls::

    state = DilocoCheckpoint.for_config(config.diloco)    # None when DiLoCo is off; a per-rank checkpoint member
    ... checkpointer.load(reducers + [state]) ...
    seam = DilocoSeam.build(config.diloco, model_chunks, optimizer, state)   # on the loaded weights
    seam.after_step(iteration, last)      # after the inner optimizer step (last: the run's last iteration)
    seam.log_line(iteration)              # the outer steps since the last line, for the log, or None

The checkpoint member holds the outer state (anchors, outer momentum, error feedback, in-flight results, the
fragments' schedule) and, with more than one island, the island's own weights and inner optimizer state (the
main checkpoint files hold island 0's).
"""
from __future__ import annotations

import contextlib
import time

from ...core import device as device_mod
from ...core import parallel_state as ps
from ...core.diloco import DilocoConfig, DilocoOuter, FlatWeights, IslandGroups, IslandLostError, OuterStats
from ...core.diloco.start import start_from_island_0
from ...core.distributed.ddp import DistributedDataParallel
from ..checkpoint import check_shapes, param_names
from ..errors import RankLocalError


class IslandLost(RankLocalError):
    """An island stopped answering during an outer all-reduce: every rank that saw it says so (exit 2); the
    run resumes from its last checkpoint."""


class DilocoStateError(RankLocalError):
    """The saved DiLoCo state does not fit this run (another fragment layout, another island)."""


@contextlib.contextmanager
def naming_lost_islands():
    """Core's :class:`IslandLostError` as the run's known error (one ``error:`` line per rank that saw it)."""
    try:
        yield
    except IslandLostError as e:
        raise IslandLost(str(e)) from e


def island_groups() -> IslandGroups:
    """This rank's place among the islands, from parallel_state."""
    return IslandGroups(islands=ps.get_num_islands(), island=ps.get_island_rank(), outer_group=ps.get_outer_group(),
                        slice_group=ps.get_data_parallel_group(with_context_parallel=True),
                        slice_rank=ps.get_data_parallel_rank(with_context_parallel=True),
                        slice_world=ps.get_data_parallel_world_size(with_context_parallel=True))


def lost_island_line() -> str:
    """Which island stopped answering, from the ranks' heartbeats (training.initialize)."""
    from .. import initialize

    beat = initialize._heartbeat
    if beat is None:
        return "an island stopped answering"
    time.sleep(3.5 * beat.interval_s)  # a stopped rank is named after three missed beats
    found = beat.silent_ranks()
    if not found or not found[0]:
        return "an island stopped answering (the heartbeats do not say which)"
    size = ps.get_world_size() // ps.get_num_islands()
    islands = sorted({r // size for r in found[0]})
    return f"island(s) {', '.join(map(str, islands))} stopped answering (rank(s) {', '.join(map(str, found[0]))})"


class DilocoCheckpoint:
    """The DiLoCo state as a member of the checkpoint's per-rank reducer state (``GradReducer``'s
    ``carries_feedback`` / ``state_dict`` / ``load_state_dict``). It exists before the checkpoint is loaded
    and keeps what was loaded until the seam is built on the loaded weights."""

    carries_feedback = True

    def __init__(self) -> None:
        self.seam: DilocoSeam | None = None
        self.loaded: dict | None = None

    @classmethod
    def for_config(cls, config: DilocoConfig) -> DilocoCheckpoint | None:
        return cls() if config.enabled else None

    def state_dict(self) -> dict:
        if self.seam is None:
            raise RuntimeError("the DiLoCo seam is not built yet: nothing to save")
        return {"diloco": self.seam.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state["diloco"]


class DilocoSeam:
    """One rank's DiLoCo: the outer loop over its model chunks' flat parameter buffers.

    Built after the checkpoint is loaded: the anchors are the loaded weights, or the saved DiLoCo state
    (anchors, outer momentum, error feedback, in flight results, the island's own weights) when there is one.
    """

    def __init__(self, config: DilocoConfig, model_chunks: list[DistributedDataParallel], optimizer,
                 checkpoint: DilocoCheckpoint) -> None:
        self.config, self.model_chunks, self.optimizer = config, model_chunks, optimizer
        buffers = [m.buffer.param_data for m in model_chunks]
        groups = island_groups()
        loaded, checkpoint.loaded = checkpoint.loaded, None
        if loaded is not None:
            self._load_island_state(loaded)
        elif groups.islands > 1:  # every island starts from island 0's weights (sent only where they differ)
            start_from_island_0(buffers, groups.outer_group, ps.get_outer_global_ranks()[0])
        # with two islands the other one is the lost one; with more, the heartbeats tell which
        self.outer = DilocoOuter(config, FlatWeights(buffers), groups,
                                 lost_island=lost_island_line if groups.islands > 2 else None)
        if loaded is not None:
            try:
                self.outer.load_state_dict(loaded["outer"])
            except ValueError as e:
                raise DilocoStateError(f"cannot resume DiLoCo: {e}") from e
        self._logged = OuterStats(**vars(self.outer.stats))
        self.checkpoint = checkpoint
        checkpoint.seam = self

    @classmethod
    def build(cls, config: DilocoConfig, model_chunks, optimizer,
              checkpoint: DilocoCheckpoint | None) -> DilocoSeam | None:
        """The seam of ``checkpoint`` (``DilocoCheckpoint.for_config``, loaded or not); None when DiLoCo is off."""
        return cls(config, model_chunks, optimizer, checkpoint) if checkpoint is not None else None

    def after_step(self, iteration: int, last: bool = False) -> None:
        """The outer steps due after inner step ``iteration``; after the run's ``last`` one, the islands'
        weights become their mean (``--no-diloco-final-average``: not), before the last evaluation and save."""
        self.optimizer.finish_param_sync()  # --overlap-param-gather: the weights are whole before they are read
        with naming_lost_islands():
            self.outer.after_inner_step(iteration)
            if last and self.config.final_average and self.outer.groups.islands > 1:
                self.outer.average_islands()

    def log_line(self, iteration: int) -> str | None:
        """Outer steps, bytes and link-busy time since the last line; None when no outer step landed since."""
        now, last = self.outer.stats, self._logged
        if (now.outer_steps + now.skipped + now.final_averages
                == last.outer_steps + last.skipped + last.final_averages):
            return None
        steps, sent = now.outer_steps - last.outer_steps, now.bytes_sent - last.bytes_sent
        line = (f" diloco outer | iteration {iteration} | island {self.outer.groups.island} of "
                f"{self.outer.groups.islands} | outer steps {now.outer_steps} (+{steps}) | bytes sent {sent} | "
                f"per outer step {sent // max(steps, 1)} | link busy {now.link_busy_s - last.link_busy_s:.3f} s | "
                f"inner loop waited {now.wait_s - last.wait_s:.3f} s | skipped {now.skipped}"
                + (" | islands averaged (end of training)" if now.final_averages > last.final_averages else ""))
        self._logged = OuterStats(**vars(now))
        return line

    def close(self) -> None:
        self.outer.close()

    # ---------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        with naming_lost_islands():  # waits for the outer all-reduce in flight
            state = {"outer": self.outer.state_dict()}
        if ps.get_num_islands() > 1:  # the main checkpoint files hold island 0's weights and inner state
            state["island"] = ps.get_island_rank()
            state["weights"] = [m.buffer.param_data.detach().cpu().clone() for m in self.model_chunks]
            state["inner_optimizer"] = self.optimizer.state_dict(param_names(self.model_chunks))
            state["rng"] = device_mod.get_rng_state()
        return state

    def _check_island_state_fits(self, state: dict) -> None:
        """The island's saved flat weights and inner Adam moments against this run's (one error, this rank's)."""
        def flat(weights) -> dict:
            return {f"flat weights of model chunk {i}": tuple(w.shape) for i, w in enumerate(weights)}

        names = param_names(self.model_chunks)
        saved = {**flat(state["weights"]), **{f"inner exp_avg of {n}": st["exp_avg"].shape
                                               for n, st in state["inner_optimizer"]["param_state"].items()}}
        here = {**flat(m.buffer.param_data for m in self.model_chunks),
                **{f"inner exp_avg of {names[i][id(p)]}": p.shape
                   for i, m in enumerate(self.model_chunks) for p in m.buffer.params}}
        check_shapes(f"(DiLoCo state of island {state['island']}, rank {ps.get_rank()})", saved, here,
                     collective=False, error=DilocoStateError)

    def _load_island_state(self, state: dict) -> None:
        """An island's own weights, inner optimizer state and RNG (saved with more than one island)."""
        if "weights" not in state:
            return
        if state["island"] != ps.get_island_rank():
            raise DilocoStateError(f"DiLoCo state of island {state['island']} offered to island "
                                   f"{ps.get_island_rank()}")
        self._check_island_state_fits(state)
        for m, w in zip(self.model_chunks, state["weights"]):
            m.buffer.param_data.copy_(w.to(m.buffer.param_data.device))
        self.optimizer.load_state_dict(state["inner_optimizer"], param_names(self.model_chunks))
        device_mod.set_rng_state(state["rng"])

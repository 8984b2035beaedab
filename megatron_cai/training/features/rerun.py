"""Megatron-LM's rerun state machine (megatron-core 0.19.2 ``megatron/core/rerun_state_machine.py``), the subset
that means something here. docs/rerun.md says what runs and how it differs.

Each iteration's results pass through validation calls (megatron-core's ``validate_result``), made once per
iteration from the step's one read-back, so every rank takes the same decision without a collective:
"found NaN / Inf in local forward loss calculation" (the ``lm loss``) and "found NaN / Inf in global grad norm ..."
(after the data-parallel reduction), all fatal, with ``--check-for-nan-in-loss-and-grad`` (on by default); and,
with ``--check-for-large-grads``, "found unexpected large grads ..." (not fatal).

- ``--rerun-mode validate_results``: from the process's second iteration on, a rejected result re-runs the
  iteration in place (same micro-batches, the RNG and Squinch error-feedback state restored) and compares the two
  results within the call's tolerance. Not reproducible: "Possible transient error!" (fatal: exit 17, resume from
  an earlier checkpoint). Reproducible: a checkpoint of the iteration's start and exit 16, asking the launcher to
  resume on another device; there the iteration runs again, and "Possible persistent error!" or "Correct result"
  ends the run with exit 17 (or, on the same device, exit 16 again). A real non-finite value is not rejected
  here: it skips the step on every rank (``divergence.py``); results are rejected by error injection and by the
  large-gradient rule.
- ``--error-injection-rate N`` / ``--error-injection-type``: each validation call is rejected with probability 1/N,
  from a draw on (seed, iteration, call) that every rank makes alike; the re-runs then see the type's outcome.
- ``--rerun-mode report_stats`` (megatron-core's ``report_determinism_stats``): every iteration runs twice; the
  relative difference of each validated result is recorded and reported every 2 iterations; training continues
  on the second run.

The lines carry megatron-core's logger prefix (``WARNING:megatron.core.rerun_state_machine:``) so that Megatron-LM's
log checks find them. What survives the exit-16 restart is a small JSON file beside the checkpoints
(:data:`STATE_FILE`), keyed by the checkpoint's iteration.
"""

from __future__ import annotations

import datetime
import enum
import functools
import json
import math
import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from ...core import device as device_mod
from ...core import parallel_state as ps
from ...core.distributed.contracts import GradReducer
from ...core.tensor_parallel.random import get_rng_tracker
from ..errors import UserError
from ..logging import print_rank_last
from ..step_readback import StepReadback

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16  # megatron-core's: restart (elsewhere) to establish a diagnostic
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17  # megatron-core's: the job failed on result validation
STATE_FILE = "rerun_state_machine.json"
MODES = ("disabled", "validate_results", "report_stats", "report_determinism_stats")
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")
REPORTING_INTERVAL_ITERATIONS = 2
COMPARISON_MATCH, COMPARISON_MISMATCH = 0.0, math.inf
_LOGGER = "megatron.core.rerun_state_machine"
_ERROR_NAMES = {"correct_result": "Expected result", "transient_error": "Transient error",
                "persistent_error": "Persistent error"}


class RerunStateError(UserError):
    """The rerun state file beside a checkpoint cannot be used (the message names it)."""


class State(enum.Enum):
    NOT_RUNNING_YET = "not_running_yet"
    INITIAL_RUN = "initial_run"
    RERUNNING_IN_PLACE = "rerunning_in_place"
    WILL_RERUN_FROM_CHECKPOINT = "will_rerun_from_checkpoint"
    RERUNNING_FROM_CHECKPOINT = "rerunning_from_checkpoint"
    RERUNNING_AGAIN_FROM_CHECKPOINT = "rerunning_again_from_checkpoint"


@dataclass(frozen=True)
class RerunConfig:
    """The rerun flags (``flags/rerun.py``)."""

    mode: str = "validate_results"
    error_injection_rate: int = 0
    error_injection_type: str = "transient_error"
    result_rejected_tracker_filename: str | None = None
    check_for_nan_in_loss_and_grad: bool = True
    check_for_large_grads: bool = False

    @property
    def reports_stats(self) -> bool:
        return self.mode in ("report_stats", "report_determinism_stats")

    @property
    def validates(self) -> bool:
        return self.mode == "validate_results"


@dataclass(frozen=True)
class Check:
    """One validation call: its result (None on ranks that do not hold it: the loss off the last pipeline stage;
    only injection rejects those calls, so no decision needs it) and how a rejection is judged."""

    message: str
    result: float | None
    tolerance: float = 0.0
    fatal: bool = True
    reject: Callable[[float], bool] | None = None  # megatron-core's rejection_func (None: injection only)


@dataclass(frozen=True)
class Verdict:
    """megatron-core's ``should_checkpoint_and_exit``: save the iteration's start, then exit with ``exit_code``."""

    checkpoint: bool
    exit_code: int


class Snapshot(Protocol):
    """What an in-place re-run restores (megatron-core's ``_save_state`` / ``_restore_state``)."""

    def save(self) -> object: ...

    def restore(self, saved: object) -> None: ...


def compare_floats(a: float | None, b: float | None) -> float:
    """megatron-core's ``_compare_floats``: 0 when equal (NaN equals NaN), inf when one is NaN/Inf and the other
    not, else the relative difference ``|a - b| / ((a + b) / 2)``."""
    if a is None or b is None:
        return COMPARISON_MATCH
    if a == b or (math.isnan(a) and math.isnan(b)):
        return COMPARISON_MATCH
    if math.isnan(a) != math.isnan(b) or math.isinf(a) != math.isinf(b):
        return COMPARISON_MISMATCH
    if a + b == 0:  # megatron-core divides by zero here
        return COMPARISON_MISMATCH
    return math.fabs((a - b) / (a + b) * 2)


@dataclass
class QuickStats:
    """The distribution of one call's relative differences (megatron-core's ``QuickStats`` report)."""

    samples: list[float] = field(default_factory=list)
    zero_cnt: int = 0

    def record(self, diff: float) -> None:
        if diff == 0.0:
            self.zero_cnt += 1
        else:
            self.samples.append(diff)

    def print_stats(self) -> str:
        z, n = self.zero_cnt, len(self.samples)
        if n == 0:
            return f"{z:,} samples, all identical"
        s, t = sorted(self.samples), z + n
        pct = {p: f"{s[int(t * p) - z]:.3E}" if int(t * p) - z >= 0 else "0.0" for p in (0.5, 0.9, 0.99, 0.999)}
        return (f"{t:,}/{z:,} total/identical samples, rel. variability: avg= {sum(s) / t:.3E}, p50= {pct[0.5]}, "
                f"p90= {pct[0.9]}, p99= {pct[0.99]}, p99.9= {pct[0.999]}, max: {max(s):.3E}")


@dataclass
class ErrorInjector:
    """megatron-core's ``RerunErrorInjector`` with a draw every rank makes alike (seed, iteration, call)."""

    rate: int
    kind: str
    seed: int
    injected: str | None = None  # the type injected and not yet resolved by a re-run

    def maybe_inject(self, iteration: int, call: int) -> bool:
        if self.rate <= 0 or self.injected is not None:
            return False
        if random.Random(f"rerun-injection:{self.seed}:{iteration}:{call}").randrange(self.rate) != 0:
            return False
        self.injected = self.kind
        return True

    def maybe_miscompare(self, initial: float | None, result: float | None, state: State) -> float:
        """The comparison, or the injected type's outcome: transient differs on the re-run in place, persistent
        on the re-run from the checkpoint, a correct result never."""
        if self.injected is None:
            return compare_floats(initial, result)
        kind = self.injected
        if state is State.RERUNNING_IN_PLACE:
            if kind == "transient_error":
                self.injected = None
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        self.injected = None
        return COMPARISON_MISMATCH if kind == "persistent_error" else COMPARISON_MATCH


class TrainingSnapshot:
    """The state a training iteration changes before its optimizer step: every RNG (python, numpy, torch, the
    device's, the tensor-parallel tracker's) and the gradient reducers' state (Squinch error feedback)."""

    def __init__(self, reducers: list[GradReducer]) -> None:
        self.reducers = reducers

    def save(self) -> object:
        return ({**device_mod.get_rng_state(), "tracker": get_rng_tracker().get_states()},
                [r.state_dict() for r in self.reducers])

    def restore(self, saved: object) -> None:
        rng, reducers = saved
        device_mod.set_rng_state(rng)
        get_rng_tracker().set_states(rng["tracker"])
        for r, sd in zip(self.reducers, reducers):
            r.load_state_dict(sd)


def device_identity(device_type: str, local_device: int) -> tuple[str, int]:
    """(host, device index): megatron-core's ``os.uname()[1]`` and ``torch.cuda.current_device()`` (the local
    rank on CPU)."""
    return socket.gethostname(), local_device if device_type == "cuda" else int(os.environ.get("LOCAL_RANK", 0))


_R = TypeVar("_R")


class RerunStateMachine:
    """One per rank; every rank feeds it the same checks and reaches the same verdict.

    ``say(line)`` prints on one rank; ``any_rank(flag)`` is True when ``flag`` is on some rank (a collective,
    called by every rank, only when a re-run from a checkpoint reaches the failed call).
    """

    def __init__(self, cfg: RerunConfig, *, seed: int, rank: int, identity: tuple[str, int],
                 say: Callable[[str], None], any_rank: Callable[[bool], bool]) -> None:
        self.cfg, self.rank, self.identity = cfg, rank, identity
        self._say, self._any_rank = say, any_rank
        self.injector = ErrorInjector(cfg.error_injection_rate, cfg.error_injection_type, seed)
        self.state = State.NOT_RUNNING_YET
        self.iteration = 0  # 0-based, as megatron-core's current_iteration; lines show it 1-based
        self.first_iteration_complete = False
        self.logged_enabled = False
        self.failed_call: tuple[str, int] | None = None
        self.initial_result: float | None = None
        self.suspicious: list[tuple[str, int]] | None = None  # (host, device) of every rank at the first re-run
        self.stats: dict[str, QuickStats] = {}
        self.large_value_counts: dict[str, int] = {}
        self.max_values: dict[str, float] = {}
        self._reset_requests()
        self._calls: dict[str, int] = {}
        self._saved_results: dict[tuple[str, int], float | None] = {}
        self.log("WARNING", f"RerunStateMachine initialized in mode {cfg.mode}")

    def _reset_requests(self) -> None:
        self.rerun_requested = self.checkpoint_requested = False
        self.restart_again_requested = self.continue_requested = False

    def log(self, level: str, message: str) -> None:
        self._say(f"{level}:{_LOGGER}:{message}")

    def step_checks(self, read: StepReadback) -> list[Check]:
        """One iteration's validation calls, in megatron-core's order: the loss's (its loss function), then the
        gradients' (DDP's ``check_grads``). A real non-finite value is not rejected (module docstring)."""
        grads = "global grad norm after the data-parallel reduction"
        checks = []
        if self.cfg.check_for_nan_in_loss_and_grad:
            loss = read.losses.get("lm loss")
            checks += [Check("found NaN in local forward loss calculation", loss),
                       Check("found Inf in local forward loss calculation", loss),
                       Check(f"found NaN in {grads}", read.grad_norm, tolerance=0.001),  # megatron-core's for grads
                       Check(f"found Inf in {grads}", read.grad_norm, tolerance=0.001)]
        if self.cfg.check_for_large_grads:
            large = functools.partial(self.is_unexpectedly_large, threshold=10.0, context="grads")
            checks.append(Check(f"found unexpected large grads in {grads}", read.grad_norm, tolerance=0.001,
                                fatal=False, reject=large))
        return checks

    def is_unexpectedly_large(self, value: float, threshold: float, context: str, num_samples: int = 100) -> bool:
        """megatron-core's rule: the max of the first ``num_samples`` finite values of ``context`` is the
        reference; a later value at or above ``threshold`` x it is unexpectedly large."""
        value = math.fabs(value)
        if not math.isfinite(value):
            return False
        count = self.large_value_counts.get(context, 0)
        if count < num_samples:
            self.large_value_counts[context] = count + 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            if count + 1 == num_samples:
                self.log("WARNING", f"Max value for {context}: {self.max_values[context]}")
            return False
        return value >= self.max_values[context] * threshold

    @property
    def may_rerun(self) -> bool:
        """Whether this iteration can run twice (so its starting state is worth saving)."""
        return self.cfg.reports_stats or (self.cfg.validates and self.first_iteration_complete
                                          and (self.cfg.error_injection_rate > 0 or self.cfg.check_for_large_grads))

    # ------------------------------------------------------------------------------------- the loop
    def run_iteration(self, iteration: int, run: Callable[[], _R], checks: Callable[[_R], list[Check]],
                      snapshot: Snapshot) -> tuple[_R, Verdict | None]:
        """megatron-core's ``while should_run_forward_backward(...)`` loop, then ``should_checkpoint_and_exit``:
        the last run's result and, when the job must stop, the verdict (its state restored to the iteration's
        start, ready for a checkpoint)."""
        saved = snapshot.save() if self.may_rerun or self.state is State.WILL_RERUN_FROM_CHECKPOINT else None
        self._start(iteration)
        while True:
            result = run()
            self._calls = {}
            for check in checks(result):
                self.validate(check)
            if not self._run_again():
                break
            snapshot.restore(saved)
        verdict = self._should_checkpoint_and_exit()
        if verdict is not None and saved is not None:
            snapshot.restore(saved)
        return result, verdict

    def _start(self, iteration: int) -> None:
        self.iteration = iteration
        if self.state is State.WILL_RERUN_FROM_CHECKPOINT:
            self.state = State.RERUNNING_FROM_CHECKPOINT
            return
        self._reset_requests()
        self.state = State.INITIAL_RUN

    def _run_again(self) -> bool:
        if self.state is State.INITIAL_RUN:
            if self.cfg.mode == "disabled" or not self.rerun_requested:
                self.state = State.NOT_RUNNING_YET
                return False
            if self.cfg.validates:
                self.log("WARNING", "Need to rerun step to check reproducibility of initial result")
            self.state = State.RERUNNING_IN_PLACE
            return True
        if self.state is State.RERUNNING_IN_PLACE:
            if self.cfg.reports_stats:
                self.state = State.NOT_RUNNING_YET
                self._maybe_report_stats()
                self._saved_results = {}
                return False
            if self.continue_requested:
                self.log("WARNING", "Continuing normal execution because failed validation was not fatal")
                self.state = State.NOT_RUNNING_YET
            elif self.checkpoint_requested:
                self.state = State.WILL_RERUN_FROM_CHECKPOINT
            return False
        if self.state is State.RERUNNING_FROM_CHECKPOINT:
            if self._any_rank(self.restart_again_requested):
                self.log("WARNING", "Need to restart job from the same checkpoint because it was scheduled on the "
                                    "same node/GPU")
                self.state = State.RERUNNING_AGAIN_FROM_CHECKPOINT
            elif self.continue_requested:
                self.log("WARNING", "Continuing normal execution because failed validation was not fatal")
                self.state = State.NOT_RUNNING_YET
        return False

    def _should_checkpoint_and_exit(self) -> Verdict | None:
        self.first_iteration_complete = True
        if not self.cfg.validates:
            return None
        if self.state is State.RERUNNING_IN_PLACE:
            self.log("WARNING", "Exiting now. The job can be resumed from a previous checkpoint")
            return Verdict(False, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
        if self.state is State.WILL_RERUN_FROM_CHECKPOINT:
            self.log("WARNING", "Saving a checkpoint and exiting now. Please resume the job from the checkpoint "
                                "to rerun the last iteration and establish a diagnostic")
            return Verdict(True, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        if self.state is State.RERUNNING_FROM_CHECKPOINT:
            self.log("WARNING", "Exiting now. A checkpoint at the last iteration already exists if further "
                                "examination is needed")
            return Verdict(False, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
        if self.state is State.RERUNNING_AGAIN_FROM_CHECKPOINT:
            self.log("WARNING", "Exiting now. Please resume the job from the same checkpoint to rerun the last "
                                "iteration and establish a diagnostic")
            return Verdict(False, EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        return None

    # ------------------------------------------------------------------------------- validation
    def validate(self, check: Check) -> None:
        """megatron-core's ``validate_result`` for one call of this run."""
        if self.cfg.mode == "disabled":  # a non-fatal rejection is logged; the rest is the divergence policy's
            if not check.fatal and check.reject is not None and check.reject(check.result):
                host, device = self.identity
                self.log("WARNING", f"Rank {self.rank}, node {host}, device {device}, iteration "
                                    f"{self.iteration + 1}: Unexpected result {check.result} "
                                    f"(message='{check.message}')")
            return
        sequence = self._calls[check.message] = self._calls.get(check.message, 0) + 1
        call = (check.message, sequence)
        if self.cfg.reports_stats:
            if self.state is State.INITIAL_RUN:
                self.rerun_requested = True
                self._saved_results[call] = check.result
            elif self.state is State.RERUNNING_IN_PLACE:
                diff = compare_floats(self._saved_results.get(call), check.result)
                self.stats.setdefault(check.message, QuickStats()).record(diff)
            return
        if not self.logged_enabled:
            self.logged_enabled = True
            self.log("WARNING", "Result validation enabled")
        if self.state is State.INITIAL_RUN and not self.rerun_requested:
            if self.first_iteration_complete:  # megatron-core validates from the process's second iteration on
                self._validate_initial(check, call, sum(self._calls.values()))
        elif self.state in (State.RERUNNING_IN_PLACE, State.RERUNNING_FROM_CHECKPOINT) and call == self.failed_call:
            comparison = self.injector.maybe_miscompare(self.initial_result, check.result, self.state)
            if self.state is State.RERUNNING_IN_PLACE:
                self._judge_first_rerun(check, comparison)
            else:
                self._judge_second_rerun(check, comparison)

    def _validate_initial(self, check: Check, call: tuple[str, int], index: int) -> None:
        if self.injector.maybe_inject(self.iteration, index):
            self.log("WARNING", f"Injecting error type {_ERROR_NAMES[self.injector.kind]}")
        elif check.reject is None or not check.reject(check.result):
            return
        self.failed_call, self.initial_result, self.rerun_requested = call, check.result, True
        self._track("initial_run", check)
        self.log("ERROR", f"Unexpected result {check.result} on rank {self.rank} at iteration #{self.iteration + 1} "
                          f"invocation #{call[1]} (message='{check.message}')")

    def _failure(self, message: str, fatal: bool = True) -> None:
        host, device = self.identity
        self.log("ERROR" if fatal else "WARNING",
                 f"Rank {self.rank}, node {host}, device {device}, iteration #{self.iteration + 1}: {message}!")

    def _judge_first_rerun(self, check: Check, comparison: float) -> None:
        result, initial = check.result, self.initial_result
        if comparison > check.tolerance:
            self.continue_requested = not check.fatal
            self._failure(f"First rerun: unexpected result is not reproducible within the tolerance "
                          f"({result} != {initial})", check.fatal)
            self._track("first_rerun_not_reproducible", check)
            self._failure("Possible transient error!", check.fatal)
            return
        self.checkpoint_requested, self.continue_requested = check.fatal, not check.fatal
        self._track("first_rerun_reproducible", check)
        self._failure(f"First rerun: unexpected result is reproducible within the tolerance ({result} = {initial}). "
                      f"Need to rerun on a different GPU to verify correctness.", check.fatal)

    def _judge_second_rerun(self, check: Check, comparison: float) -> None:
        host, device = self.identity
        before = self.suspicious[self.rank] if self.suspicious and self.rank < len(self.suspicious) else None
        if before == (host, device):
            self.log("ERROR", f"Got rescheduled on the same GPU. Need to resume again from the same checkpoint "
                              f"(node: {host}, gpu: {device})")
            self.restart_again_requested = True
            return
        result, initial = check.result, self.initial_result
        if comparison > check.tolerance:
            self._track("second_rerun_not_reproducible", check)
            self.log("WARNING", f"Second rerun: unexpected result is not reproducible on a different GPU, therefore "
                                f"was likely incorrect ({result} != {initial})")
            self._failure("Possible persistent error!")
        else:
            self._track("second_rerun_reproducible", check)
            self.log("WARNING", f"Second rerun: unexpected result is reproducible on a different GPU, therefore it "
                                f"was likely correct ({result} = {initial})")
            self._failure(f"Correct result (but possible Application error) ({check.message})")
        self.continue_requested = not check.fatal

    def _track(self, status: str, check: Check) -> None:
        """--result-rejected-tracker-filename: one line per event, in megatron-core's format."""
        path = self.cfg.result_rejected_tracker_filename
        if path is None or check.result is None:
            return
        host, device = self.identity
        with open(path, "a") as f:
            f.write(f"ts={datetime.datetime.now()} node={host} device={device} "
                    f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={self.rank} iteration={self.iteration + 1} "
                    f"status={status} result={check.result} message='{check.message}'\n")

    def _maybe_report_stats(self) -> None:
        if self.iteration % REPORTING_INTERVAL_ITERATIONS != 0:
            return
        self.log("INFO", "Stats on computation determinism in validation calls")
        for message, stats in self.stats.items():
            self.log("INFO", f"  From validation call '{message}':")
            self.log("INFO", f"    {stats.print_stats()}")

    # -------------------------------------------------------------------------------- the state file
    def state_dict(self, iteration: int, identities: list[tuple[str, int]]) -> dict:
        """What the exit-16 restart needs (megatron-core checkpoints the same fields)."""
        return {"iteration": iteration, "state": self.state.value, "failed_call": list(self.failed_call or ()),
                "initial_result": self.initial_result, "injected_error_type": self.injector.injected,
                "suspicious": [list(i) for i in identities]}

    def load_state_dict(self, sd: dict) -> None:
        self.log("WARNING", "Getting RerunStateMachine state from checkpoint. Will rerun step.")
        self.state = State(sd["state"])
        self.failed_call = (sd["failed_call"][0], int(sd["failed_call"][1]))
        self.initial_result = sd["initial_result"]
        self.injector.injected = sd["injected_error_type"]
        self.suspicious = [(str(h), int(d)) for h, d in sd["suspicious"]]


def write_state(save_dir: str, sd: dict) -> str:
    """Rank 0: the state file in ``save_dir``, replaced atomically."""
    path = os.path.join(save_dir, STATE_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(sd, f)
    os.replace(tmp, path)
    return path


def read_state(load_dir: str, iteration: int) -> dict | None:
    """The state file saved with checkpoint ``iteration`` of ``load_dir`` (None: none, or another iteration's).
    Parsed as data: every field is type-checked."""
    path = os.path.join(load_dir, STATE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            sd = json.load(f)
        ok = (isinstance(sd, dict) and isinstance(sd.get("iteration"), int) and sd.get("state") in
              {State.WILL_RERUN_FROM_CHECKPOINT.value} and _is_pair(sd.get("failed_call"))
              and (sd.get("initial_result") is None or isinstance(sd["initial_result"], (int, float)))
              and sd.get("injected_error_type") in (None, *INJECTION_TYPES)
              and isinstance(sd.get("suspicious"), list)
              and all(_is_pair(i) for i in sd["suspicious"]))
    except (OSError, ValueError) as e:
        raise RerunStateError(f"{path}: cannot read the rerun state ({e}); move it away to resume without it") from e
    if not ok:
        raise RerunStateError(f"{path}: not a rerun state file of this program; move it away to resume without it")
    return sd if sd["iteration"] == iteration else None


def _is_pair(value) -> bool:
    """A [text, int] pair: a validation call (message, sequence) or a device (host, index)."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


# ------------------------------------------------------------------------------------ the trainer's seams
def build(cfg: RerunConfig, seed: int, device: torch.device,
          reducers: list[GradReducer]) -> tuple[RerunStateMachine, TrainingSnapshot]:
    """This rank's machine (its lines printed by the last rank, which holds the loss) and what a re-run restores."""
    machine = RerunStateMachine(cfg, seed=seed, rank=ps.get_rank(),
                                identity=device_identity(device.type, device.index or 0),
                                say=print_rank_last, any_rank=functools.partial(_any_rank, device=device))
    return machine, TrainingSnapshot(reducers)


def resume(machine: RerunStateMachine, load_dir: str, iteration: int) -> None:
    """After loading checkpoint ``iteration``: the rerun state saved with it, if any (megatron-core's load)."""
    sd = read_state(load_dir, iteration)
    if sd is None:
        return
    if machine.cfg.mode == "disabled":
        machine.log("WARNING", "RerunStateMachine disabled via CLI, ignoring machine state saved in checkpoint")
        return
    machine.load_state_dict(sd)


def save_state(machine: RerunStateMachine, save_dir: str | None, iteration: int, device: torch.device) -> None:
    """Collective: the state file beside checkpoint ``iteration``, with every rank's device."""
    identities: list = [None] * ps.get_world_size()
    if ps.get_world_size() > 1:
        dist.all_gather_object(identities, machine.identity)
    else:
        identities = [machine.identity]
    if save_dir is None:
        machine.log("WARNING", "no --save: the iteration cannot be re-run from a checkpoint")
    elif ps.get_rank() == 0:
        write_state(save_dir, machine.state_dict(iteration, identities))


def _any_rank(flag: bool, device: torch.device) -> bool:
    if ps.get_world_size() == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)

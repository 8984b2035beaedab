"""The rerun state machine (training/features/rerun.py) against megatron-core 0.19.2's own ``RerunStateMachine``: the
same validation calls, with each injected error type, fatal or not, re-run from a checkpoint on the same or another
device, give the same number of runs per iteration, the same verdicts (checkpoint, exit code) and megatron-core's
log messages; its QuickStats report and comparison rule; the tracker file in megatron-core's format."""

from __future__ import annotations

import logging
import math
import random
import re

import pytest
import torch

from megatron_cai.training.features.rerun import (
    Check,
    QuickStats,
    RerunConfig,
    RerunStateMachine,
    State,
    compare_floats,
)

mcore = pytest.importorskip("megatron.core.rerun_state_machine")
HOST = "this-host"
MESSAGE = "found NaN in local forward loss calculation"


@pytest.fixture
def core(monkeypatch):
    """megatron-core's machine on CPU: its CUDA calls answered for device 0, its all-reduce for one rank."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_rng_state", torch.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: None)
    monkeypatch.setattr(mcore.os, "uname", lambda: ("Linux", HOST))
    monkeypatch.setattr(mcore.RerunStateMachine, "_reduce_any",
                        lambda self, v: tuple(bool(x) for x in v) if isinstance(v, list) else bool(v))


class _NoState:
    def save(self) -> object:
        return None

    def restore(self, saved: object) -> None:
        pass


def _ours(kind: str, lines: list[str], mode: str = "validate_results") -> RerunStateMachine:
    cfg = RerunConfig(mode=mode, error_injection_rate=1, error_injection_type=kind)
    return RerunStateMachine(cfg, seed=1, rank=0, identity=(HOST, 0), say=lines.append, any_rank=bool)


def _core(kind: str):
    return mcore.RerunStateMachine(mode=mcore.RerunMode.VALIDATE_RESULTS,
                                   error_injector=mcore.RerunErrorInjector(1, mcore.RerunDiagnostic(kind)))


def _run_ours(m: RerunStateMachine, iterations: range, fatal: bool) -> list[tuple[int, object]]:
    out = []
    for it in iterations:
        runs = []
        _, verdict = m.run_iteration(it, lambda runs=runs: runs.append(1) or 2.5,
                                     lambda v: [Check(MESSAGE, v, tolerance=0.0, fatal=fatal)], _NoState())
        out.append((len(runs), None if verdict is None else (verdict.checkpoint, verdict.exit_code)))
        if verdict is not None:
            break
    return out


def _run_core(m, iterations: range, fatal: bool) -> list[tuple[int, object]]:
    out = []
    for _ in iterations:
        runs = 0
        while m.should_run_forward_backward(None):
            runs += 1
            m.validate_result(torch.tensor(2.5), torch.isnan, MESSAGE, tolerance=0.0, fatal=fatal)
        checkpoint, leave, code = m.should_checkpoint_and_exit()
        out.append((runs, (checkpoint, code) if leave else None))
        if leave:
            break
    return out


def _restarted_core(m, host: str):
    """A new megatron-core machine loaded with ``m``'s checkpointed state (its ``state_dict`` fields)."""
    fresh = _core(m.error_injector.error_injection_type.value)
    fresh.load_state_dict({"mode": m.mode, "state": m.state, "current_iteration": m.current_iteration, "sharded": {
        "rerun_requested": m.rerun_requested, "checkpoint_requested": m.checkpoint_requested,
        "restart_again_requested": m.restart_again_requested, "continue_requested": m.continue_requested,
        "error_injector_checkpoint": m.error_injector.state_dict(), "failed_validation_call": m.failed_validation_call,
        "initial_result": m.initial_result, "suspicious_node": host, "suspicious_device": 0,
        "data_iterator_checkpoints": None, "large_value_counts": {}, "max_values": {}}})
    return fresh


def _restarted_ours(m: RerunStateMachine, host: str, lines: list[str]) -> RerunStateMachine:
    fresh = _ours(m.cfg.error_injection_type, lines)
    sd = m.state_dict(m.iteration, [(host, 0)])
    fresh.load_state_dict(sd)
    return fresh


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == mcore.__name__]


def _same_messages(ours: list[str], theirs: list[str]) -> None:
    """Our lines are megatron-core's messages with its logger's prefix (results printed as floats, not tensors)."""
    mine = [re.sub(r"^(WARNING|ERROR|INFO):megatron\.core\.rerun_state_machine:", "", line) for line in ours]
    theirs = [re.sub(r"tensor\(([^)]*)\)", r"\1", t) for t in theirs]
    assert [_words(t) for t in theirs if "initialized in mode" not in t] == \
           [_words(m) for m in mine if "initialized in mode" not in m]


def _words(line: str) -> str:
    return re.sub(r"[0-9.]+", "N", line)  # 2.5 (ours) vs 2.5000 (a tensor's repr)


@pytest.mark.parametrize("fatal", [True, False])
@pytest.mark.parametrize("kind", ["transient_error", "persistent_error", "correct_result"])
def test_in_place_rerun_matches_megatron_core(core, caplog, kind, fatal):
    caplog.set_level(logging.INFO, logger=mcore.__name__)
    lines: list[str] = []
    ours, theirs = _run_ours(_ours(kind, lines), range(4), fatal), _run_core(_core(kind), range(4), fatal)
    assert ours == theirs
    # hand-computed: iteration 1 is never validated; iteration 2 is injected and re-run once
    assert ours[0] == (1, None) and ours[1][0] == 2
    expected = {("transient_error", True): (False, 17)}.get((kind, fatal), (True, 16) if fatal else None)
    assert ours[1][1] == expected
    _same_messages(lines, _messages(caplog))


@pytest.mark.parametrize("moved", [True, False])
@pytest.mark.parametrize("kind", ["persistent_error", "correct_result"])
def test_rerun_from_checkpoint_matches_megatron_core(core, caplog, kind, moved):
    caplog.set_level(logging.INFO, logger=mcore.__name__)
    lines: list[str] = []
    first_ours, first_core = _ours(kind, lines), _core(kind)
    assert _run_ours(first_ours, range(3), True)[-1] == _run_core(first_core, range(3), True)[-1] == (2, (True, 16))
    host = "another-host" if moved else HOST  # the device of the first re-run, as the restarted job finds it
    caplog.clear()
    lines.clear()
    ours = _run_ours(_restarted_ours(first_ours, host, lines), range(1, 3), True)
    theirs = _run_core(_restarted_core(first_core, host), range(1, 3), True)
    assert ours == theirs == [(1, (False, 17 if moved else 16))]
    _same_messages(lines, _messages(caplog))
    verdict = {"persistent_error": "Possible persistent error!!", "correct_result": "Correct result"}[kind]
    assert any(verdict in line for line in lines) == moved
    assert any("Got rescheduled on the same GPU" in line for line in lines) == (not moved)


def test_disabled_mode_injects_nothing_and_reruns_nothing():
    lines: list[str] = []
    assert _run_ours(_ours("persistent_error", lines, mode="disabled"), range(5), True) == [(1, None)] * 5
    assert not any("Injecting" in line for line in lines)


def test_injection_rate_is_one_in_n_calls_and_the_same_on_every_rank():
    """--error-injection-rate 10: over many iterations' first calls, about 1 in 10 is injected; the draw depends
    only on (seed, iteration, call), so every rank (and a resumed run) makes the same."""
    from megatron_cai.training.features.rerun import ErrorInjector

    hits = []
    for it in range(4000):
        inj = ErrorInjector(10, "transient_error", seed=7)
        hits.append(inj.maybe_inject(it, 1))
        assert ErrorInjector(10, "transient_error", seed=7).maybe_inject(it, 1) == hits[-1]
    assert 0.085 < sum(hits) / len(hits) < 0.115


def test_compare_floats_is_megatron_cores():
    values = [0.0, 1.0, 2.5, -3.0, 1e-8, math.nan, math.inf, -math.inf]
    for a in values:
        for b in values:
            if a + b == 0 and a != b:  # megatron-core divides by zero here
                continue
            want = mcore._compare_floats(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))
            got = compare_floats(a, b)
            assert got == want or (math.isnan(got) and math.isnan(want)), (a, b)


@pytest.mark.parametrize("zeros,n", [(5, 0), (0, 7), (3, 40), (1000, 3)])
def test_quick_stats_report_is_megatron_cores(zeros, n):
    rng = random.Random(zeros * 31 + n)
    samples = [0.0] * zeros + [rng.uniform(1e-7, 1e-2) for _ in range(n)]
    rng.shuffle(samples)
    ours, theirs = QuickStats(), mcore.QuickStats()
    for s in samples:
        ours.record(s)
        theirs.record(s)
    assert ours.print_stats() == theirs.print_stats()


def test_report_stats_reruns_every_iteration_and_reports_every_second():
    lines: list[str] = []
    m = _ours("transient_error", lines, mode="report_stats")
    values = iter([1.0, 1.0, 2.0, 2.0 * (1 + 1e-3), 3.0, 3.0])  # iteration 2 differs by a relative 1e-3
    for it in range(3):
        _, verdict = m.run_iteration(it, lambda: next(values), lambda v: [Check(MESSAGE, v)], _NoState())
        assert verdict is None and m.state is State.NOT_RUNNING_YET
    reports = [i for i, line in enumerate(lines) if "Stats on computation determinism" in line]
    assert len(reports) == 2  # after iterations 1 and 3 (0-based 0 and 2)
    diff = abs(2.0 - 2.002) / (2.0 + 2.002) * 2
    assert lines[reports[0] + 2].endswith("1 samples, all identical")
    assert lines[reports[1] + 2].endswith(f"3/2 total/identical samples, rel. variability: avg= {diff / 3:.3E}, "
                                          f"p50= 0.0, p90= {diff:.3E}, p99= {diff:.3E}, p99.9= {diff:.3E}, "
                                          f"max: {diff:.3E}")


def test_tracker_file_lines_parse_with_megatron_cores_reader(tmp_path):
    path = tmp_path / "rejected.txt"
    lines: list[str] = []
    cfg = RerunConfig(error_injection_rate=1, error_injection_type="persistent_error",
                      result_rejected_tracker_filename=str(path))
    m = RerunStateMachine(cfg, seed=1, rank=0, identity=(HOST, 0), say=lines.append, any_rank=bool)
    _run_ours(m, range(3), True)
    text = path.read_text().splitlines()
    assert [re.search(r"status=(\S+)", t)[1] for t in text] == ["initial_run", "first_rerun_reproducible"]
    assert all("iteration=2 " in t and f"message='{MESSAGE}'" in t for t in text)
    # megatron-core's reader: one rank reproducing twice at iteration 2 -> skip it (needs two such lines)
    path.write_text("\n".join(text + [text[1]]) + "\n")
    assert mcore.RerunStateMachine.get_skipped_iterations_from_tracker_file(str(path)) == [2]


def test_large_grads_rule_is_megatron_cores(core):
    lines: list[str] = []
    ours = _ours("transient_error", lines)
    theirs = mcore.RerunStateMachine()
    rng = random.Random(3)
    values = [rng.uniform(0.5, 2.0) for _ in range(100)]
    values += [19.0, 25.0, 1.0, 10 * max(values), 21.0]  # 10 x the max: at the threshold, large
    got = [ours.is_unexpectedly_large(v, 10.0, "grads") for v in values]
    want = [theirs.is_unexpectedly_large(torch.tensor(v), 10.0, "grads") for v in values]
    assert got == want and got[100:] == [v >= 10 * max(values[:100]) for v in values[100:]]


def test_state_file_round_trips_for_its_iteration_only(tmp_path):
    from megatron_cai.training.features.rerun import RerunStateError, read_state, write_state

    lines: list[str] = []
    m = _ours("persistent_error", lines)
    _run_ours(m, range(3), True)
    sd = m.state_dict(1, [(HOST, 0), ("other", 1)])
    write_state(str(tmp_path), sd)
    assert read_state(str(tmp_path), 1) == sd and read_state(str(tmp_path), 2) is None
    assert read_state(str(tmp_path / "none"), 1) is None
    for bad in ('{"iteration": 1}', "not json", '{"iteration": 1, "state": "will_rerun_from_checkpoint", '
                '"failed_call": ["m", 1], "initial_result": 1.0, "injected_error_type": "rm -rf", "suspicious": []}'):
        (tmp_path / "rerun_state_machine.json").write_text(bad)
        with pytest.raises(RerunStateError, match="rerun_state_machine.json"):
            read_state(str(tmp_path), 1)

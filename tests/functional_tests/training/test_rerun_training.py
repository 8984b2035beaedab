"""Megatron's rerun state machine in real trainings (training/features/rerun.py).

An injected transient error on a non-fatal check is re-run and training goes on with the losses and weights of a
run without injection (dropout on, so the restored RNG matters); an injected persistent error saves the
iteration's start and exits 16, a resume on the same device exits 16 again and one elsewhere ends with "Possible
persistent error" and exit 17; a transient error on a fatal check exits 17 without saving; validate_results
without injection and disabled change nothing; report_stats re-runs every iteration and reports identical
results (the CPU path is deterministic)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from testlib import ROOT
from testlib.distributed import run_distributed
from testlib.train import TINY_MODEL

import pretrain_gpt
from megatron_cai.core import parallel_state as ps
from megatron_cai.training.features.rerun import STATE_FILE
from megatron_cai.training.training import Trainer, pretrain

BASE = ["--mock-data", *TINY_MODEL, "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
        "--seed", "11", "--hidden-dropout", "0.3"]
ITERS = ["--train-iters", "4"]


def _worker(rank: int, world_size: int, argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        config, tokenizer = pretrain_gpt.build_run(argv, world_size=world_size)
        trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step,
                          tokenizer)
        state = trainer.train()
    weights = [p.detach().clone() for m in trainer.model for p in m.module.parameters()]
    return {"losses": [h["lm loss"] for h in state.extra["history"]], "exit_code": state.exit_code,
            "iteration": state.iteration, "out": out.getvalue(), "weights": weights,
            "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True)}


def _train(argv: list[str], world: int = 1) -> dict:
    results = run_distributed(_worker, world, (BASE + argv,))
    last = [r for r in results if r["last_stage"]][-1]
    return {**last, "weights": results[0]["weights"]}


def _lines(out: str, needle: str) -> list[str]:
    return [line for line in out.splitlines() if needle in line]


def _same_run(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and len(a["losses"]) == 4
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))


@pytest.fixture(scope="module")
def reference() -> dict:
    return _train([*ITERS, "--rerun-mode", "disabled", "--check-for-large-grads"])


def test_transient_error_on_a_non_fatal_check_reruns_and_trains_as_without(reference):
    run = _train([*ITERS, "--no-check-for-nan-in-loss-and-grad", "--check-for-large-grads",
                  "--error-injection-rate", "1", "--error-injection-type", "transient_error"])
    assert run["exit_code"] == 0 and run["iteration"] == 4
    # iterations 2..4 each: injected, re-run, judged transient, continued (iteration 1 is never validated)
    assert len(_lines(run["out"], "Injecting error type Transient error")) == 3
    assert len(_lines(run["out"], "Possible transient error!!")) == 3
    assert len(_lines(run["out"], "Continuing normal execution because failed validation was not fatal")) == 3
    _same_run(run, reference)


def test_validate_results_without_injection_and_report_stats_change_nothing(reference):
    validate = _train(ITERS)
    assert _lines(validate["out"], "Result validation enabled") and not _lines(validate["out"], "rerun step")
    _same_run(validate, reference)
    stats = _train([*ITERS, "--rerun-mode", "report_stats"])
    _same_run(stats, reference)
    # reports after iterations 1 and 3 (megatron-core: every 2), cumulative: 1, then 3 re-runs, all identical
    reports = _lines(stats["out"], "samples, all identical")
    assert [line.split(":")[-1].strip() for line in reports] == ["1 samples, all identical"] * 4 + \
        ["3 samples, all identical"] * 4


def test_transient_error_on_a_fatal_check_exits_17_without_saving(tmp_path):
    save = tmp_path / "ck"
    run = _train([*ITERS, "--error-injection-rate", "1", "--save", str(save), "--save-interval", "100"])
    assert run["exit_code"] == 17 and run["iteration"] == 1 and len(run["losses"]) == 1
    assert _lines(run["out"], "Possible transient error!!")
    assert _lines(run["out"], "Exiting now. The job can be resumed from a previous checkpoint")
    assert not os.path.exists(save / "latest_checkpointed_iteration.txt") and not (save / STATE_FILE).exists()


def _pretrain_worker(rank: int, world_size: int, argv: list[str]) -> dict:
    """pretrain_gpt's pretrain() as its main calls it: the verdict leaves as SystemExit(code)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        config, tokenizer = pretrain_gpt.build_run(argv, world_size=world_size)
        try:
            pretrain(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
            code = 0
        except SystemExit as e:
            code = e.code
    return {"exit_code": code, "out": out.getvalue()}


def _persistent_flags(save: str) -> list[str]:
    return [*BASE, *ITERS, "--error-injection-rate", "1", "--error-injection-type", "persistent_error",
            "--save", save, "--load", save, "--save-interval", "100"]


def _first_verdict(out: str, save: str) -> dict:
    """Megatron's lines of an injected persistent error, the checkpoint and the state file; the state."""
    for needle in ("Result validation enabled", "Injecting error type Persistent error",
                   "First rerun: unexpected result is reproducible within the tolerance",
                   "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
                   "iteration and establish a diagnostic"):
        assert _lines(out, needle), needle
    # the checkpoint of iteration 2's start (iteration 1 done), and the state the restart needs beside it
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "1"
    with open(os.path.join(save, STATE_FILE)) as f:
        state = json.load(f)
    assert state["iteration"] == 1 and state["state"] == "will_rerun_from_checkpoint"
    assert state["failed_call"] == ["found NaN in local forward loss calculation", 1]
    assert state["injected_error_type"] == "persistent_error"
    return state


def test_persistent_error_checkpoints_exits_16_and_is_diagnosed_elsewhere(tmp_path):
    save = str(tmp_path / "ck")
    (first,) = run_distributed(_pretrain_worker, 1, (_persistent_flags(save),))
    assert first["exit_code"] == 16  # Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE
    state = _first_verdict(first["out"], save)
    first_loss = state["initial_result"]

    same = _train(_persistent_flags(save)[len(BASE):])  # restarted on the same device: once more, nothing saved
    assert same["exit_code"] == 16 and same["iteration"] == 1
    assert _lines(same["out"], "Got rescheduled on the same GPU")
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt", STATE_FILE]

    state["suspicious"] = [["another-host", 0]]  # the first re-run's device, as a job elsewhere finds it
    with open(os.path.join(save, STATE_FILE), "w") as f:
        json.dump(state, f)
    (moved,) = run_distributed(_pretrain_worker, 1, (_persistent_flags(save),))
    assert moved["exit_code"] == 17  # Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    (second,) = _lines(moved["out"], "Second rerun: unexpected result is not reproducible on a different GPU")
    assert f"({first_loss} != {first_loss})" in second  # the same data: the same loss, judged by the injection
    assert _lines(moved["out"], "Possible persistent error!!")
    assert _lines(moved["out"], "Exiting now. A checkpoint at the last iteration already exists")


@pytest.mark.slow
def test_persistent_error_process_exits_16(tmp_path):
    """The real process: pretrain_gpt.py's exit status is the verdict's."""
    save = str(tmp_path / "ck")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *_persistent_flags(save)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 16, proc.stderr[-3000:]
    _first_verdict(proc.stdout, save)


@pytest.mark.slow
def test_transient_rerun_restores_squinch_feedback_at_dp2():
    """DP = 2 with Squinch: the error feedback carried into an iteration is restored for its re-run."""
    flags = [*ITERS, "--squinch", "--no-check-for-nan-in-loss-and-grad", "--check-for-large-grads"]
    ref = _train([*flags, "--rerun-mode", "disabled"], world=2)
    run = _train([*flags, "--error-injection-rate", "1"], world=2)
    assert len(_lines(run["out"], "Possible transient error!!")) == 3
    _same_run(run, ref)


@pytest.mark.slow
def test_persistent_error_at_dp2_records_every_rank_and_every_rank_exits(tmp_path):
    """DP = 2: both ranks exit 16, the state file holds both ranks' devices, and the restart on the same devices
    (the decision shared by an all-reduce) exits 16 on both."""
    save = str(tmp_path / "ck")
    flags = _persistent_flags(save)[len(BASE):]
    first = run_distributed(_worker, 2, (BASE + flags,))
    assert [r["exit_code"] for r in first] == [16, 16]
    with open(os.path.join(save, STATE_FILE)) as f:
        state = json.load(f)
    assert len(state["suspicious"]) == 2 and state["suspicious"][0][0] == state["suspicious"][1][0]
    again = run_distributed(_worker, 2, (BASE + flags,))
    assert [r["exit_code"] for r in again] == [16, 16]
    assert _lines(again[-1]["out"], "Got rescheduled on the same GPU")

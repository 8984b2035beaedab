"""bench/gpu/validate.sh's step limits, read from the script itself: every step it runs has one, and on
the GPU (scale 1) they add up to at most 420 s (issue 26: the validation machine gives one command 10
minutes, start-up, transfers and the summary included); and the QAT step, at its budget there, runs
both its real-GEMM rows (issue 40). Fast: no step runs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import torch
from testlib import ROOT

GPU = os.path.join(ROOT, "bench", "gpu")
SCRIPT = os.path.join(GPU, "validate.sh")


def _listed(*flags: str) -> dict[str, tuple[int, int]]:
    """Each step's (limit, budget) on the GPU as the script computes them (``--list-limits``)."""
    out = subprocess.run(["bash", SCRIPT, "--list-limits", *flags], capture_output=True, text=True, check=True,
                         timeout=30).stdout
    return {name: (int(limit), int(budget)) for name, limit, budget in (line.split() for line in out.splitlines())}


def _run_steps() -> set[str]:
    """The steps the script runs (``step NAME ...`` and ``run NAME ...`` lines)."""
    text = open(SCRIPT).read()
    return set(re.findall(r"^\s*step (\w+) ", text, re.M) + re.findall(r"^\s*run (\w+) ", text, re.M))


def test_every_step_has_a_limit_and_they_add_up_to_at_most_420_s() -> None:
    main, extra = _listed(), _listed("--extra")
    assert set(main) == {"env", "codec", "attention", "training", "qat", "pytest"}, main
    assert set(extra) == {"cp", "overhead"}, extra
    assert _run_steps() == set(main) | set(extra)  # a step without a limit would run `timeout ""`
    assert all(limit > 15 and budget == limit - 15 for limit, budget in [*main.values(), *extra.values()])
    assert sum(limit for limit, _ in main.values()) <= 420, main
    # the second run (only with machine time left): at most 5 minutes with start-up and the summary
    assert sum(limit for limit, _ in extra.values()) <= 270, extra


def test_listing_the_limits_writes_nothing(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    subprocess.run(["bash", SCRIPT, "--list-limits"], env=env, capture_output=True, check=True, timeout=30)
    assert not (tmp_path / "out").exists()


class _Clock:
    """A clock that advances only when a row runs, by the time that row is allowed to take."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    @staticmethod
    def strftime(fmt: str) -> str:
        return time.strftime(fmt)


def test_qat_schedules_its_int8_and_fp8_rows_at_the_gpu_limits(tmp_path, monkeypatch) -> None:
    """qat.py's own loop, with the --budget-s that validate.sh gives it on the GPU (no dry-run scaling)
    and each row taking the full time qat.py asks to have left before starting it (ROW_NEED_S), on a
    device with both real GEMMs (as the H200): neither the int8 nor the FP8 row is skipped."""
    sys.path.insert(0, GPU)
    import common
    import qat

    clock = _Clock()
    ran = []

    def row_taking_its_need(fmt, m, k, n, device, reps):
        assert (m, k, n) == (8192, 4096, 4096)  # the GPU sizes: not the dry run
        ran.append(fmt)
        clock.now += qat.ROW_NEED_S[fmt]
        return {"path": f"quantized_linear {fmt}", "fwd_rel_err": 0.0}

    monkeypatch.setattr(common, "time", clock)
    monkeypatch.setattr(qat, "check_format", row_taking_its_need)
    monkeypatch.setattr(qat, "pick_device", lambda dry_run: torch.device("cpu"))
    monkeypatch.setattr(qat.gb, "real_gemm_available", lambda fmt, device, require_gpu: True)
    monkeypatch.setattr(qat.gb, "transformer_engine_available", lambda: False)  # not on the machine
    budget = _listed()["qat"][1]
    out = tmp_path / "gpu_qat.json"
    assert qat.main(["--budget-s", str(budget), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert ran == ["int8", "fp8_e4m3"] and data["skipped"] == [], (budget, data["skipped"])

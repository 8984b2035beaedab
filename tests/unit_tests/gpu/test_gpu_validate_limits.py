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


def _script_limits() -> dict[str, int]:
    """Each step's limit as the script's own ``limit_of`` computes it on the GPU (SCALE=1)."""
    text = open(SCRIPT).read()
    limits_line = re.search(r"^LIMITS=\(.*\)$", text, re.M).group(0)
    limit_of = re.search(r"^limit_of\(\) \{.*\}$", text, re.M).group(0)
    steps = re.findall(r"^step (\w+) ", text, re.M) + re.findall(r"^\s*run (\w+) ", text, re.M)
    out = subprocess.run(["bash", "-c", f'SCALE=1\n{limits_line}\n{limit_of}\n'
                          f'for s in {" ".join(steps)}; do echo "$s=$(limit_of $s)"; done'],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return {name: int(value) if value else 0 for name, value in (line.split("=") for line in out.split())}


def test_every_step_has_a_limit_and_they_add_up_to_at_most_420_s() -> None:
    limits = _script_limits()
    assert set(limits) == {"env", "codec", "attention", "training", "qat", "pytest"}, limits
    assert all(v > 0 for v in limits.values()), limits  # a step without a limit would run `timeout ""`
    assert sum(limits.values()) <= 420, limits


def _script_budgets() -> dict[str, float]:
    """Each step's --budget-s as the script's own ``budget`` computes it on the GPU (SCALE=1)."""
    text = open(SCRIPT).read()
    defs = "\n".join(re.search(rf"^{pattern}$", text, re.M).group(0)
                     for pattern in (r"LIMITS=\(.*\)", r"limit_of\(\) \{.*\}", r"budget\(\) \{.*\}"))
    names = " ".join(_script_limits())
    out = subprocess.run(["bash", "-c", f'SCALE=1\n{defs}\nfor s in {names}; do echo "$s=$(budget $s)"; done'],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return {name: float(value) for name, value in (line.split("=") for line in out.split())}


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
    budget = _script_budgets()["qat"]
    out = tmp_path / "gpu_qat.json"
    assert qat.main(["--budget-s", str(budget), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert ran == ["int8", "fp8_e4m3"] and data["skipped"] == [], (budget, data["skipped"])

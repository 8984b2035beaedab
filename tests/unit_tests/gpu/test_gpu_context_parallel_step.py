"""bench/gpu/context_parallel.py --dry-run (the Triton interpreter, toy sizes): the CP = 4 ranks' per-chunk
kernels, merged by log-sum-exp, equal the CP = 1 Triton attention (output and dQ), and the step writes its
rows through the GPU steps' StepResults. No other test or validate.sh step runs this script; it had stopped
importing (``common.write_results`` was gone) without anything noticing.

Fast mode: packed documents only (a CP exchange that visibility prunes). The whole dry run of the three
batches is the slow test."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from testlib import ROOT

SCRIPT = os.path.join(ROOT, "bench", "gpu", "context_parallel.py")


def _dry_run(tmp_path, *batches: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, *sys.path]), PYTHONWARNINGS="ignore")
    out = tmp_path / "gpu_context_parallel.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--budget-s", "3600", "--out", str(out),
                           *(["--batches", *batches] if batches else [])],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check(result: dict, batches: set[str]) -> None:
    assert result["status"] == "ok" and result["cp"] == 4 and not result["skipped"]
    assert {r["batch"] for r in result["rows"]} == batches
    for r in result["rows"]:  # fp32 at toy size: the merged ranks equal one CP = 1 call to rounding
        assert r["chunks"] == 8 and r["max err out"] < 1e-5 and r["max err dq"] < 1e-5, r


def test_cp4_ranks_equal_one_call_on_packed_documents(tmp_path) -> None:
    pytest.importorskip("triton")
    _check(_dry_run(tmp_path, "packed documents"), {"packed documents"})


@pytest.mark.slow
def test_dry_run_of_every_batch(tmp_path) -> None:
    pytest.importorskip("triton")
    _check(_dry_run(tmp_path), {"plain causal", "packed documents", "packed trees"})

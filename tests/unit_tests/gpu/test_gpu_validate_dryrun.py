"""bench/gpu/validate.sh --dry-run: every step of the GPU validation runs at toy sizes on the CPU
(Triton interpreter) and writes its results, so CI shows the script itself works."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from testlib import ROOT


def test_validate_dry_run(tmp_path) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]), PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu", "validate.sh"), "--dry-run", "--out-dir",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=2400)
    summary = (tmp_path / "gpu_summary.md").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-3000:] + proc.stderr[-3000:]
    for step in ("pytest -m gpu", "squinch codec", "attention", "training throughput", "QAT real GEMM"):
        assert f"| {step} | ok |" in summary
    res = {name: json.loads((tmp_path / f"gpu_{name}.json").read_text()) for name in ("codec", "attention", "train",
                                                                                        "qat")}
    assert all(r["dry_run"] for r in res.values())
    assert res["codec"]["all_identical"] and res["codec"]["rows"]
    ours = [r for r in res["attention"]["rows"] if r["method"] == "ours (triton)"]
    assert {r["layout"] for r in ours} == {"plain causal", "packed documents", "packed trees"}
    # our kernels agree with FlexAttention / SDPA on the toy sizes (fp16 under the interpreter)
    errs = [r["max_abs_err_vs_ours"] for r in res["attention"]["rows"] if r.get("max_abs_err_vs_ours") is not None]
    assert errs and max(errs) < 1e-2
    train = {r["backend"]: r for r in res["train"]["rows"]}
    assert math.isfinite(train["triton"]["last_loss"])
    # same model, same data, same seed: the Triton and blocked backends train to the same loss
    assert abs(train["triton"]["last_loss"] - train["blocked"]["last_loss"]) < 1e-3
    for name in ("codec", "attention", "train", "qat"):
        assert (tmp_path / f"gpu_{name}.md").read_text().startswith("# ")

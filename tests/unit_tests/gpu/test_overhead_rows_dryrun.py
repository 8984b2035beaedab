"""bench/gpu/overhead_rows.py at toy size on the CPU (the overhead step of validate.sh --extra): its rows
(host reads per iteration of the Trainer, fused vs unfused optimizer step), and its --compile rows in
train.py's format."""
import os
import sys

from testlib import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench", "gpu"))

import overhead_rows  # noqa: E402
import pytest  # noqa: E402
import step_overhead  # noqa: E402  (overhead_rows put bench/ on the path)


@pytest.mark.slow  # its rows wrap step_overhead's count_reads / optimizer_times, which CI runs (bench --quick)
def test_rows_at_toy_size_on_cpu():
    import torch

    argv = step_overhead.flags(step_overhead.TOY, 10)
    reads = overhead_rows.host_read_row(argv, "toy", iters=7, log_interval=3)
    assert len(reads["per_iteration"]) == 7 and reads["ok"]
    assert reads["max_non_logging"] == 1 and reads["max_logging"] == 2, reads
    opt = overhead_rows.optimizer_row(argv, "toy", torch.device("cpu"), rounds=1, reps=1)
    assert opt["elements"] > 0 and opt["step_ms"] > 0 and opt["unfused_ms"] > 0
    for name, model, kind, extra in overhead_rows.COMPILE_ROWS:
        assert kind == "ours" and "--compile" in extra and model in ("350M", "1.3B") and name.startswith("ours")


@pytest.mark.slow  # Inductor compiles the toy model twice on the CPU (minutes on 2 shared cores)
def test_overhead_step_of_the_second_run(tmp_path):
    """``python overhead_rows.py --dry-run`` as ``validate.sh --extra`` runs it: every row in its JSON, the
    --compile rows beside the same rows without it, none failed (the packed-document row under --compile
    once failed: the attention custom op's fake strides)."""
    import json
    import subprocess

    out = tmp_path / "gpu_overhead.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, *sys.path]),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # cold, as validate.sh --dry-run
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu", "overhead_rows.py"), "--dry-run",
                           "--out", str(out), "--budget-s", "3000"], env=env, capture_output=True, text=True,
                          timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["row"]: r for r in data["rows"]}
    assert data["status"] == "ok" and not data["skipped"] and not any(r.get("error") for r in rows.values()), rows
    assert rows["host reads per iteration (ours)"]["ok"]
    compiled = [r for name, r in rows.items() if "--compile" in name]
    assert len(compiled) == 2 and all(r["vs_uncompiled"] > 0 for r in compiled)

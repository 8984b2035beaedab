"""bench/gpu/overhead_rows.py at toy size on the CPU: the rows it hands bench/gpu/train.py (host reads per
iteration of the Trainer, fused vs unfused optimizer step), and its --compile rows in train.py's format."""
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

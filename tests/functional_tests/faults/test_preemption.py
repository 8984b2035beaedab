"""SIGTERM / SIGUSR1 (Slurm preemption) make pretrain_gpt.py save a checkpoint and exit cleanly."""
import os
import signal
import subprocess
import sys

import pytest
from testlib import ROOT

from megatron_cai.training import checkpoint


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_and_exits(tmp_path, sig):
    save = str(tmp_path / "ckpt")
    cmd = [sys.executable, "pretrain_gpt.py", "--mock-data", "--vocab-size", "64", "--num-layers", "2",
           "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
           "--train-iters", "100000", "--log-interval", "1", "--eval-interval", "0", "--save", save]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "iteration        3/" in line:
            proc.send_signal(sig)
            break
    out, _ = proc.communicate(timeout=120)
    text = "".join(lines) + out
    assert proc.returncode == 0, text
    assert "exit signal received" in text
    saved = checkpoint.read_tracker(save)
    assert saved is not None and saved >= 3
    assert f"saved checkpoint at iteration {saved:7d}" in text

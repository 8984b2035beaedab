"""A start-up error always reaches the user, in one report.

Under torchrun every rank finds a bad flag; rank 0 prints the report and the other ranks wait before they exit
(training/errors.py, PEER_REPORT_GRACE_S), so torchrun's tear-down cannot stop rank 0 before it printed; a rank
that is not stopped prints the report itself. What the flags need from the machine (the NCCL backend, the
device, the files) is in the same report as the flag problems."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_cai.training import errors

ROOT = Path(__file__).resolve().parents[3]
BAD = ["--mock-data", "--vocab-size", "64", "--train-iters", "1", "--num-layer", "2", "--device", "cpu"]
# pretrain_gpt.py with rank 0 held back RANK0_DELAY seconds first: the race in which another rank exits first
_DELAYED = ("import os, runpy, sys, time\n"
            "if os.environ.get('RANK') == '0': time.sleep(float(os.environ['RANK0_DELAY']))\n"
            f"sys.argv = [{str(ROOT / 'pretrain_gpt.py')!r}, *sys.argv[1:]]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _launch(tmp_path: Path, argv: list[str], rank0_delay: float = 0.0, nproc: int = 4) -> subprocess.CompletedProcess:
    script = tmp_path / "delayed_pretrain.py"
    script.write_text(_DELAYED)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", RANK0_DELAY=str(rank0_delay),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(script), *argv], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)


def _reported(proc: subprocess.CompletedProcess) -> bool:
    out = proc.stdout + proc.stderr
    return "error: unknown flag --num-layer 2 (did you mean --num-layers?)" in out


def test_a_launch_reports_the_bad_flag(tmp_path):
    proc = _launch(tmp_path, BAD)
    assert proc.returncode != 0 and _reported(proc), proc.stderr[-3000:]


@pytest.mark.parametrize("delay", [2.0, pytest.param(3 * errors.PEER_REPORT_GRACE_S, marks=pytest.mark.slow)])
def test_the_report_survives_a_late_rank_0(tmp_path, delay):
    """Rank 0 reaches the error last: within the grace it prints before anyone exits (the other ranks exiting
    at once, torchrun would stop it first); later, a waiting rank prints the report itself before torchrun stops
    rank 0."""
    proc = _launch(tmp_path, BAD, rank0_delay=delay)
    assert proc.returncode != 0 and _reported(proc), proc.stderr[-3000:]


@pytest.mark.slow
def test_thirty_launches_at_four_ranks_all_report(tmp_path):
    missing = {}
    for i in range(30):
        proc = _launch(tmp_path, BAD)
        if not _reported(proc):
            missing[i] = (proc.returncode, (proc.stdout + proc.stderr)[-2000:])
    assert not missing, f"launches without the error line: {missing}"


@pytest.mark.skipif(dist.is_nccl_available(), reason="this PyTorch has NCCL")
def test_missing_nccl_and_two_bad_flags_in_one_report(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--mock-data", "--vocab-size", "64",
                           "--train-iters", "1", "--distributed-backend", "nccl", "--bogus-flag", "--num-layer", "2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "error: 3 flag problems, all listed here (nothing ran; --help lists the flags):"
    assert lines[1:] == ["  unknown   --bogus-flag", "  unknown   --num-layer 2 (did you mean --num-layers?)",
                         '  missing   --distributed-backend nccl: this PyTorch has no NCCL ("Distributed package '
                         "doesn't have NCCL built in\"); use --distributed-backend gloo, or leave it unset"]
    assert "Traceback" not in proc.stderr

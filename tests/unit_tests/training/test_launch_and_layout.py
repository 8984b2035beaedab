"""Rank discovery (torchrun / Slurm) and start-up validation of parallel layouts."""
import os
import subprocess
import sys

import pytest
from testlib import ROOT
from testlib.distributed import free_port

from megatron_cai.training.arguments import ArgumentError, parse_config
from megatron_cai.training.initialize import discover_env, first_slurm_host

MODEL = ["--squared-relu", "--mock-data", "--vocab-size", "50", "--num-layers", "2", "--hidden-size", "16",
         "--num-attention-heads", "2", "--seq-length", "8", "--train-iters", "2"]


def test_slurm_node_lists():
    assert first_slurm_host("gpu[03-05,07]") == "gpu03"
    assert first_slurm_host("node7,node9") == "node7"
    assert first_slurm_host("a-b[1-2],c[5]") == "a-b1"


def test_slurm_env_gives_ranks_and_master():
    env = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "4242"}
    got = discover_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size, got.source) == (5, 8, 1, 4, "slurm")
    assert env["MASTER_ADDR"] == "gpu03" and env["MASTER_PORT"] == str(20000 + 4242)


def test_torchrun_env_wins_and_contradiction_is_an_error():
    got = discover_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "SLURM_NTASKS": "1"})
    assert (got.rank, got.world_size, got.source) == (2, 4, "torchrun")
    with pytest.raises(RuntimeError, match="Slurm started 8 tasks but WORLD_SIZE=1"):
        discover_env({"RANK": "0", "WORLD_SIZE": "1", "SLURM_NTASKS": "8", "SLURM_PROCID": "0"})


@pytest.mark.parametrize("world,flags,needle", [
    (6, ["--tensor-model-parallel-size", "4"], "world size 6 is not divisible by tensor-model-parallel-size 4"),
    (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "6"], "num-layers 6 is not divisible"),
    (2, ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3"], "num-attention-heads 3"),
    (4, ["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups", "3",
         "--num-attention-heads", "12"], "num-query-groups 3"),
    (4, ["--micro-batch-size", "3", "--global-batch-size", "8"], "global-batch-size 8 is not divisible"),
])
def test_impossible_layouts_fail_with_one_message(world, flags, needle):
    argv = [a for a in MODEL if a != "--num-layers" and a != "2"] + ["--num-layers", "2"]
    argv = MODEL + flags
    with pytest.raises(ArgumentError, match=needle):
        parse_config(argv, world_size=world)


def test_srun_without_torchrun_forms_one_world(tmp_path):
    """Two tasks that only see Slurm variables join one world of 2 (no silent world-size-1 copies)."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update({"SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                    "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
        procs.append(subprocess.Popen([sys.executable, "pretrain_gpt.py", *MODEL, "--log-interval", "1",
                                       "--eval-interval", "0"],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert "DP=2" in outs[0]
    assert "iteration        2/       2" in outs[1]  # the last rank prints the Megatron log line

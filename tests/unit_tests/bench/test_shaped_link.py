"""bench/harness/shaped_link.spawn_ranks on the loopback (no namespaces, no root): every rank's output comes
back whole, however much one rank writes while another waits for it, and a stuck job is stopped.

A rank that logs every iteration writes far more than a pipe holds (64 KiB); read one rank after another, the
pipe of a later rank filled and blocked it in ``write`` while the earlier ranks waited for it in a collective
(bench/diloco.py hung that way). Here rank 1 writes 1 MiB before it lets rank 0 finish.
"""
from __future__ import annotations

import os
import sys
import time

import pytest
from testlib import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

from harness import shaped_link as link  # noqa: E402

CHATTY = """
import os, sys, time
rank, flag = int(os.environ["RANK"]), os.environ["MCAI_TEST_FLAG"]
if rank == 1:
    for i in range(1024):
        print(f"{i:07d}" + "x" * 1016, flush=True)  # 1 KiB a line, 1 MiB in all
    open(flag, "w").close()
else:
    deadline = time.monotonic() + float(os.environ["MCAI_TEST_WAIT_S"])
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            sys.exit("rank 1 never finished writing")
        time.sleep(0.05)
    print("rank 0 done")
"""


@pytest.fixture
def loopback():
    was = link.NETNS[0]
    link.use_namespaces(False)
    yield
    link.use_namespaces(was)


def test_a_rank_writing_more_than_a_pipe_holds_does_not_block_its_peers(loopback, tmp_path):
    env = {"MCAI_TEST_FLAG": str(tmp_path / "written"), "MCAI_TEST_WAIT_S": "30"}
    outs = link.spawn_ranks(["-c", CHATTY], per_ns=2, extra_env=env, namespaces=1, timeout=60)
    assert outs[0] == "rank 0 done\n"
    lines = outs[1].splitlines()
    assert len(lines) == 1024 and all(len(x) == 1023 for x in lines)
    assert [int(x[:7]) for x in lines] == list(range(1024))


def test_a_job_past_its_timeout_is_killed_and_named(loopback):
    start = time.monotonic()
    script = "import os, time; print('started', flush=True); time.sleep(60 if os.environ['RANK'] == '1' else 0)"
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] .* still ran after 3 s; killed:\nstarted"):
        link.spawn_ranks(["-c", script], per_ns=2, namespaces=1, timeout=3)
    assert time.monotonic() - start < 30


def test_a_failed_rank_is_named_with_its_output(loopback):
    script = "import os, sys; r = os.environ['RANK']; print('rank', r); sys.exit(3 if r == '1' else 0)"
    with pytest.raises(RuntimeError, match=r"rank 1 of -c .* failed:\nrank 1\n$"):
        link.spawn_ranks(["-c", script], per_ns=2, namespaces=1, timeout=60)

"""training.preemption.exit_signal (in this process, with real signals), the launch line and the torchrun
launcher's child lookup."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from megatron_cai.training.initialize import DistEnv, launch_line
from megatron_cai.training.preemption import exit_signal
from megatron_cai.training.preemption.torchrun import child_pids


@pytest.fixture
def clean():
    exit_signal.uninstall()
    yield
    exit_signal.uninstall()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, exit_signal.EXIT_SIGNALS)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_each_exit_signal_is_recorded_not_fatal_and_the_old_handler_comes_back(clean, sig):
    before = signal.getsignal(sig)
    assert exit_signal.install() and exit_signal.received() is None
    os.kill(os.getpid(), sig)  # SIGINT would raise KeyboardInterrupt here without the handler
    assert exit_signal.received() == sig.name
    os.kill(os.getpid(), signal.SIGUSR1)
    assert exit_signal.received() == sig.name, "the first signal is the one reported"
    exit_signal.uninstall()
    assert signal.getsignal(sig) is before and exit_signal.received() is None


def test_a_signal_left_pending_by_the_launcher_arrives_at_install(clean):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # as preemption.torchrun starts the workers
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # at this thread: pytest's others don't block it
    assert signal.SIGUSR1 in signal.sigpending()
    exit_signal.install()
    assert exit_signal.received() == "SIGUSR1" and signal.SIGUSR1 not in signal.sigpending()


def test_handling_installs_for_the_run_only_and_keeps_mains(clean):
    before = signal.getsignal(signal.SIGINT)
    with exit_signal.handling(True):
        assert exit_signal.installed()
    assert not exit_signal.installed() and signal.getsignal(signal.SIGINT) is before
    exit_signal.install()  # main installed it first: the run leaves it to main
    with exit_signal.handling(True):
        pass
    assert exit_signal.installed()
    with exit_signal.handling(False):  # --no-exit-signal-handler: the dispositions main found
        assert not exit_signal.installed() and signal.getsignal(signal.SIGINT) is before


def test_no_exit_signal_handler_re_raises_a_signal_recorded_before_the_flags(tmp_path):
    code = ("import os, signal\nfrom megatron_cai.training.preemption import exit_signal\nexit_signal.install()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\nwith exit_signal.handling(False):\n    print('survived')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == -signal.SIGUSR1 and "survived" not in proc.stdout


def test_launch_line_counts_nodes_and_names_the_rendezvous():
    env = DistEnv(rank=0, world_size=16, local_rank=0, local_world_size=8, source="torchrun")
    line = launch_line(env, 8, 2, environ={"MASTER_ADDR": "node01", "MASTER_PORT": "29501"})
    assert line.startswith(" > launch: torchrun, 16 rank(s) = 2 node(s) x 8 rank(s) per node, rendezvous "
                           "node01:29501; data-parallel groups of 8 rank(s) within a node x 2 across nodes")
    single = launch_line(DistEnv(0, 1, 0, 1, "single"), 1, 1, environ={})
    assert "1 rank(s) = 1 node(s) x 1 rank(s) per node, rendezvous none" in single


def test_child_pids_finds_a_child_and_only_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in child_pids(os.getpid())
        assert os.getpid() not in child_pids(child.pid)
    finally:
        child.kill()
        child.wait()

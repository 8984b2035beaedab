"""The real single-node Slurm (``slurm_cluster.py``) for ``tests/cluster``, started once per session.

Skipped, with the reason, where it cannot run: not root (the daemons and the jobs run as root), or the
packages missing (``bash tests/cluster/install.sh`` installs them, as root).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from .slurm_cluster import NODE, SlurmCluster, missing_binaries

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster runs its daemons and jobs as root; run as root")
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm test cluster: {', '.join(missing)} not installed; run `bash tests/cluster/install.sh` "
                    f"as root (Debian's slurm-wlm, slurmdbd, munge, mariadb-server)")
    try:
        socket.gethostbyname(NODE)
    except OSError:
        pytest.skip(f"Slurm test cluster: this host's name {NODE!r} does not resolve (the job scripts resolve node "
                    f"names); add it to /etc/hosts")
    c = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def checkout(tmp_path_factory) -> str:
    """A fresh copy of the repository's files (tracked, or new and not ignored): no logs/, no outputs."""
    dst = str(tmp_path_factory.mktemp("checkout"))
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src) and not os.path.islink(src):
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel))
    return dst


@pytest.fixture(scope="session")
def job_env(checkout) -> dict:
    """What a user's shell exports to sbatch: the venv's python first on PATH, the checkout's code."""
    return {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": checkout, "OMP_NUM_THREADS": "1"}

"""Process start-up: rank discovery (torchrun or Slurm), device, process groups and seeds.

A rank waiting for its peers at the rendezvous says so on stderr: world size, rank and master address,
every 30 s (``MEGATRON_CAI_WAIT_LOG_SECONDS`` changes the interval; tests use 1 s).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import device as device_mod
from ..core import parallel_state as ps
from ..core.tensor_parallel.random import model_parallel_manual_seed
from . import errors
from .config import ParallelConfig
from .errors import RankLocalError, safe_print
from .features.determinism import apply_deterministic_mode

DEFAULT_INTERVAL_S = 30.0
_HEARTBEAT_KEY = "megatron_cai/heartbeat/"


class Heartbeat:
    """A daemon thread writing this rank's wall-clock time into the rendezvous store every ``interval_s``.

    A rank stopped (SIGSTOP, a hung kernel, a dead node) stops writing; :meth:`silent_ranks` names the ranks
    whose last heartbeat is older than three intervals. The store lives in rank 0's process (or the
    torchrun agent): when it does not answer, that is said instead."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.interval_s = min(30.0, max(1.0, timeout_s / 4))
        self.store = dist.distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._beat()
        self.thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        self.store.set(f"{_HEARTBEAT_KEY}{self.rank}", repr(time.time()))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 exited): nothing left to tell
                return

    def stop(self) -> None:
        self._stop.set()

    def silent_ranks(self) -> tuple[list[int], float] | None:
        """(ranks with no heartbeat for three intervals, the longest silence in s); None when the store
        does not answer."""
        try:
            self.store.set_timeout(datetime.timedelta(seconds=max(5.0, 2 * self.interval_s)))
            keys = [f"{_HEARTBEAT_KEY}{r}" for r in range(self.world_size)]
            beats = [float(v.decode()) for v in self.store.multi_get(keys)]
        except Exception:  # noqa: BLE001 - a timed-out or closed store
            return None
        now = time.time()
        ages = {r: now - t for r, t in enumerate(beats) if r != self.rank}
        silent = sorted(r for r, age in ages.items() if age > 3 * self.interval_s)
        return silent, max((ages[r] for r in silent), default=0.0)


_heartbeat: Heartbeat | None = None


def silent_ranks_line() -> str:
    """Which rank stopped answering, as far as the heartbeats tell (for the error of a timed-out collective)."""
    if _heartbeat is None:
        return "the rank that stopped answering is not known"
    found = _heartbeat.silent_ranks()
    if found is None:
        return "rank 0, which holds the rendezvous store, does not answer either: it is probably the one stopped"
    silent, age = found
    if not silent:
        return "every rank's heartbeat is recent: a rank is alive but stuck outside the collective"
    return f"rank(s) {', '.join(map(str, silent))} stopped answering (no heartbeat for {age:.0f} s)"


def waiting_line(rank: int, world_size: int, waited_s: float, environ=None) -> str:
    env = os.environ if environ is None else environ
    master = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    return (f" [rank {rank}] waiting for the other ranks to join: world size {world_size}, rank {rank}, "
            f"master address {master} ({waited_s:.0f} s so far)")


@contextlib.contextmanager
def log_while_waiting(rank: int, world_size: int, interval_s: float | None = None) -> Iterator[None]:
    """Log ``waiting_line`` every ``interval_s`` seconds on stderr until the block finishes."""
    if interval_s is None:
        interval_s = float(os.environ.get("MEGATRON_CAI_WAIT_LOG_SECONDS", DEFAULT_INTERVAL_S))
    stop = threading.Event()
    start = time.time()

    def loop() -> None:
        while not stop.wait(interval_s):
            safe_print(waiting_line(rank, world_size, time.time() - start), file=sys.stderr)

    thread = threading.Thread(target=loop, name="rendezvous-log", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class LaunchEnvError(RankLocalError):
    """A launcher variable (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) that cannot be used as given.

    Found before the ranks have met, so each process reports it itself (``[rank R]`` where the rank is known)."""


def _env_int(env, name: str, low: int, high: int | None = None) -> int:
    """``env[name]`` as an integer in ``[low, high)``, else one LaunchEnvError naming the variable."""
    text = env[name]
    value = int(text) if re.fullmatch(r"\s*\d+\s*", text) else None
    if value is None or value < low or (high is not None and value >= high):
        bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high})"
        raise LaunchEnvError(f"environment variable {name}={text!r} is not {bound} (set by torchrun / srun, "
                             f"or by hand)")
    return value


def check_rendezvous_env(environ=None) -> tuple[str, int]:
    """MASTER_ADDR (a name that resolves) and MASTER_PORT (1..65535) of a multi-rank job, or one
    LaunchEnvError naming the variable."""
    env = os.environ if environ is None else environ
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name, "").strip():
            raise LaunchEnvError(f"environment variable {name} is not set: a job of several ranks needs the "
                                 f"address and port of rank 0 (torchrun and srun set them)")
    port = _env_int(env, "MASTER_PORT", 1, 65536)
    addr = env["MASTER_ADDR"].strip()
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise LaunchEnvError(f"environment variable MASTER_ADDR={addr!r} does not resolve to an address "
                             f"({e}); set it to rank 0's host name or IP address") from None
    return addr, port


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str  # "torchrun", "slurm" or "single"


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list such as ``gpu[03-05,07],cpu1``."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 check=True, timeout=30).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _tasks_on_this_node(tasks_per_node: str, node_id: int) -> int:
    """Parse SLURM_TASKS_PER_NODE (e.g. ``4(x2),3``) for the given node index."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"cannot parse SLURM_TASKS_PER_NODE {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[min(node_id, len(counts) - 1)]


def discover_env(environ: dict | None = None) -> DistEnv:
    """Rank and world size from torchrun (RANK/WORLD_SIZE) or Slurm (SLURM_PROCID/SLURM_NTASKS).

    Under ``srun python pretrain_gpt.py`` with several tasks, the Slurm variables are used and
    MASTER_ADDR/MASTER_PORT are derived from the job, so N tasks never silently run N copies of a
    world of one. Inconsistent settings are an error.
    """
    env = os.environ if environ is None else environ
    ntasks = _env_int(env, "SLURM_NTASKS", 1) if "SLURM_NTASKS" in env else 1
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _env_int(env, "WORLD_SIZE", 1)
        rank = _env_int(env, "RANK", 0, world)
        if world == 1 and ntasks > 1 and int(env.get("SLURM_STEP_NUM_TASKS", ntasks)) > 1:
            raise LaunchEnvError(f"Slurm started {ntasks} tasks but WORLD_SIZE=1: each task would train alone. "
                               "Unset RANK/WORLD_SIZE to take ranks from Slurm, or launch one torchrun per node")
        local_world = _env_int(env, "LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in env else world
        local_rank = _env_int(env, "LOCAL_RANK", 0) if "LOCAL_RANK" in env else 0
        return DistEnv(rank, world, local_rank, local_world, "torchrun" if world > 1 else "single")
    if ntasks > 1:
        if "SLURM_PROCID" not in env:
            raise LaunchEnvError("SLURM_NTASKS > 1 but SLURM_PROCID is not set: launch with srun")
        rank = _env_int(env, "SLURM_PROCID", 0, ntasks)
        local_rank = int(env.get("SLURM_LOCALID", 0))
        node_id = int(env.get("SLURM_NODEID", 0))
        local_world = (_tasks_on_this_node(env["SLURM_TASKS_PER_NODE"], node_id)
                       if "SLURM_TASKS_PER_NODE" in env else ntasks)
        if "MASTER_ADDR" not in env:
            env["MASTER_ADDR"] = first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        if "MASTER_PORT" not in env:
            env["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return DistEnv(rank, ntasks, local_rank, local_world, "slurm")
    return DistEnv(0, 1, 0, 1, "single")


def initialize_distributed(parallel: ParallelConfig, seed: int, env: DistEnv | None = None, islands: int = 1
                           ) -> tuple[DistEnv, torch.device]:
    """Start torch.distributed (gloo on CPU, NCCL on CUDA), create TP/CP/DP/PP groups, seed RNGs.

    ``parallel`` must have been built for this job's world size (see ``arguments.rebuild_for_world_size``).
    """
    env = env or discover_env()
    if env.world_size != parallel.world_size:
        raise RuntimeError(f"the configuration was built for {parallel.world_size} ranks but this job has "
                           f"{env.world_size} ({env.source}); rebuild it for the job's world size")
    device = device_mod.resolve_device(parallel.device, env.local_rank)
    if parallel.deterministic_mode:  # before the first NCCL communicator and cuBLAS handle
        apply_deterministic_mode(os.environ)
    if env.world_size > 1 and not dist.is_initialized():
        check_rendezvous_env()
        backend = parallel.distributed_backend or device_mod.backend_for(device)
        with log_while_waiting(env.rank, env.world_size):  # a rank waiting for its peers says so
            dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                    timeout=datetime.timedelta(minutes=parallel.distributed_timeout_minutes))
        global _heartbeat
        if _heartbeat is not None:
            _heartbeat.stop()
        _heartbeat = Heartbeat(env.rank, env.world_size, parallel.distributed_timeout_minutes * 60)
        errors.timeout_diagnosis = silent_ranks_line
    tp, pp, vpp = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                   parallel.virtual_pipeline_model_parallel_size)
    rpn = parallel.ranks_per_node
    if rpn is None and env.local_world_size < env.world_size:
        rpn = env.local_world_size
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    cp = parallel.context_parallel_size
    order = ps.TP_PP_DP_ORDER if parallel.use_tp_pp_dp_mapping else ps.DEFAULT_ORDER  # --use-tp-pp-dp-mapping
    experts = dict(expert_model_parallel_size=parallel.expert_model_parallel_size,
                   expert_tensor_parallel_size=parallel.expert_tensor_parallel_size)
    try:
        ps.initialize_model_parallel(tp, pp, vpp, ranks_per_node=rpn, context_parallel_size=cp, timeout=timeout,
                                     islands=islands, order=order, **experts)
    except ps.ParallelLayoutError:
        if parallel.ranks_per_node is not None:
            raise
        # The launcher's node size does not fit the layout: treat the job as one node.
        ps.initialize_model_parallel(tp, pp, vpp, context_parallel_size=cp, timeout=timeout, islands=islands,
                                     order=order, **experts)
    model_parallel_manual_seed(seed, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), device)
    if env.rank == 0:
        safe_print(launch_line(env, ps.get_data_parallel_intra_node_world_size(),
                               ps.get_data_parallel_inter_node_world_size()))
    return env, device


def launch_line(env: DistEnv, dp_intra: int, dp_inter: int, environ=None) -> str:
    """The start-up facts as discovered: launcher, ranks, nodes x ranks per node, the rendezvous address, and
    the data-parallel split that ``--squinch-hierarchical`` uses (uncompressed within a node, Squinch across)."""
    e = os.environ if environ is None else environ
    nodes = max(env.world_size // max(env.local_world_size, 1), 1)
    rendezvous = f"{e['MASTER_ADDR']}:{e['MASTER_PORT']}" if "MASTER_ADDR" in e and "MASTER_PORT" in e else "none"
    return (f" > launch: {env.source}, {env.world_size} rank(s) = {nodes} node(s) x {env.local_world_size} "
            f"rank(s) per node, rendezvous {rendezvous}; data-parallel groups of {dp_intra} rank(s) within a node "
            f"x {dp_inter} across nodes (--squinch-hierarchical reduces uncompressed within, Squinch across)")

"""A real single-node Slurm for the tests: MariaDB, munged, slurmdbd, slurmctld and slurmd from Debian's packages.

Everything lives in one directory (configuration, state, spool, logs, the munge key and socket, the
database) and every daemon runs in the foreground as a child of the test process, in a session of its
own, on ports chosen free at start. ``stop()`` ends each daemon by its PID (SIGTERM, then SIGKILL after
a grace period), in the reverse order of start. Clients (``sbatch``, ``scancel``, ``sacct``) find the
cluster through ``SLURM_CONF`` in :meth:`SlurmCluster.env`.

The node declares more CPUs than the machine has (``SlurmdParameters=config_overrides``), so two jobs
fit on it at once, as two jobs sharing a node of a real cluster. ``UnkillableStepTimeout`` is 300 s, not
Slurm's 60: on a loaded machine a cancelled torchrun step once took 70 s to end after its SIGKILL, and
Slurm then drains the node ("Kill task failed"), which stalls every later test.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

DAEMONS = ("mariadbd", "mariadb-install-db", "munged", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct")
NODE = socket.gethostname().split(".")[0]  # the node is this host, by its name (the scripts resolve node names)
NODE_CPUS = 8
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE")


def missing_binaries() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not os.path.exists(f"/usr/sbin/{name}")]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class JobEnd:
    """A job's final record as ``sacct`` reports it (the allocation line, ``-X``)."""
    job_id: str
    state: str       # COMPLETED, FAILED, CANCELLED, TIMEOUT, ... ("CANCELLED by 0" is reported as CANCELLED)
    exit_code: str   # "status:signal", as sacct prints it

    @property
    def row(self) -> str:
        return f"{self.state} {self.exit_code}"


def _end_with_parent() -> None:
    """In a daemon's child before exec: SIGTERM when the test process dies (even by SIGKILL, when no ``finally``
    runs), so no daemon of the test cluster outlives its test run (Linux ``PR_SET_PDEATHSIG``)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


@dataclass
class SlurmCluster:
    root: str
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------------------------------------ paths
    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    @property
    def conf(self) -> str:
        return self.path("etc", "slurm.conf")

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        for key in [k for k in env if k.startswith("SLURM_")]:
            del env[key]
        env["SLURM_CONF"] = self.conf
        return env

    # ------------------------------------------------------------------------------------------ start
    def start(self, timeout: float = 120.0) -> None:
        for d in ("etc", "state", "spool", "log", "run", "db", "munge"):
            os.makedirs(self.path(d), mode=0o700, exist_ok=True)
        self.ports = {name: _free_port() for name in ("mysql", "dbd", "ctld", "slurmd")}
        self._write_configs()
        deadline = time.time() + timeout
        self._start_mariadb(deadline)
        self._start_munged(deadline)
        self._spawn("slurmdbd", [_binary("slurmdbd"), "-D"])
        self._wait(lambda: self._port_open(self.ports["dbd"]), "slurmdbd listening", deadline)
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i"])
        self._wait(lambda: self._run(["scontrol", "ping"]).stdout.count("UP") > 0, "slurmctld answering", deadline)
        self._spawn("slurmd", [_binary("slurmd"), "-D", "-N", NODE])
        self._wait(self._node_ready, f"node {NODE} idle", deadline)

    def _write_configs(self) -> None:
        host = NODE
        munge = f"socket={self.path('munge', 'munge.socket')}"
        slurm_conf = f"""\
ClusterName=mcai
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={self.ports['ctld']}
SlurmdPort={self.ports['slurmd']}
AuthType=auth/munge
AuthInfo={munge}
CredType=cred/munge
StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool')}
SlurmctldPidFile={self.path('run', 'slurmctld.pid')}
SlurmdPidFile={self.path('run', 'slurmd.pid')}
SlurmctldLogFile={self.path('log', 'slurmctld.log')}
SlurmdLogFile={self.path('log', 'slurmd.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.ports['dbd']}
AccountingStoragePass={self.path('munge', 'munge.socket')}
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=10
UnkillableStepTimeout=300
MinJobAge=3600
InactiveLimit=0
PlugStackConfig={self.path('etc', 'plugstack.conf')}
NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""
        dbd_conf = f"""\
AuthType=auth/munge
AuthInfo={munge}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={self.ports['dbd']}
SlurmUser=root
LogFile={self.path('log', 'slurmdbd.log')}
PidFile={self.path('run', 'slurmdbd.pid')}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.ports['mysql']}
StorageUser=root
StorageLoc=slurm_acct_db
"""
        for name, text in (("slurm.conf", slurm_conf), ("slurmdbd.conf", dbd_conf), ("plugstack.conf", "")):
            with open(self.path("etc", name), "w") as f:
                f.write(text)
        os.chmod(self.path("etc", "slurmdbd.conf"), 0o600)

    def _start_mariadb(self, deadline: float) -> None:
        datadir = self.path("db")
        subprocess.run([_binary("mariadb-install-db"), "--no-defaults", f"--datadir={datadir}", "--user=root",
                        "--auth-root-authentication-method=normal", "--skip-test-db"],
                       check=True, capture_output=True, timeout=max(10.0, deadline - time.time()))
        self._spawn("mariadbd", [_binary("mariadbd"), "--no-defaults", f"--datadir={datadir}", "--user=root",
                                 f"--socket={self.path('run', 'mysqld.sock')}", f"--port={self.ports['mysql']}",
                                 "--bind-address=127.0.0.1", "--skip-grant-tables", "--skip-log-bin",
                                 f"--pid-file={self.path('run', 'mysqld.pid')}",
                                 f"--log-error={self.path('log', 'mariadb.log')}"])
        self._wait(lambda: self._port_open(self.ports["mysql"]), "MariaDB listening", deadline)

    def _start_munged(self, deadline: float) -> None:
        key = self.path("munge", "munge.key")
        if not os.path.exists(key):
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o400)
        self._spawn("munged", [_binary("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.path('munge', 'munge.socket')}",
                               f"--pid-file={self.path('run', 'munged.pid')}",
                               f"--log-file={self.path('log', 'munged.log')}",
                               f"--seed-file={self.path('munge', 'munge.seed')}"])
        self._wait(lambda: os.path.exists(self.path("munge", "munge.socket")), "munged's socket", deadline)

    def _spawn(self, name: str, argv: list[str]) -> None:
        """Start a daemon in the foreground; it gets SIGTERM if this process dies without :meth:`stop`."""
        log = open(self.path("log", f"{name}.stdout"), "ab")  # noqa: SIM115 - kept open for the daemon's life
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env(), start_new_session=True, preexec_fn=_end_with_parent)
        self.procs.append((name, proc))

    def _wait(self, ready, what: str, deadline: float) -> None:
        while time.time() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                                       f"{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"Slurm test cluster: no {what} in time\n{self.logs()}")

    def _port_open(self, port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _node_ready(self) -> bool:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
        return len(out) == 2 and out[1] in ("idle", "mix", "alloc")

    def logs(self, tail: int = 30) -> str:
        parts = []
        for name in sorted(os.listdir(self.path("log"))):
            with open(self.path("log", name), errors="replace") as f:
                lines = f.read().splitlines()[-tail:]
            parts.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # ------------------------------------------------------------------------------------------ stop
    def stop(self, grace: float = 15.0) -> None:
        """Cancel every job still queued or running (slurmstepd outlives slurmd), then end every daemon started
        here, by PID, newest first."""
        if any(name == "slurmd" and proc.poll() is None for name, proc in self.procs):
            jobs = self._run(["squeue", "-h", "-o", "%A"]).stdout.split()
            if jobs:
                self._run(["scancel", *jobs])
                deadline = time.time() + 60
                while self._run(["squeue", "-h", "-o", "%A"]).stdout.split() and time.time() < deadline:
                    time.sleep(0.5)
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()

    @property
    def node(self) -> str:
        return NODE

    # ------------------------------------------------------------------------------------------ clients
    def _run(self, argv: list[str], timeout: float = 30.0, check: bool = False, **kwargs):
        return subprocess.run(argv, env=kwargs.pop("env", None) or self.env(), capture_output=True, text=True,
                              timeout=timeout, check=check, **kwargs)

    def sbatch(self, argv: list[str], cwd: str, env: dict | None = None) -> str:
        out = self._run(["sbatch", "--parsable", *argv], cwd=cwd, env=self.env(env), check=True).stdout
        return out.strip().split(";")[0]

    def scancel(self, *argv: str) -> None:
        self._run(["scancel", *argv], check=True)

    def scontrol(self, *argv: str) -> str:
        return self._run(["scontrol", *argv], check=True).stdout

    def requeue(self, job_id: str) -> None:
        """``scontrol requeue``, then the start 3 s on instead of Slurm's 2 minutes (a start within the second of the
        requeue is refused: "Job credential revoked")."""
        self.scontrol("requeue", job_id)
        deadline = time.time() + 120
        while self.scontrol_state(job_id) != "PENDING" and time.time() < deadline:
            time.sleep(0.3)
        self.scontrol("update", f"JobId={job_id}", "StartTime=now+3")

    def squeue_state(self, job_id: str) -> str | None:
        """The job's state as the controller knows it now (None once it has left the queue)."""
        out = self._run(["squeue", "-h", "-j", job_id, "-o", "%T"]).stdout.strip()
        return out or None

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.scontrol_state(job_id)
            if state in states:
                return state
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout} s (state {state})\n{self.logs()}")

    def wait_step(self, job_id: str, timeout: float) -> None:
        """Wait until the job's first ``srun`` step has a task running on the node (``scontrol listpids``).
        ``scancel --signal`` reaches only the tasks of steps that run when it is sent (the batch shell only with
        ``--full``): one sent before that is lost and the job goes on. The step is listed by ``squeue -s`` as
        soon as ``srun`` asks for it, before slurmstepd has started its tasks: a signal in between is lost too
        (measured: 58 ms after the launch request)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            rows = [line.split() for line in self._run(["scontrol", "listpids", f"{job_id}.0"]).stdout.splitlines()]
            if any(row[1:3] == [job_id, "0"] for row in rows[1:]):  # PID JOBID STEPID LOCALID GLOBALID
                return
            time.sleep(0.1)
        raise TimeoutError(f"job {job_id}: no task of step {job_id}.0 after {timeout} s\n{self.logs()}")

    def scontrol_state(self, job_id: str) -> str:
        out = self._run(["scontrol", "show", "job", job_id]).stdout
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else "UNKNOWN"

    def wait_end(self, job_id: str, timeout: float) -> JobEnd:
        """Wait for the job to end, then its final record from the accounting database."""
        self.wait_state(job_id, TERMINAL_STATES, timeout)
        deadline = time.time() + 30
        while True:  # the controller hands the record to slurmdbd shortly after the job ends
            out = self._run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobID,State,ExitCode"]).stdout
            rows = [line.split("|") for line in out.splitlines() if line.startswith(job_id + "|")]
            if rows and rows[-1][1].split()[0] in TERMINAL_STATES:
                return JobEnd(job_id, rows[-1][1].split()[0], rows[-1][2])
            if time.time() > deadline:
                raise TimeoutError(f"sacct has no final record of job {job_id}: {out!r}\n{self.logs()}")
            time.sleep(0.5)

    def elapsed_seconds(self, job_id: str) -> int:
        out = self._run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "ElapsedRaw"]).stdout.split()
        return int(out[-1])

    def sacct_all_starts(self, job_id: str) -> list[str]:
        """Every start of a requeued job (``sacct -D``): "STATE EXIT" per start, oldest first."""
        out = self._run(["sacct", "-n", "-X", "-P", "-D", "-j", job_id, "-o", "State,ExitCode"]).stdout
        return [" ".join(line.split("|")) for line in out.splitlines() if line]

"""A real shaped link between two "hosts" on one machine, and the bookkeeping of runs over it.

Two network namespaces joined by a veth pair, shaped with ``tc tbf`` (burst 64kb) both ways or left
unshaped; a job runs with its ranks split over the two namespaces (gloo over the link), so the link is
the "inter-host" network and the loopback inside a namespace the "intra-host" one. Shared by
``squinch_bandwidth.py`` (training runs), ``squinch_phases.py`` (collectives alone) and
``squinch_scale.py`` (the model's validation). Needs root and iproute2 (``ip netns``, ``tc``), except
with ``use_namespaces(False)`` (the benches' ``--no-netns``, and ``--quick``): then every rank runs on this
host's loopback, nothing is shaped, and a link's name says "loopback".

- ``setup_link(rate_mbit)`` / ``teardown_link()``: the namespaces and the shaping;
- ``spawn_ranks(argv, per_ns, env)``: one process per rank, ``per_ns`` ranks in each namespace;
- ``run_job(flags, per_ns, steps, warmup)``: one pretrain_gpt.py run, its median steady step time;
- ``alternate(configs, per_ns, opts)``: every configuration ``opts.repeats`` times, alternating;
- ``RowCache``: finished rows of one run id on disk, so that a long run resumes where it stopped.
"""
from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from harness.flags import BENCH
from harness.results import load_line

ROOT = os.path.dirname(BENCH)
NS = (("mcaiA", "mcaiA0", "10.211.0.1"), ("mcaiB", "mcaiB0", "10.211.0.2"))
STEP_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
BYTES_RE = re.compile(r"grad comm bytes: ([0-9]+)")
PHASE_RE = re.compile(r"^    ([a-z -]+?) \.+: ([0-9.]+)$", re.M)


NETNS = [True]  # False: every rank on this host's loopback, no shaping (use_namespaces)


def use_namespaces(on: bool) -> None:
    """Run the ranks in the two namespaces (True), or all on this host's loopback, unshaped (False)."""
    NETNS[0] = on


def load() -> str:
    return load_line()


# ----------------------------------------------------------------------------------------- the link
def _sh(cmd: str) -> None:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"`{cmd}` failed: {r.stderr.strip()}")


def teardown_link() -> None:
    if not NETNS[0]:
        return
    for ns, _, _ in NS:
        subprocess.run(f"ip netns del {ns}", shell=True, capture_output=True)


def setup_link(rate_mbit: float | None) -> None:
    """Two namespaces joined by a veth pair; shaped to rate_mbit both ways (None: unshaped)."""
    teardown_link()
    if not NETNS[0]:
        return
    (a, da, ipa), (b, db, ipb) = NS
    for c in (f"ip netns add {a}", f"ip netns add {b}", f"ip link add {da} type veth peer name {db}",
              f"ip link set {da} netns {a}", f"ip link set {db} netns {b}",
              f"ip -n {a} addr add {ipa}/24 dev {da}", f"ip -n {b} addr add {ipb}/24 dev {db}",
              f"ip -n {a} link set {da} up", f"ip -n {b} link set {db} up",
              f"ip -n {a} link set lo up", f"ip -n {b} link set lo up"):
        _sh(c)
    if rate_mbit is not None:
        for ns, dev, _ in NS:
            _sh(f"ip netns exec {ns} tc qdisc add dev {dev} root tbf rate {rate_mbit}mbit burst 64kb latency 2000ms")


def link_name(rate) -> str:
    if not NETNS[0]:
        return "loopback"
    return "unshaped veth" if rate is None else f"{rate:g} Mbit/s"


def rate_key(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g}"  # 1000 and 1000.0 (from the command line) alike


class _Ports:
    """A port for each job's store: one the kernel says is free now (a fixed sequence collided with another bench
    or test running at the same time: a rank then joined the other job's store and waited there)."""

    def next(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]


PORTS = _Ports()


def spawn_ranks(argv: list[str], per_ns: int, extra_env: dict | None = None, *, namespaces: int = 2,
                timeout: float = 3600) -> list[str]:
    """Run ``python argv...`` as ``namespaces * per_ns`` ranks (torch.distributed env variables set;
    ranks [k*per_ns, (k+1)*per_ns) in namespace k, gloo bound to its veth end). Returns every rank's
    output; raises naming the first rank that failed. ``namespaces=1``: every rank in the first one
    (their traffic stays on its loopback).

    Each rank writes to its own file, never to a pipe: a pipe read one rank after another fills (64 KiB)
    under a rank that logs every iteration, which then blocks in ``write`` outside the collective its peers
    wait in. Past ``timeout`` every rank still running is killed and the job raises."""
    world, port, procs, stuck = namespaces * per_ns, PORTS.next(), [], []
    with tempfile.TemporaryDirectory(prefix="mcai_ranks_") as tmp:
        logs = [open(os.path.join(tmp, f"rank{rank}.log"), "w+") for rank in range(world)]
        try:
            for rank in range(world):
                procs.append(_start_rank(argv, rank, world, per_ns, port, extra_env, logs[rank]))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            stuck = [i for i, p in enumerate(procs) if p.poll() is None]
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            outs = []
            for f in logs:
                f.seek(0)
                outs.append(f.read())
                f.close()
    if stuck:
        raise RuntimeError(f"rank(s) {stuck} of {' '.join(argv)} still ran after {timeout:g} s; killed:\n"
                           f"{outs[stuck[0]][-3000:]}")
    if any(p.returncode for p in procs):
        bad = next(i for i, p in enumerate(procs) if p.returncode)
        raise RuntimeError(f"rank {bad} of {' '.join(argv)} failed:\n{outs[bad][-3000:]}")
    return outs


def _start_rank(argv: list[str], rank: int, world: int, per_ns: int, port: int, extra_env: dict | None,
                log) -> subprocess.Popen:
    ns, dev, _ = NS[rank // per_ns]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "LOCAL", "MASTER"))}
    netns = NETNS[0]
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_ns),
                "LOCAL_WORLD_SIZE": str(per_ns), "MASTER_ADDR": NS[0][2] if netns else "127.0.0.1",
                "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": dev if netns else "lo", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": ROOT, **(extra_env or {})})
    prefix = ["ip", "netns", "exec", ns] if netns else []
    return subprocess.Popen([*prefix, sys.executable, *argv], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True)


COMMON = ["--mock-data", "--micro-batch-size", "4", "--global-batch-size", "8", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--eval-interval", "0", "--eval-iters", "0", "--lr", "1e-3",
          "--vocab-size", "2000", "--seq-length", "128", "--log-interval", "1",
          "--position-embedding-type", "rope", "--lr-decay-style", "cosine", "--num-workers", "0"]


def run_job(flags: list[str], per_ns: int, steps: int, warmup: int, extra_env: dict | None = None) -> dict:
    """One pretrain_gpt run, `per_ns` ranks in each namespace. Returns the median steady step time (s),
    the per-iteration times, the gradient bytes per step, the parsed phase lines (if any) and the last
    rank's log."""
    outs = spawn_ranks(["pretrain_gpt.py", *COMMON, *flags, "--train-iters", str(warmup + steps)], per_ns, extra_env)
    log = outs[-1]
    ms = [float(x) for x in STEP_RE.findall(log)][warmup:]
    if len(ms) < steps:
        raise RuntimeError(f"expected {steps} steady iterations, parsed {len(ms)}:\n{log[-2000:]}")
    phases: dict[str, list[float]] = {}
    for block in log.split("gradient reduction phases")[1 + warmup:]:
        for name, v in PHASE_RE.findall(block.split("\n iteration")[0]):
            phases.setdefault(name, []).append(float(v))
    nbytes = [int(x) for x in BYTES_RE.findall(log)]
    return {"step_s": statistics.median(ms) / 1000.0, "steps_ms": ms, "bytes": nbytes[-1] if nbytes else 0,
            "phases_ms": {k: statistics.median(v) for k, v in phases.items()}, "log": log}


WAIT_ENV = {"MEGATRON_CAI_SQUINCH_EARLY_STAGES": "0"}  # "before": later stages only in wait()


def alternate(configs: dict[str, list[str]], per_ns: int, opts, env: dict[str, dict] | None = None) -> dict:
    """Run every configuration opts.repeats times, alternating between them; summarise each.
    A label ending in "_wait" runs with the reducer's early stages switched off; ``env`` adds
    environment variables per label."""
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for _ in range(opts.repeats):
        for label, flags in configs.items():
            extra = {**(WAIT_ENV if label.endswith("_wait") else {}), **((env or {}).get(label, {}))}
            runs[label].append(run_job(flags, per_ns, opts.steps, opts.warmup, extra or None))
    return {label: summary(rs) for label, rs in runs.items()}


def summary(rs: list[dict]) -> dict:
    t = [r["step_s"] for r in rs]
    med = statistics.median(t)
    return {"median_s": med, "min_s": min(t), "max_s": max(t), "spread": (max(t) - min(t)) / med, "runs_s": t,
            "bytes": rs[-1]["bytes"], "phases_ms": rs[len(rs) // 2]["phases_ms"]}


def paired_ratio(res: dict, num: str, den: str) -> dict:
    pairs = [a / b for a, b in zip(res[num]["runs_s"], res[den]["runs_s"])]
    return {"ratio": res[num]["median_s"] / res[den]["median_s"], "min": min(pairs), "max": max(pairs)}


class RowCache:
    """Finished configuration rows of one run id, on disk, so that a long run can resume.

    A row's key names what it measured (part, model size, link rate, overlap, ...); the configurations
    of a row alternate within it, so rows measured in different quiet windows (or with other subsets)
    combine into one run. Rows measured with other ``settings`` are not reused."""

    def __init__(self, path: str, settings: dict, fresh: bool) -> None:
        self.path, self.settings = path, json.dumps(settings, sort_keys=True)
        self.rows: dict = {}
        self.spent: list[float] = []  # wall seconds of each earlier invocation that finished this run
        if os.path.exists(path) and not fresh:
            with open(path) as f:
                saved = json.load(f)
            if saved.get("settings") == self.settings:
                self.rows, self.spent = saved["rows"], saved.get("spent_s", [])
                print(f"resuming: {len(self.rows)} finished row(s) from {path}", flush=True)

    def get(self, key: str, compute):
        if key not in self.rows:
            self.rows[key] = compute()
            self.save()
        return self.rows[key]

    def save(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path + ".tmp", "w") as f:
            json.dump({"settings": self.settings, "rows": self.rows, "spent_s": self.spent}, f)
        os.replace(self.path + ".tmp", self.path)


def drift_lines(a: dict[str, float], b: dict[str, float], limit: float) -> list[str]:
    """Two runs' ratios side by side; the ones that moved by more than ``limit`` start with 'DRIFT'."""
    lines = []
    for name in sorted(set(a) & set(b)):
        drift = abs(b[name] / a[name] - 1)
        lines.append(f"{'DRIFT' if drift > limit else 'ok'} {name}: {a[name]:.3f} -> {b[name]:.3f} "
                     f"({100 * drift:.1f}%)")
    return lines + [f"DRIFT {name}: in one run only" for name in sorted(set(a) ^ set(b))]

"""Shared helpers of the GPU validation steps (bench/gpu/validate.sh): flags, timing, budgets, results.

Every step takes ``--dry-run`` (toy sizes on the CPU, Triton under the interpreter) and ``--out PREFIX``,
prints a table and writes ``PREFIX.json`` / ``PREFIX.md``. ``--budget-s`` bounds the step's own time:
configurations that would start after the budget is spent are recorded as skipped, never silently lost.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_cai.core import device as dev  # noqa: E402


def parser(description: str, default_out: str, budget_s: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (Triton interpreter)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", default_out), help="output prefix")
    p.add_argument("--budget-s", type=float, default=budget_s, help="time budget of this step (s)")
    return p


def pick_device(dry_run: bool) -> torch.device:
    """CUDA for the real run (a clear error without one), the CPU for --dry-run."""
    if dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry-run needs TRITON_INTERPRET=1 (validate.sh sets it)")
        return torch.device("cpu")
    if not dev.cuda_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU machine")
    return dev.resolve_device("cuda")


class Budget:
    """Wall-clock budget of one step: ``left()`` seconds remain; ``skip(name)`` records a skipped item."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, name: str, need_s: float) -> bool:
        if self.left() >= need_s:
            return True
        self.skipped.append(name)
        print(f"  skipped (time budget): {name}", flush=True)
        return False


def time_fn(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 1) -> dict:
    """Median and spread of `reps` timed calls after `warmup` calls (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    dev.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = dev.new_timing_event(device), dev.new_timing_event(device)
        t0 = time.perf_counter()
        if start is not None:
            start.record()
        fn()
        if end is not None:
            end.record()
        dev.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3 if start is not None else time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "reps": reps}


def environment(device: torch.device) -> dict:
    return {"device": dev.device_name(device), "capability": dev.device_capability(device),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(prefix: str, title: str, payload: dict, table: str) -> None:
    """Print the table and write PREFIX.json and PREFIX.md."""
    print(table, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    env = payload.get("environment", {})
    skipped = payload.get("skipped") or []
    with open(prefix + ".md", "w") as f:
        dry = ", DRY RUN (toy sizes, CPU)" if payload.get("dry_run") else ""
        f.write(f"# {title}\n\n{env.get('device', '?')} (sm_{env.get('capability', '?')}), torch "
                f"{env.get('torch', '?')}, {env.get('date', '')}{dry}\n\n{table}\n")
        if skipped:
            f.write("\nSkipped (time budget): " + ", ".join(skipped) + "\n")

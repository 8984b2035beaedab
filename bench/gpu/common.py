"""Shared helpers of the GPU validation steps (bench/gpu/validate.sh): flags, budgets, timing, results.

Every step takes ``--dry-run`` (toy sizes on the CPU, Triton under the interpreter), ``--out FILE.json``
and ``--budget-s``. Results survive a step killed by its time limit: :class:`StepResults` rewrites the
step's JSON (atomically) after every finished row, and prints each row as one compact line, so the rows
reach both the file and the output tail. Rows that would start after the budget is spent are recorded
as skipped, never silently lost.

The ceilings every ratio is taken against (device-to-device copy bandwidth, dense bf16 matmul rate) are
measured once by ``env.py`` into ``gpu_env.json`` next to the step files; a step run alone measures them
itself.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_cai.core import device as dev  # noqa: E402

# Dense bf16 tensor-core peak (datasheet, without sparsity) by device-name fragment, first match.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "H800": 989.4, "GH200": 989.4,
                    "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.2}


def load_bench_module(name: str):
    """``bench/NAME.py`` (the CPU bench beside this folder) imported by its path under a name of its own, so a
    same-named file here (attention.py, context_parallel.py) can neither shadow it nor be shadowed by it."""
    key = "_cpu_bench_" + name
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(ROOT, "bench", name + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def parser(description: str, default_name: str, budget_s: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU (Triton interpreter)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT") or os.path.join(ROOT, "bench", "results"),
                                                 default_name + ".json"), help="result JSON")
    p.add_argument("--budget-s", type=float, default=budget_s, help="time budget of this step (s)")
    return p


def pick_device(dry_run: bool) -> torch.device:
    """CUDA for the real run (a clear error without one), the CPU for --dry-run."""
    if dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("error: --dry-run needs TRITON_INTERPRET=1 (validate.sh sets it)")
        return torch.device("cpu")
    if not dev.cuda_available():
        raise SystemExit("error: no CUDA device: run with --dry-run on a CPU machine")
    return dev.resolve_device("cuda")


class Budget:
    """Wall-clock budget of one step: ``allows(name, need_s)`` is False (and records the skip) when fewer
    than ``need_s`` seconds remain."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, need_s: float) -> bool:
        return self.left() >= need_s


class StepResults:
    """The rows of one step, in ``path`` (JSON), rewritten after every row: a killed step keeps its rows.

    The status says how the step ended: ``ok`` / ``failed`` (``finish``), ``killed`` (SIGTERM, as
    ``timeout`` sends: the handler records it and exits 143) or ``crashed`` (the process exits while
    still running, e.g. on an uncaught exception, whose last line is kept). A SIGKILL leaves ``running``
    behind; validate.sh then settles it (summary.py ``--step``)."""

    def __init__(self, path: str, title: str, columns: list[str], **meta) -> None:
        self.path, self.title, self.columns = path, title, columns
        self.payload = {"title": title, "columns": columns, "status": "running", "rows": [], "skipped": [],
                        **meta}
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._write()
        self._saved_sigterm = (signal.signal(signal.SIGTERM, self._killed)
                               if threading.current_thread() is threading.main_thread() else None)
        atexit.register(self._exited)  # both undone by finish()

    def _killed(self, signum, frame) -> None:
        self.set(status="killed", stopped_by=signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    def _exited(self) -> None:
        if self.payload["status"] == "running":
            last = getattr(sys, "last_value", None)  # set by the interpreter for an uncaught exception
            with contextlib.suppress(OSError):
                self.set(status="crashed", **({"error": f"{type(last).__name__}: {str(last)[:300]}"} if last else {}))

    def add(self, row: dict) -> dict:
        self.payload["rows"].append(row)
        self._write()
        print("  row: " + " | ".join(f"{c}={_fmt(row[c])}" for c in self.columns if row.get(c) is not None),
              flush=True)
        return row

    def skip(self, name: str, why: str = "time budget") -> None:
        self.payload["skipped"].append(f"{name} ({why})")
        self._write()
        print(f"  skipped: {name} ({why})", flush=True)

    def set(self, **values) -> None:
        self.payload.update(values)
        self._write()

    def finish(self, ok: bool) -> int:
        self.set(status="ok" if ok else "failed")
        atexit.unregister(self._exited)
        if self._saved_sigterm is not None:
            signal.signal(signal.SIGTERM, self._saved_sigterm)
        return 0 if ok else 1

    def _write(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.payload, f, indent=1, default=str)
        os.replace(tmp, self.path)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r[c]) if r.get(c) is not None else "" for c in columns) + " |" for r in rows]
    return "\n".join(lines)


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
    return summary(times)


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "reps": len(times)}


def environment(device: torch.device) -> dict:
    """Versions and the device, for every step's JSON."""
    out = {"device": dev.device_name(device), "capability": dev.device_capability(device),
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg": list(os.getloadavg())}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    return out


def measure_ceilings(device: torch.device, dry_run: bool) -> dict:
    """Device-to-device copy bandwidth (GB/s, read + write counted) and dense bf16 matmul rate (TFLOP/s)."""
    n = (1 << 16) if dry_run else (1 << 28)  # 1 GiB of fp32 on the GPU
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    copy = time_fn(lambda: dst.copy_(src), device, reps=3 if dry_run else 20, warmup=1 if dry_run else 3)
    m = 256 if dry_run else 8192
    dtype = torch.float32 if dry_run else torch.bfloat16
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    mm = time_fn(lambda: a @ b, device, reps=3 if dry_run else 20, warmup=1 if dry_run else 3)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in dev.device_name(device)), None)
    return {"copy_GBps": 8 * n / copy["median_s"] / 1e9, "bf16_matmul_TFLOPs": 2 * m**3 / mm["median_s"] / 1e12,
            "matmul_size": m, "datasheet_bf16_TFLOPs": peak}


def ceilings(out_path: str, device: torch.device, dry_run: bool) -> dict:
    """The ceilings measured by env.py (gpu_env.json next to ``out_path``), else measured now."""
    env_path = os.path.join(os.path.dirname(os.path.abspath(out_path)), "gpu_env.json")
    try:
        with open(env_path) as f:
            found = json.load(f).get("ceilings")
        if found:
            return found
    except (OSError, ValueError):
        pass
    return measure_ceilings(device, dry_run)


class KernelCounter:
    """Counts Triton kernel launches by kernel name while active (compiled and interpreted kernels): the
    proof of which kernel ran."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[KernelCounter]:
        from triton.runtime import jit

        classes = [jit.JITFunction]
        try:
            from triton.runtime import interpreter

            classes.append(interpreter.InterpretedFunction)
        except ImportError:  # pragma: no cover - every supported triton has the interpreter
            pass
        saved = [(cls, cls.run) for cls in classes]

        def wrap(original):
            def run(fn_self, *args, **kwargs):
                if not kwargs.get("warmup"):
                    name = fn_self.fn.__name__
                    self.counts[name] = self.counts.get(name, 0) + 1
                return original(fn_self, *args, **kwargs)
            return run

        for cls, original in saved:
            cls.run = wrap(original)
        try:
            yield self
        finally:
            for cls, original in saved:
                cls.run = original


@contextlib.contextmanager
def count_calls(module, name: str, counts: dict[str, int]) -> Iterator[None]:
    """Count calls of ``module.name`` into ``counts[name]`` while active."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield
    finally:
        setattr(module, name, original)

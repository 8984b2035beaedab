"""Run every bench's ``--quick`` mode, one after another in this process, and report each one's time.

    python bench/harness/quick.py --out DIR [--cache-dir DIR] [--only NAME ...]

Each bench writes ``DIR/NAME.{json,md,png}``; ``DIR/quick_summary.json`` lists, per bench, whether it
finished, its wall time and its CPU time (this process's and that of the processes it started), with the
load average before and after. This is what CI runs (tests/unit_tests/bench/test_bench_quick_modes.py);
nothing is written into bench/results/. The demo data is built once in ``--cache-dir`` and shared.
"""
from __future__ import annotations

import argparse
import importlib
import os
import resource
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402
from harness.results import dump_json, machine  # noqa: E402

# Every bench of bench/ (bench/gpu/ is the GPU machine's), cheapest first, with what CI adds to --quick:
# the shaped-link benches run on the loopback, without network namespaces (no root).
BENCHES = {"qat_clamp": [], "squinch_cluster_projection": [], "squinch_codec": [], "context_parallel": [],
           "attention": [], "train_throughput": [], "step_overhead": [], "checkpoint": [], "fp16_training": [],
           "qat_training": [], "zreg_bf16": [],
           "clamp_drift": [], "distill_seeds": [], "distill": [], "zreg_tree_training": [], "dp_comm": [],
           "fsdp_memory": [], "squinch_phases": ["--no-netns"], "squinch_convergence": [],
           "squinch_bandwidth": ["--no-netns"], "moe": [], "diloco": ["--no-netns"],
           "kaiju": ["--skip-agreement"]}
# Benches whose --quick is not run here, and why.
NOT_HERE = {"squinch_scale": "its --quick checks the whole chain (phases, timelines, 9 training configurations, "
                             "the model, the projection) over a shaped veth link: root and minutes; "
                             "tests/unit_tests/squinch/test_scale_bench_quick.py runs it (slow)"}


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def run_one(name: str, out: str, cache: str) -> dict:
    """``bench/NAME.py --quick --out OUT/NAME --cache-dir CACHE`` (+ BENCHES[NAME]) in this process: its time,
    or its error."""
    import torch

    threads = torch.get_num_threads()
    wall, (cpu, kids) = time.perf_counter(), _cpu()
    row = {"bench": name, "ok": True, "load_average_before": machine()["load_average"]}
    try:
        module = importlib.import_module(name)
        module.main(["--quick", "--out", os.path.join(out, name), "--cache-dir", cache, *BENCHES[name]])
    except SystemExit as e:  # a bench's own exit: 0 or None is success
        if e.code not in (0, None):
            row.update(ok=False, error=f"exit {e.code}")
    except Exception:  # noqa: BLE001 - reported, and the next bench runs
        row.update(ok=False, error=traceback.format_exc()[-4000:])
    finally:
        torch.set_num_threads(threads)
    cpu1, kids1 = _cpu()
    row.update(wall_s=round(time.perf_counter() - wall, 2), cpu_s=round(cpu1 - cpu, 2),
               children_cpu_s=round(kids1 - kids, 2), load_average_after=machine()["load_average"])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder of the quick results (never bench/results)")
    p.add_argument("--cache-dir", default=None, help="demo data and run caches (default: OUT/cache)")
    p.add_argument("--only", nargs="*", default=None, choices=list(BENCHES))
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    if os.path.commonpath([out, harness.RESULTS]) == harness.RESULTS:
        p.error("--out must not be inside bench/results/")
    cache = os.path.abspath(args.cache_dir or os.path.join(out, "cache"))
    os.makedirs(out, exist_ok=True)
    rows = []
    for name in args.only or BENCHES:
        print(f"==== {name} --quick", flush=True)
        rows.append(run_one(name, out, cache))
        r = rows[-1]
        print(f"==== {name}: {'ok' if r['ok'] else 'FAILED'} in {r['wall_s']:.1f} s (CPU {r['cpu_s']:.1f} s + "
              f"{r['children_cpu_s']:.1f} s in started processes; load {r['load_average_after'][0]:.1f})",
              flush=True)
    total = {k: round(sum(r[k] for r in rows), 1) for k in ("wall_s", "cpu_s", "children_cpu_s")}
    dump_json(os.path.join(out, "quick_summary.json"), {"benches": rows, "total": total, "machine": machine()})
    print("\n| bench | ok | wall s | CPU s | CPU s of started processes |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['bench']} | {'yes' if r['ok'] else 'NO'} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
              f"{r['children_cpu_s']:.1f} |")
    print(f"| total | | {total['wall_s']:.1f} | {total['cpu_s']:.1f} | {total['children_cpu_s']:.1f} |")
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        print(f"\n{r['bench']} failed:\n{r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Each collective of the gradient reducers alone, over the shaped veth, and the Squinch codec on this CPU:
the measured inputs of the step-time model (core/distributed/comm_model.py).

Links: the two-namespace veth pair of ``harness/shaped_link.py`` (one rank per namespace) unshaped and tbf-shaped
to --rates Mbit/s, plus "loopback": both ranks in one namespace (the intra-host tier of the DP = 4 runs).
On each link, for every message size of --sizes (bytes of the buffer reduced; an all-gather's output)
and every collective as the reducers issue it (fp32 and bf16 all-reduce, fp32 and bf16 reduce-scatter
through core.device, Squinch's uint8 all-to-all and all-gather), alternating collective by collective,
in --repeats rounds (round i of every link before round i + 1 of any, so that a slow minute of the machine
moves one repeat of several links, not one link's median): the time from issue to the end of wait() (the
largest of the two ranks, after a barrier; back-to-back repetitions of small messages averaged), the host
time of the issue and the rank's CPU time over the collective (every thread: gloo's and the kernel's TCP work). Sizes
whose all-reduce would take more than --max-op-s at the link's rate are skipped.

The codec (one thread, as each training rank runs): encode with error feedback of a bucket cut into
1..16 rows (``encode_rows``), decode-accumulate of rows into a shard (``decode_sum_into``), the
all-gather side's decode (``decode_rows_into``) and the 1/DP scaling, at --codec-sizes elements.

Fits: per link and collective, time = steps x alpha + wire bytes / beta (weighted by 1/time, so small
and large messages count alike; wire bytes per rank at n = 2: all-reduce S, the others S/2) and the
transport's CPU seconds per wire byte (the slope of CPU time against wire bytes), and for
the codec one least-squares fit of time = launches x launch_s + elements / rate (a rate per codec step,
launches as comm_model counts them). Medians [min-max] over repeats; every figure with the load average.

    python bench/squinch_phases.py            # ~3 min on a quiet 2-core machine; root (ip netns, tc)
    python bench/squinch_phases.py --quick    # a smoke run: writes bench/.cache/quick/squinch_phases.*
    python bench/squinch_phases.py --quick --no-netns   # seconds, no root: the loopback link and the codec

Finished links are kept in ``bench/results/squinch_phases_rows_<run-id>.json`` (resumable; --fresh).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import harness as H
from harness.shaped_link import NETNS, RowCache, load, rate_key, setup_link, spawn_ranks, teardown_link, use_namespaces

ROOT = H.ROOT

OPS = (("allreduce", "fp32"), ("allreduce", "bf16"), ("reduce_scatter", "fp32"), ("reduce_scatter", "bf16"),
       ("all_to_all", "uint8"), ("all_gather", "uint8"))
STEPS_AT_2 = {"allreduce": 2, "reduce_scatter": 1, "all_to_all": 1, "all_gather": 1}  # comm_model's steps, n = 2
KIB = 1024
DEFAULT_SIZES = [64 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB, 16384 * KIB, 65536 * KIB]
MARKER = "SQUINCH_PHASES_JSON "


def op_key(op: str, dtype: str) -> str:
    """comm_model.Tier's key: the reductions per dtype, the uint8 collectives by name."""
    return op if dtype == "uint8" else f"{op}_{dtype}"


def wire_bytes_at_2(op: str, size: int) -> float:
    """Bytes one rank sends for a buffer of ``size`` bytes at n = 2 (comm_model.wire_bytes)."""
    return float(size) if op == "allreduce" else size / 2


def sizes_for(rate_mbit: float | None, sizes: list[int], max_op_s: float) -> list[int]:
    if rate_mbit is None:
        return sizes
    return [s for s in sizes if s * 8 / (rate_mbit * 1e6) <= max_op_s] or sizes[:1]


# ------------------------------------------------------------------------------------------ worker
def worker(sizes: list[int], repeats: int) -> None:
    """One rank: every collective at every size, alternating, ``repeats`` times; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from megatron_cai.core import device as device_mod
    from megatron_cai.core.distributed.squinch_reducer import _all_gather_async

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "uint8": torch.uint8}
    bufs = {}
    for size in sizes:
        for op, dt in OPS:
            el = size // torch.empty(0, dtype=dtypes[dt]).element_size()
            x = (torch.randn(el) if dt != "uint8" else torch.randint(0, 255, (el,))).to(dtypes[dt])
            bufs[op, dt, size] = (x, torch.empty_like(x), torch.empty(el // n, dtype=dtypes[dt]))

    def issue(op, dt, size):
        x, out, part = bufs[op, dt, size]
        if op == "allreduce":
            return dist.all_reduce(x, async_op=True)
        if op == "reduce_scatter":
            return device_mod.reduce_scatter_tensor(part, x, async_op=True)
        if op == "all_to_all":
            return device_mod.all_to_all_single(out, x, async_op=True)
        return _all_gather_async(out.view(n, -1), part, None)

    for op, dt in OPS:  # warm-up: connections, allocations
        issue(op, dt, sizes[0]).wait()
    times: dict[str, list[float]] = {}
    issues: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    for _ in range(repeats):
        for size in sizes:
            inner = max(1, min(8, math.ceil(KIB * KIB / size)))
            for op, dt in OPS:
                dist.barrier()
                t0, c0, spent = time.perf_counter(), time.process_time(), 0.0
                for _ in range(inner):
                    a = time.perf_counter()
                    work = issue(op, dt, size)
                    spent += time.perf_counter() - a
                    work.wait()
                key = f"{op_key(op, dt)}|{size}"
                times.setdefault(key, []).append((time.perf_counter() - t0) / inner)
                cpus.setdefault(key, []).append((time.process_time() - c0) / inner)  # every thread of the rank
                issues.setdefault(key, []).append(spent / inner)
    keys = sorted(times)
    worst = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank is done
    if dist.get_rank() == 0:
        print(MARKER + json.dumps({"times": {k: worst[i].tolist() for i, k in enumerate(keys)},
                                   "issue": {k: issues[k] for k in keys}, "cpu": {k: cpus[k] for k in keys}}),
              flush=True)
    dist.destroy_process_group()


def measure_link(rate, sizes: list[int], repeats: int, loopback: bool = False) -> dict:
    """Run the worker over one link (``loopback``: both ranks in one namespace): its raw samples."""
    setup_link(None if loopback else rate)
    argv = ["bench/squinch_phases.py", "--worker", "--repeats", str(repeats), "--sizes", *map(str, sizes)]
    outs = spawn_ranks(argv, 2 if loopback else 1, namespaces=1 if loopback else 2, timeout=1800)
    raw = json.loads(next(x for x in outs[0].splitlines() if x.startswith(MARKER))[len(MARKER):])
    return {"rate_mbit": rate, "loopback": loopback, "load": load(), "raw": raw}


def link_of(rounds: list[dict]) -> dict:
    """One link from its rounds: per collective and size, the median [min-max] over every round's runs."""
    samples: dict[str, dict] = {}
    for key in rounds[0]["raw"]["times"]:
        name, size = key.split("|")
        runs = [t for r in rounds for t in r["raw"]["times"][key]]
        samples.setdefault(name, {})[size] = {
            "median_s": statistics.median(runs), "min_s": min(runs), "max_s": max(runs), "runs_s": runs,
            "issue_s": statistics.median(t for r in rounds for t in r["raw"]["issue"][key]),
            "cpu_s": statistics.median(t for r in rounds for t in r["raw"]["cpu"][key])}
    loads = [r["load"] for r in rounds]
    return {"rate_mbit": rounds[0]["rate_mbit"], "loopback": rounds[0]["loopback"],
            "load": loads[0] if len(loads) == 1 else f"{loads[0]} ... {loads[-1]}", "samples": samples}


# ------------------------------------------------------------------------------------------- codec
def codec_launches(kind: str, rows: int) -> int:
    """Launches (calls) as comm_model.launches counts them with per-rank launches."""
    from megatron_cai.core.distributed.comm_model import CodecCost, Work, launches

    unit = CodecCost(1.0, 1.0, 1.0, 1.0, 0.0, per_rank_launches=True)
    return launches(Work(kind, 0, rows), unit)


def measure_codec(sizes: list[int], repeats: int) -> dict:
    """Codec timings on one thread: each (kind, elements, rows) alternated, ``repeats`` times."""
    import torch

    from megatron_cai.core.distributed.squinch_collectives import (
        decode_rows_into,
        decode_sum_into,
        encode_rows,
        row_nbytes,
    )

    torch.set_num_threads(1)
    cases = []
    for el in sizes:
        for rows in (1, 2, 4, 16):
            cases.append(("encode", el, rows))
        for rows in (2, 4, 16):
            cases.append(("decode_accumulate", el, rows))
            cases.append(("decode", el, rows))
        cases.append(("memory", el, 1))
    data = {}
    for kind, el, rows in cases:
        x = torch.randn(el) * torch.logspace(-4, 0, el)
        c = el // rows
        send = encode_rows(x, rows, None)
        data[kind, el, rows] = (x, torch.zeros(el), send, torch.empty(c), torch.empty(el), c)
    assert send.shape[1] == row_nbytes(c)

    def run(kind, el, rows):
        x, res, send, shard, full, c = data[kind, el, rows]
        if kind == "encode":
            encode_rows(x, rows, res, out=send)
        elif kind == "decode_accumulate":
            decode_sum_into(send, shard)
        elif kind == "decode":
            decode_rows_into(send, full)
        else:
            x.mul_(1.0)

    for case in cases:
        run(*case)
    times: dict[tuple, list[float]] = {case: [] for case in cases}
    for _ in range(repeats):
        for case in cases:
            inner = max(1, min(16, math.ceil(2**20 / case[1])))
            t0 = time.perf_counter()
            for _ in range(inner):
                run(*case)
            times[case].append((time.perf_counter() - t0) / inner)
    return {"load": load(), "threads": 1, "samples": [
        {"kind": k, "elements": el, "rows": rows, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
         "runs_s": t} for (k, el, rows), t in times.items()]}


# -------------------------------------------------------------------------------------------- fits
def fit_line(xs: list[float], ts: list[float]) -> tuple[float, float, float]:
    """Weighted (1/t) least squares of t = a + b x, with a >= 0 (refit through 0 otherwise).
    Returns (a, b, largest relative residual)."""
    import numpy as np

    x, t = np.asarray(xs, float), np.asarray(ts, float)
    w = 1.0 / t
    A = np.stack([np.ones_like(x), x], 1) * w[:, None]
    a, b = np.linalg.lstsq(A, t * w, rcond=None)[0]
    if a < 0:
        a, b = 0.0, float(np.sum(x * t * w * w) / np.sum(x * x * w * w))
    resid = np.max(np.abs((a + b * x) / t - 1.0))
    return float(a), float(b), float(resid)


def fit_link(link: dict) -> dict[str, dict]:
    """Per collective: alpha (per step), beta (bytes/s per direction), the issue time, the fit's error."""
    out = {}
    for name, by_size in link["samples"].items():
        op = name.rsplit("_", 1)[0] if name.endswith(("_fp32", "_bf16")) else name
        sizes = sorted(by_size, key=int)
        xs = [wire_bytes_at_2(op, int(s)) for s in sizes]
        ts = [by_size[s]["median_s"] for s in sizes]
        a, b, resid = fit_line(xs, ts)
        _, cpu_per_byte, _ = fit_line(xs, [max(by_size[s]["cpu_s"], 1e-9) for s in sizes])
        # one issue time (the median over sizes) fell on the knee where it starts to grow with the message,
        # and moved 0.09 <-> 0.64 ms between two runs: a line in bytes instead
        issue, issue_per_byte, _ = fit_line(xs, [max(by_size[s]["issue_s"], 1e-9) for s in sizes])
        bound = b <= 0  # time did not grow with size (noise): the largest message's rate, a lower bound
        out[name] = {"alpha_s": a / STEPS_AT_2[op], "bytes_per_s": xs[-1] / ts[-1] if bound else 1.0 / b,
                     "beta_is_bound": bound,
                     "issue_s": issue, "issue_s_per_byte": max(issue_per_byte, 0.0),
                     "cpu_s_per_byte": max(cpu_per_byte, 0.0), "max_rel_residual": resid}
    return out


def fits_of(res: dict) -> dict:
    """Every fit of a phase measurement (its links' collectives and the codec) from its samples."""
    return {"links": {k: fit_link(v) for k, v in res["links"].items()}, "codec": fit_codec(res["codec"])}


def fit_codec(codec: dict) -> dict:
    """One least-squares fit over every codec sample: t = launches x launch_s + elements / rate[kind]."""
    import numpy as np

    kinds = ("encode", "decode_accumulate", "decode", "memory")
    rows_A, ts = [], []
    for s in codec["samples"]:
        el = s["elements"] * (8 if s["kind"] == "memory" else 1)  # memory: bytes read + written (fp32)
        row = [codec_launches(s["kind"], s["rows"])] + [el if s["kind"] == k else 0.0 for k in kinds]
        rows_A.append(row)
        ts.append(s["median_s"])
    A, t = np.asarray(rows_A, float), np.asarray(ts, float)
    w = 1.0 / t
    coef = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)[0]
    coef = np.maximum(coef, 1e-15)
    resid = float(np.max(np.abs((A @ coef) / t - 1.0)))
    return {"launch_s": float(coef[0]), "encode_elems_per_s": 1 / coef[1], "decode_accumulate_elems_per_s": 1 / coef[2],
            "decode_elems_per_s": 1 / coef[3], "memory_bytes_per_s": 1 / coef[4], "max_rel_residual": resid}


# ------------------------------------------------------------------------------------------ report
def link_label(key: str) -> str:
    return {"unshaped": "unshaped veth", "loopback": "loopback (one namespace)"}.get(key, f"{key} Mbit/s")


def report(res: dict) -> list[str]:
    L = ["# Collectives and codec alone: the step-time model's measured inputs", "",
         f"{res['settings']['repeats']} rounds over the links (collectives alternate within a round); "
         "cells: median [min-max] ms of one collective "
         "(issue to the end of wait(), the slower of the 2 ranks), message = the bytes of the buffer reduced "
         "(an all-gather's output). Machine before: " + res["load_before"] + "; after: " + res["load_after"] + ".",
         ""]
    for key, link in res["links"].items():
        sizes = sorted({int(s) for v in link["samples"].values() for s in v})
        L += [f"## {link_label(key)} ({link['load']})", "",
              "| collective | " + " | ".join(f"{s // KIB} KiB" for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for name, by_size in link["samples"].items():
            cells = [by_size.get(str(s)) for s in sizes]
            L.append(f"| {name} | " + " | ".join(
                f"{1e3 * c['median_s']:.2f} [{1e3 * c['min_s']:.2f}-{1e3 * c['max_s']:.2f}]" if c else "-"
                for c in cells) + " |")
        L.append("")
    L += ["## Fits: time = steps x alpha + wire bytes / beta (per direction)", "",
          "| link | collective | alpha (us per step) | beta (MB/s) | beta (Mbit/s) | issue (us + ns/B) | "
          "transport CPU (ns/B) | max fit error |", "|---|---|---|---|---|---|---|---|"]
    for key, fits in res["fits"]["links"].items():
        for name, f in fits.items():
            ge = ">= " if f.get("beta_is_bound") else ""
            L.append(f"| {link_label(key)} | {name} | {1e6 * f['alpha_s']:.0f} | {ge}{f['bytes_per_s'] / 1e6:.1f} | "
                     f"{ge}{8 * f['bytes_per_s'] / 1e6:.0f} | "
                     f"{1e6 * f['issue_s']:.0f} + {1e9 * f['issue_s_per_byte']:.3f} | "
                     f"{1e9 * f['cpu_s_per_byte']:.2f} | {100 * f['max_rel_residual']:.0f}% |")
    c = res["fits"]["codec"]
    L += ["", f"## Codec on one CPU thread ({res['codec']['load']})", "",
          "time = launches x launch + elements / rate (launches: encode and the all-gather decode loop over "
          "their rows, +2; decode-accumulate 3; a copy 1)", "",
          "| launch (us) | encode + error feedback (M el/s) | decode-accumulate (M el/s) | decode (M el/s) | "
          "scale / copy (GB/s) | max fit error |", "|---|---|---|---|---|---|",
          f"| {1e6 * c['launch_s']:.1f} | {c['encode_elems_per_s'] / 1e6:.1f} | "
          f"{c['decode_accumulate_elems_per_s'] / 1e6:.1f} | {c['decode_elems_per_s'] / 1e6:.1f} | "
          f"{c['memory_bytes_per_s'] / 1e9:.2f} | {100 * c['max_rel_residual']:.0f}% |", "",
          "| codec step | elements | rows | median ms [min-max] |", "|---|---|---|---|"]
    for s in res["codec"]["samples"]:
        L.append(f"| {s['kind']} | {s['elements']} | {s['rows']} | {1e3 * s['median_s']:.3f} "
                 f"[{1e3 * s['min_s']:.3f}-{1e3 * s['max_s']:.3f}] |")
    return L


# -------------------------------------------------------------------------------------------- main
def run(opts, rows: RowCache | None = None) -> dict:
    """Measure (or resume) every link and the codec, fit, and return the result (nothing written)."""
    res = {"load_before": load(), "settings": {k: getattr(opts, k) for k in ("rates", "sizes", "codec_sizes",
                                                                             "repeats", "max_op_s")},
           "links": {}}

    def get(key, fn):
        return rows.get(key, fn) if rows is not None else fn()
    links = [(rate_key(rate), rate, False) for rate in ([None, *sorted(opts.rates, reverse=True)]
                                                         if NETNS[0] else [])]  # no namespaces: loopback only
    links.append(("loopback", None, True))
    rounds: dict[str, list[dict]] = {key: [] for key, _, _ in links}
    try:  # round i of every link before round i + 1 of any: a slow minute moves one repeat of several links
        for i in range(opts.repeats):
            for key, rate, loopback in links:
                sizes = opts.sizes if loopback else sizes_for(rate, opts.sizes, opts.max_op_s)
                rounds[key].append(get(f"link|{key}#{i}",
                                       lambda r=rate, s=sizes, lb=loopback: measure_link(r, s, 1, lb)))
                print(f"  round {i + 1}/{opts.repeats} {link_label(key)}: done ({rounds[key][-1]['load']})",
                      flush=True)
    finally:
        teardown_link()
    res["links"] = {key: link_of(r) for key, r in rounds.items()}
    res["codec"] = get("codec", lambda: measure_codec(opts.codec_sizes, opts.repeats))
    res["fits"] = fits_of(res)
    res["load_after"] = load()
    return res


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", type=float, nargs="*", default=[1000, 256, 64], help="shaped links, Mbit/s")
    p.add_argument("--sizes", type=int, nargs="*", default=DEFAULT_SIZES, help="message sizes, bytes")
    p.add_argument("--codec-sizes", type=int, nargs="*", default=[65536, 262144, 1048576, 4194304])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-op-s", type=float, default=1.0, help="skip sizes whose all-reduce takes longer")


ROW_FORMAT = 3  # bump when a finished link's record changes shape (2: transport CPU time; 3: rounds)


def row_settings(opts) -> dict:
    """What a finished link's measurement depends on (a cached link with other settings is not reused)."""
    return {"format": ROW_FORMAT, **{k: getattr(opts, k) for k in ("sizes", "codec_sizes", "repeats", "max_op_s")}}


def quick(opts) -> None:
    opts.rates, opts.sizes, opts.codec_sizes, opts.repeats = [64], [64 * KIB, 256 * KIB], [65536, 262144], 2


def render(res: dict) -> str:
    return "\n".join(report(res)) + "\n"


def write(prefix: str, res: dict) -> None:
    H.Results(prefix).write(res, render, record_machine=False)


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "squinch_phases")
    add_args(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-netns", action="store_true", help="no namespaces, no root: the loopback link only")
    p.add_argument("--run-id", default="1")
    p.add_argument("--fresh", action="store_true", help="discard this run id's finished links")
    opts = H.parse(p, argv, quick=quick)
    if opts.worker:
        worker(opts.sizes, opts.repeats)
        return
    if opts.from_json:
        H.Results(opts.out).rewrite(render)
        return
    if not opts.quick and opts.repeats < 3:
        p.error("a measurement needs --repeats >= 3 (use --quick for a smoke run)")
    use_namespaces(not opts.no_netns)
    where = os.path.dirname(os.path.abspath(opts.out)) if opts.quick else H.RESULTS
    tag = f"quick{opts.run_id}" if opts.quick else opts.run_id
    rows = RowCache(os.path.join(where, f"squinch_phases_rows_{tag}.json"), row_settings(opts), opts.fresh)
    print(load(), flush=True)
    write(opts.out, run(opts, rows))


if __name__ == "__main__":
    main()

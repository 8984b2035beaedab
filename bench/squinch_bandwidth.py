"""Step time where bandwidth is scarce: bf16 all-reduce vs Squinch, measured over a real shaped link.

Two network namespaces joined by a veth pair, shaped with ``tc tbf`` (burst 64kb) or left unshaped;
pretrain_gpt.py runs with its ranks split over the two namespaces (gloo over the link), so the link is
the "inter-host" network. Every configuration is run --repeats times (>= 3), bf16 and Squinch
alternately (bf16, Squinch, bf16, Squinch, ...), each run --steps steady-state steps (>= 20) after
--warmup discarded ones; a run's time is the median of its per-iteration times (the last rank's
"elapsed time per iteration" log line). Reported: the median over repeats with its min-max, and the
Squinch / bf16 ratio of the medians with the min-max of the per-repeat paired ratios.

Tables, in order:
  0. phase breakdown of Squinch's reduction (``--timing-log-level 1``): where a step's communication
     time goes (encode, all-to-all, decode-accumulate, owner re-encode, all-gather, decode);
  1. DP = 2 (one rank per namespace) at --rates Mbit/s and unshaped veth, with and without
     --overlap-grad-reduce, at two model sizes (--sizes small large; large has ~10x the parameters);
  2. the quarter-bandwidth row: B = the rate at which bf16's communication equals its compute
     (bytes per step / compute time), Squinch at B/4 against bf16 at B, with overlap;
  3. DP = 4 as two hosts of two ranks each (two ranks per namespace), flat vs hierarchical Squinch
     (--squinch-hierarchical --ranks-per-node 2), with the link shaped to --dp4-rates.

The machine's load average is printed before and after. When any configuration's repeats spread by
more than --max-spread (10%) of their median, the results are NOT written (exit code 3): a table whose
answer flips with the noise is worse than none. --quick is a toy-size smoke run of the phases and DP = 2
parts (never written to bench/results); ``--no-netns`` runs every rank on this host's loopback, unshaped
(no root; CI runs ``--quick --no-netns``). Needs root and iproute2 (``ip netns``, ``tc``).

Every finished configuration row is kept in ``bench/results/squinch_bandwidth_rows_<run-id>.json``
(committed: keyed by part, size, rate and overlap), so a run interrupted or split over several quiet
windows, or measured as --rates/--sizes subsets, resumes where it stopped (``--fresh`` discards the rows
of that run id). Acceptance asks for two independent runs:
give the second its own ``--run-id`` and ``--compare`` the first run's JSON, which reports every
ratio's change and exits 4 when one moved by more than --max-drift (5%).

    python bench/squinch_bandwidth.py            # hours on a quiet 2-core machine (~3 h; 4 Mbit/s dominates)
    python bench/squinch_bandwidth.py --run-id 2 --out bench/results/squinch_bandwidth_run2 \
        --compare bench/results/squinch_bandwidth.json
    python bench/squinch_bandwidth.py --quick    # a toy model over the veth link; writes bench/.cache/quick/
    python bench/squinch_bandwidth.py --quick --no-netns   # seconds, no root: the loopback, unshaped
    python bench/squinch_bandwidth.py --from-cache --out DIR/partial   # the report of the rows so far
"""
from __future__ import annotations

import json
import os
import sys

import harness as H
from harness.results import dump_json
from harness.shaped_link import (  # the link, the runs over it and their row cache
    RowCache,
    alternate,
    drift_lines,
    load,
    paired_ratio,
    run_job,
    setup_link,
    summary,
    teardown_link,
    use_namespaces,
)
from harness.shaped_link import link_name as _link_name
from harness.shaped_link import rate_key as _rate_key

ROOT = H.ROOT
SIZES = {  # small: the model of the committed table (~0.66M gradient elements); large: ~10x
    "small": ["--squared-relu", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4"],
    "large": ["--squared-relu", "--num-layers", "3", "--hidden-size", "384", "--num-attention-heads", "6"],
    "toy": ["--squared-relu", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "2"],
}
REDUCERS = {"bf16": ["--grad-reduce-in-bf16"], "squinch": ["--squinch"]}
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "100000"]
ROW_SETTINGS = ("repeats", "steps", "warmup")  # what a row's measurement depends on beyond its key
SETTINGS = ("rates", "dp4_rates", "sizes", "repeats", "steps", "warmup", "max_spread", "parts", "quick", "from_cache")
ROWS: RowCache | None = None


def cached(key: str, compute):
    return ROWS.get(key, compute) if ROWS is not None else compute()


# ---------------------------------------------------------------------------------------- the parts
def phase_breakdown(opts, size: str) -> list[dict]:
    rows = []
    for rate in [None] + ([min(opts.rates)] if opts.rates else []):
        for ov in opts.overlaps:
            flags = SIZES[size] + REDUCERS["squinch"] + (OVERLAP if ov else []) + ["--timing-log-level", "1"]

            def measure(flags=flags, rate=rate, ov=ov):
                setup_link(rate)
                r = run_job(flags, 1, opts.steps, opts.warmup)
                return {"link": _link_name(rate), "overlap": ov, "step_ms": 1000 * r["step_s"],
                        "phases_ms": r["phases_ms"]}
            rows.append(cached(f"phases|{size}|{_rate_key(rate)}|{ov}", measure))
    return rows


def dp2_table(opts) -> list[dict]:
    rows = []
    for size in opts.sizes:
        for rate in [None] + sorted(opts.rates, reverse=True):
            for ov in opts.overlaps:
                def measure(size=size, rate=rate, ov=ov):
                    setup_link(rate)
                    cfg = {k: SIZES[size] + v + (OVERLAP if ov else []) for k, v in REDUCERS.items()}
                    if ov:  # before/after: the second phase started in wait() vs as soon as possible
                        cfg["squinch_wait"] = cfg["squinch"]
                    res = alternate(cfg, 1, opts)
                    row = {"size": size, "link": _link_name(rate), "rate": rate, "overlap": ov, **res,
                           "squinch/bf16": paired_ratio(res, "squinch", "bf16")}
                    if ov:
                        row["early/wait"] = paired_ratio(res, "squinch", "squinch_wait")
                    return row
                rows.append(cached(f"dp2|{size}|{_rate_key(rate)}|{ov}", measure))
                _print_row(rows[-1])
    return rows


def quarter_row(opts, dp2: list[dict]) -> list[dict]:
    """Squinch at B/4 vs bf16 at B, with overlap; B from the unshaped bf16 run (compute ~ step time)."""
    rows = []
    for size in opts.sizes:
        base = next(r for r in dp2 if r["size"] == size and r["rate"] is None and not r["overlap"])
        compute_s, nbytes = base["bf16"]["median_s"], base["bf16"]["bytes"]
        b_mbit = nbytes * 8 / compute_s / 1e6

        def measure(size=size, b_mbit=b_mbit, nbytes=nbytes, compute_s=compute_s):
            runs: dict[str, list[dict]] = {"bf16": [], "squinch": []}
            for _ in range(opts.repeats):  # alternate the two links run by run
                for label, rate in (("bf16", b_mbit), ("squinch", b_mbit / 4)):
                    setup_link(rate)
                    runs[label].append(run_job(SIZES[size] + REDUCERS[label] + OVERLAP, 1, opts.steps,
                                               opts.warmup))
            res = {label: summary(rs) for label, rs in runs.items()}
            return {"size": size, "B_mbit": b_mbit, "bf16_bytes": nbytes, "compute_s": compute_s, **res,
                    "squinch/bf16": paired_ratio(res, "squinch", "bf16")}
        row = cached(f"quarter|{size}|{b_mbit:.6g}", measure)
        rows.append(row)
        print(f"  quarter bandwidth ({size}): B = {b_mbit:.1f} Mbit/s; Squinch at B/4 / bf16 at B = "
              f"{row['squinch/bf16']['ratio']:.3f}", flush=True)
    return rows


def dp4_table(opts) -> list[dict]:
    rows = []
    size = opts.sizes[0]
    for rate in opts.dp4_rates:
        def measure(rate=rate):
            setup_link(rate)
            dp4 = ["--global-batch-size", "16"]  # micro-batch 4 x DP 4
            cfg = {"flat": SIZES[size] + REDUCERS["squinch"] + OVERLAP + dp4,
                   "hierarchical": SIZES[size] + REDUCERS["squinch"] + OVERLAP + dp4
                   + ["--squinch-hierarchical", "--ranks-per-node", "2"]}
            res = alternate(cfg, 2, opts)
            return {"size": size, "link": _link_name(rate), **res,
                    "hierarchical/flat": paired_ratio(res, "hierarchical", "flat")}
        rows.append(cached(f"dp4|{size}|{_rate_key(rate)}", measure))
        print(f"  DP=4 {_link_name(rate)}: hierarchical / flat = {rows[-1]['hierarchical/flat']['ratio']:.3f}",
              flush=True)
    return rows


def rows_from_cache(rows: dict, sizes: list[str]) -> dict:
    """The tables of a run id's finished rows (``--from-cache``), in the order a full run prints them."""
    def rate_order(key: str) -> float:
        rate = key.split("|")[2]
        return float("inf") if rate == "unshaped" else float(rate)

    def pick(part: str) -> list[dict]:
        keys = [k for k in rows if k.startswith(part + "|")]
        keys.sort(key=lambda k: (sizes.index(k.split("|")[1]) if k.split("|")[1] in sizes else len(sizes),
                                 -rate_order(k) if part != "quarter" else 0, k))
        return [rows[k] for k in keys]
    return {"phases": pick("phases"), "dp2": pick("dp2"), "quarter": pick("quarter"), "dp4": pick("dp4")}


# ------------------------------------------------------------------------------------------ report
def _cell(r: dict) -> str:
    return f"{1000 * r['median_s']:.1f} [{1000 * r['min_s']:.1f}-{1000 * r['max_s']:.1f}]"


def _ratio(r: dict) -> str:
    return f"{r['ratio']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"


def _print_row(r: dict) -> None:
    print(f"  {r['size']} {r['link']} overlap={r['overlap']}: bf16 {_cell(r['bf16'])} ms, squinch "
          f"{_cell(r['squinch'])} ms, ratio {_ratio(r['squinch/bf16'])}", flush=True)


def report(res: dict, opts) -> list[str]:
    from megatron_cai.core.distributed.comm_timing import PHASES

    L = ["# Squinch where bandwidth is scarce (measured over a tc-shaped veth link)", "",
         f"{opts.repeats} alternated repeats per configuration, {opts.steps} steady-state steps each (after "
         f"{opts.warmup} discarded); step time = median of the run's per-iteration times; cells: median over "
         "repeats [min-max], ms. Ratios: of the medians [min-max of the per-repeat paired ratios]. "
         f"Machine before: {res['load_before']}; after: {res['load_after']}.", "",
         "## 0. Where Squinch's reduction time goes (ms per step, --timing-log-level 1, DP = 2)", "",
         "| link | overlap | step | " + " | ".join(PHASES) + " |", "|---|---|---|" + "---|" * len(PHASES)]
    for r in res["phases"]:
        L.append(f"| {r['link']} | {'yes' if r['overlap'] else 'no'} | {r['step_ms']:.1f} | "
                 + " | ".join(f"{r['phases_ms'][p]:.2f}" if p in r["phases_ms"] else "-" for p in PHASES) + " |")
    L += ["", "## 1. DP = 2, one rank per namespace", "",
          "Overlap rows also run Squinch with its later stages left to wait() (MEGATRON_CAI_SQUINCH_EARLY_STAGES=0, "
          "the code before this bench): 'early / wait' is the after / before ratio.", "",
          "| model | link | overlap | bf16 ms/step | Squinch ms/step | Squinch / bf16 | Squinch, stages in wait() "
          "| early / wait |", "|---|---|---|---|---|---|---|---|"]
    for r in res["dp2"]:
        wait = (f"{_cell(r['squinch_wait'])} | {_ratio(r['early/wait'])}" if "squinch_wait" in r else "- | -")
        L.append(f"| {r['size']} | {r['link']} | {'yes' if r['overlap'] else 'no'} | {_cell(r['bf16'])} | "
                 f"{_cell(r['squinch'])} | {_ratio(r['squinch/bf16'])} | {wait} |")
    L += ["", "## 2. Quarter bandwidth: Squinch at B/4 vs bf16 at B, with overlap", "",
          "| model | B (bf16 comm = compute) | bf16 at B | Squinch at B/4 | ratio |", "|---|---|---|---|---|"]
    for r in res["quarter"]:
        L.append(f"| {r['size']} | {r['B_mbit']:.1f} Mbit/s | {_cell(r['bf16'])} | {_cell(r['squinch'])} | "
                 f"{_ratio(r['squinch/bf16'])} |")
    L += ["", "## 3. DP = 4 as two hosts of two ranks, Squinch with overlap: flat vs hierarchical", "",
          "| model | inter-host link | flat | hierarchical | hierarchical / flat |", "|---|---|---|---|---|"]
    for r in res["dp4"]:
        L.append(f"| {r['size']} | {r['link']} | {_cell(r['flat'])} | {_cell(r['hierarchical'])} | "
                 f"{_ratio(r['hierarchical/flat'])} |")
    return L


def too_noisy(res: dict, limit: float) -> list[str]:
    bad = []
    for part in ("dp2", "quarter", "dp4"):
        for r in res[part]:
            for k, v in r.items():
                if isinstance(v, dict) and "spread" in v and v["spread"] > limit:
                    bad.append(f"{part} {r.get('size')} {r.get('link', '')} {k}: spread {100 * v['spread']:.1f}%")
    return bad


def ratios(res: dict) -> dict[str, float]:
    """Every reported ratio of a result, by a stable name."""
    out = {}
    for r in res.get("dp2", []):
        out[f"dp2 {r['size']} {r['link']} overlap={r['overlap']} squinch/bf16"] = r["squinch/bf16"]["ratio"]
        if "early/wait" in r:
            out[f"dp2 {r['size']} {r['link']} early/wait"] = r["early/wait"]["ratio"]
    for r in res.get("quarter", []):
        out[f"quarter {r['size']} squinch(B/4)/bf16(B)"] = r["squinch/bf16"]["ratio"]
    for r in res.get("dp4", []):
        out[f"dp4 {r['size']} {r['link']} hierarchical/flat"] = r["hierarchical/flat"]["ratio"]
    return out


def compare(first: dict, second: dict, limit: float) -> list[str]:
    """Lines comparing two runs' ratios; the ones that moved by more than ``limit`` start with 'DRIFT'."""
    return drift_lines(ratios(first), ratios(second), limit)


def _quick(opts) -> None:
    opts.rates, opts.dp4_rates, opts.sizes, opts.steps, opts.warmup, opts.repeats = [16], [], ["toy"], 2, 1, 1
    opts.parts, opts.overlaps = ["phases", "dp2"], (False,)
    opts.run_id = f"quick{opts.run_id}"


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "squinch_bandwidth", from_json=False)  # its --from-cache reports from the rows
    p.add_argument("--rates", type=float, nargs="*", default=[1000, 256, 64, 16, 4], help="DP = 2 links, Mbit/s")
    p.add_argument("--dp4-rates", type=float, nargs="*", default=[16, 64, 256])
    p.add_argument("--sizes", nargs="*", default=["small", "large"], choices=list(SIZES))
    H.add(p, repeats=3, steps=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-spread", type=float, default=0.10)
    p.add_argument("--parts", nargs="*", default=["phases", "dp2", "quarter", "dp4"],
                   choices=["phases", "dp2", "quarter", "dp4"], help="a subset never writes bench/results")
    p.add_argument("--no-netns", action="store_true", help="every rank on this host's loopback, no shaping")
    p.add_argument("--run-id", default="1", help="finished rows are cached per run id (resume after a stop)")
    p.add_argument("--fresh", action="store_true", help="discard this run id's cached rows")
    p.add_argument("--compare", default=None, help="an earlier run's JSON: report each ratio's drift")
    p.add_argument("--max-drift", type=float, default=0.05, help="with --compare: exit 4 above this drift")
    p.add_argument("--from-cache", action="store_true",
                   help="measure nothing: report this run id's finished rows (a run still in progress); "
                        "written to bench/results/squinch_bandwidth_partial unless --out")
    p.set_defaults(overlaps=(False, True))
    out_default = p.get_default("out")
    opts = H.parse(p, argv, quick=_quick)
    if not opts.quick and (opts.repeats < 3 or opts.steps < 20):
        p.error("a measurement needs --repeats >= 3 and --steps >= 20 (use --quick for a smoke run)")
    global ROWS
    use_namespaces(not opts.no_netns)
    if opts.no_netns:  # nothing to shape
        opts.rates, opts.dp4_rates = [], []
    res = {"load_before": load(), "settings": {k: getattr(opts, k) for k in SETTINGS}}
    rows_dir = os.path.dirname(os.path.abspath(opts.out)) if opts.quick else H.RESULTS
    ROWS = RowCache(os.path.join(rows_dir, f"squinch_bandwidth_rows_{opts.run_id}.json"),
                    {k: getattr(opts, k) for k in ROW_SETTINGS}, opts.fresh)
    print(res["load_before"], flush=True)
    full = set(opts.parts) == {"phases", "dp2", "quarter", "dp4"}
    if not full and opts.out == out_default:
        opts.out = os.path.join(H.BENCH, ".cache", "squinch_bandwidth_partial")
    res.update({"phases": [], "dp2": [], "quarter": [], "dp4": []})
    if opts.from_cache:  # a report of the rows finished so far; never the committed full table
        res.update(rows_from_cache(ROWS.rows, list(SIZES)))
        res["load_before"] = "not recorded per row (--from-cache; each row was measured on a quiet machine)"
        if opts.out in (out_default, os.path.join(H.BENCH, ".cache", "squinch_bandwidth_partial")):
            opts.out = os.path.join(H.RESULTS, "squinch_bandwidth_partial")
    else:
        try:
            if "phases" in opts.parts:
                res["phases"] = phase_breakdown(opts, opts.sizes[0])
            if "dp2" in opts.parts:
                res["dp2"] = dp2_table(opts)
            if "quarter" in opts.parts and res["dp2"]:
                res["quarter"] = quarter_row(opts, res["dp2"])
            if "dp4" in opts.parts:
                res["dp4"] = dp4_table(opts)
        finally:
            teardown_link()
    res["load_after"] = res["load_before"] if opts.from_cache else load()
    dump_json(os.path.join(H.BENCH, ".cache", "squinch_bandwidth_last_raw.json"), res)  # whatever happens next
    lines = report(res, opts)
    print("\n".join(lines))
    noisy = too_noisy(res, opts.max_spread)
    if noisy and opts.from_cache:  # a progress report: written, with its noisy rows named first
        lines[1:1] = ["", f"**A run in progress, not a result**: {len(ROWS.rows)} finished rows of run id "
                      f"{opts.run_id}; {len(noisy)} of them spread more than {100 * opts.max_spread:.0f}% over "
                      f"their repeats and must be re-measured: " + "; ".join(noisy) + "."]
    elif noisy:
        print(f"\nNOT WRITING RESULTS: {len(noisy)} configuration(s) spread more than "
              f"{100 * opts.max_spread:.0f}% over their repeats:\n  " + "\n  ".join(noisy), flush=True)
        dump_json(os.path.join(H.BENCH, ".cache", "squinch_bandwidth_refused.json"), res)
        sys.exit(3)
    drifts: list[str] = []
    if opts.compare:
        with open(opts.compare) as f:
            drifts = compare(json.load(f), res, opts.max_drift)
        lines += ["", f"## Against {os.path.relpath(opts.compare, ROOT)} (a ratio may move by at most "
                  f"{100 * opts.max_drift:.0f}%)", "", *[f"- {x}" for x in drifts]]
        print("\n".join(drifts), flush=True)
    dump_json(opts.out + ".json", res)
    with open(opts.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    if any(x.startswith("DRIFT") for x in drifts):
        sys.exit(4)


if __name__ == "__main__":
    main()

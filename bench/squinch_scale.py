"""Squinch at cluster scale, from measurements here: phases, real runs, the model's error, the projection.

One command runs the whole chain and writes every result file:

  1. ``squinch_phases``: each collective alone over the shaped veth (4 links + loopback) and the codec
     on this CPU; fits alpha/beta per link and collective, and the codec's rates;
  2. a backward timeline per (model size, DP) (``--timing-log-level 2``: bucket sizes, when each is
     ready, the end of backward, the time after the gradient sync);
  3. the real set: training runs over the shaped veth (DP = 2, and DP = 4 as two hosts of two ranks;
     two model sizes; several rates; overlap on and off; fp32 / bf16 / Squinch flat and hierarchical),
     --repeats rounds over the whole set (round i of every group before round i + 1 of any; a group's
     configurations alternate within a round), --steps each, every row measured by this run (``--reuse FILE``
     takes finished rows of a squinch_bandwidth rows file instead: only rows of this same tree belong in
     one table, and reused rows are not alternated with the rest of their group);
  4. the model (``core/distributed/comm_model.py``) predicts every real row from 1 and 2 alone:
     predicted / measured per row, median and max absolute error;
  5. the quarter-bandwidth row for the large model: Squinch at B/4 against fp32 at B (B: the rate at
     which fp32's gradient bytes take as long as the compute), measured and predicted;
  6. ``squinch_cluster_projection`` (the model on H100-class clusters).

    python bench/squinch_scale.py                        # run 1: ~18 min on a quiet 2-core machine
    python bench/squinch_scale.py --run-id 2 --compare bench/results/squinch_scale.json
                                                         # run 2, its own rows; exit 4 if a ratio moved > 5%
    python bench/squinch_scale.py --quick                # a few minutes: toy sizes, writes bench/.cache/

Resumable: finished phases, timelines and row groups are kept per run id
(``bench/results/squinch_{phases,scale}_rows_<id>.json``); --fresh discards them. A configuration whose
rounds spread more than --max-spread (10%; from 5 rounds on without its fastest and slowest) gets
--extra-rounds (2) more rounds for its group; still noisy, it stops the run before anything of the real
set is written (exit 3), and ``--drop-noisy`` re-measures those groups. Writes bench/results/squinch_phases*,
squinch_scale*, squinch_cluster_projection.* and the measured section of docs/squinch-performance.md.
Needs root (ip netns, tc). Every timing is printed with the load average; take it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import harness as H
import squinch_phases
from harness.results import cpus_of_load_line
from harness.shaped_link import (
    WAIT_ENV,
    RowCache,
    drift_lines,
    link_name,
    load,
    paired_ratio,
    rate_key,
    run_job,
    setup_link,
    summary,
    teardown_link,
)
from squinch_bandwidth import OVERLAP, SIZES  # the committed table's models and buckets

from megatron_cai.core.distributed.comm_model import (
    BackwardTimeline,
    CodecCost,
    OpCost,
    ReducerMode,
    Tier,
    Topology,
    predict,
)

CONFIGS = {  # label -> (flags, the model's reducer mode without overlap, extra environment)
    "fp32": ([], ReducerMode("fp32"), {}),
    "bf16": (["--grad-reduce-in-bf16"], ReducerMode("bf16"), {}),
    "squinch": (["--squinch"], ReducerMode("squinch"), {}),
    "squinch_wait": (["--squinch"], ReducerMode("squinch", stages="wait"), WAIT_ENV),
    "flat": (["--squinch"], ReducerMode("squinch"), {}),
    "hierarchical": (["--squinch", "--squinch-hierarchical", "--ranks-per-node", "2"],
                     ReducerMode("squinch", hierarchical=True), {}),
}
ROOT = H.ROOT
TBF_BURST = 64 * 1024  # harness/shaped_link.py's tbf burst
ROW_SETTINGS = ("repeats", "steps", "warmup")  # as squinch_bandwidth's: its rows are reused on these
ROW_FORMAT = 5  # bump when a cached timeline or group changes shape (3: rounds; 4: 3 timeline runs a round;
#                5: a configuration's steps cover --min-steady-s)


@dataclass(frozen=True)
class Group:
    """Configurations measured alternately on one link: a DP = 2 group's key is the one
    squinch_bandwidth uses, so its finished rows are reused."""

    size: str
    dp: int
    rate: float | None
    overlap: bool
    configs: tuple[str, ...]

    @property
    def key(self) -> str:
        if self.dp == 4:
            return f"dp4|{self.size}|{rate_key(self.rate)}"
        return f"dp2|{self.size}|{rate_key(self.rate)}|{self.overlap}"


# The real set: every dimension the model is judged on (DP 2 and DP 4 as two hosts, both sizes, 64 Mbit/s to
# 1 Gbit/s plus the quarter row's B and B/4, overlap on and off, fp32 / bf16 / Squinch flat, hierarchical and
# its "wait" rule), 15 rows plus the quarter row's 2, so that each small-model row gets 4 rounds and each
# large-model row 5 within the 25 minutes. 24 rows of 3 rounds spread too much to repeat within 5% (one to four
# ratios of 39 moved 5-10% in each of seven pairs): the median of 3 runs minutes apart is the machine's.
REAL_SET = (
    Group("small", 2, 256, False, ("fp32", "bf16", "squinch")),
    Group("small", 2, 256, True, ("fp32", "bf16", "squinch", "squinch_wait")),
    Group("small", 2, 64, True, ("bf16", "squinch")),
    Group("large", 2, 1000, True, ("fp32", "bf16", "squinch")),
    Group("small", 4, 256, True, ("fp32", "flat", "hierarchical")),
)
QUICK_SET = (
    Group("toy", 2, 64, False, ("fp32", "bf16", "squinch")),
    Group("toy", 2, 64, True, ("fp32", "squinch", "squinch_wait")),
    Group("toy", 4, 64, True, ("bf16", "flat", "hierarchical")),
)
# The timeline runs (bf16, overlap) on the unshaped veth: compute as it is with the least transport CPU next to
# it. The model adds the transport's CPU itself (the fits' ns/B); a profile over a shaped link, whose gloo
# threads take ~6 ns of CPU per byte during backward, counted it twice (the large model's rows +20-40%).
PROFILE_RATE = None


def flags_of(group: Group, label: str) -> list[str]:
    dp4 = ["--global-batch-size", "16"] if group.dp == 4 else []  # micro-batch 4 x DP 4
    return SIZES[group.size] + CONFIGS[label][0] + (OVERLAP if group.overlap else []) + dp4


# ------------------------------------------------------------------------------------ measurements
TIMELINE_RE = re.compile(r"bucket (\d+): (\d+) elements ready at ([0-9.]+) \(compute ([0-9.]+)\)")
ENDS_RE = re.compile(r"backward end ([0-9.]+) \(compute ([0-9.]+)\), sync end ([0-9.]+), step end ([0-9.]+) "
                     r"\(after sync, compute ([0-9.]+)\)")


def parse_timeline(log: str, warmup: int) -> dict:
    """Medians over the steady iterations of the --timing-log-level 2 backward timeline (ms)."""
    blocks = log.split(" backward timeline at iteration ")[1 + warmup:]
    if not blocks:
        raise RuntimeError("no backward timeline in the log (--timing-log-level 2)")
    per_bucket: dict[int, list[tuple[int, float]]] = {}
    ends = []
    for b in blocks:
        for i, n, _, comp in TIMELINE_RE.findall(b):
            per_bucket.setdefault(int(i), []).append((int(n), float(comp)))
        ends.append(tuple(map(float, ENDS_RE.search(b).groups())))
    order = sorted(per_bucket, key=lambda i: statistics.median(c for _, c in per_bucket[i]))
    med = statistics.median
    return {"bucket_elems": [per_bucket[i][0][0] for i in order],
            "ready_ms": [med(c for _, c in per_bucket[i]) for i in order],
            "backward_end_ms": med(e[1] for e in ends), "after_sync_ms": med(e[4] for e in ends),
            "raw_step_ms": med(e[3] for e in ends), "iterations": len(blocks)}


def measure_timeline(size: str, dp: int, opts) -> dict:
    setup_link(PROFILE_RATE)
    flags = flags_of(Group(size, dp, PROFILE_RATE, True, ()), "bf16") + ["--timing-log-level", "2"]
    r = run_job(flags, dp // 2, opts.steps, opts.warmup)
    return {**parse_timeline(r["log"], opts.warmup), "load": load(),
            "profile": f"bf16, overlap, {link_name(PROFILE_RATE)}"}


class RoundPlan(Protocol):
    """One round of something measured in rounds, stored under ``round_key(base, i)``."""

    @property
    def base(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def rounds(self) -> int | None:
        """This plan's rounds; None: the run's (``opts.repeats``)."""

    def measure(self, opts) -> dict: ...

    def describe(self, res: dict) -> str: ...


TIMELINE_RUNS = 3  # processes per round: one process's compute varies ~10% (placement, allocator), its steps less


@dataclass(frozen=True)
class TimelinePlan:
    """One round of a model's backward timeline (bf16, overlap, on PROFILE_RATE's link): the median of
    TIMELINE_RUNS processes."""

    size: str
    dp: int
    rounds: int | None = None

    @property
    def base(self) -> str:
        return f"timeline|{self.size}|{self.dp}|{rate_key(PROFILE_RATE)}"

    @property
    def name(self) -> str:
        return f"timeline {self.size} DP {self.dp}"

    def measure(self, opts) -> dict:
        runs = [measure_timeline(self.size, self.dp, opts) for _ in range(TIMELINE_RUNS)]
        return {**timeline_of_rounds(runs), "per_run": runs}

    def describe(self, res: dict) -> str:
        return f"backward end {res['backward_end_ms']:.1f} ms, after the sync {res['after_sync_ms']:.1f} ms"


def timeline_of_rounds(rounds: list[dict]) -> dict:
    """A timeline's rounds (or one round's runs) as one: every time the median (the buckets are the model's)."""
    if any(r["bucket_elems"] != rounds[0]["bucket_elems"] for r in rounds):
        raise RuntimeError("the rounds of one timeline saw different buckets")
    med = statistics.median
    return {"bucket_elems": rounds[0]["bucket_elems"],
            "ready_ms": [med(r["ready_ms"][i] for r in rounds) for i in range(len(rounds[0]["ready_ms"]))],
            **{k: med(r[k] for r in rounds) for k in ("backward_end_ms", "after_sync_ms", "raw_step_ms")},
            "iterations": sum(r["iterations"] for r in rounds), "runs": sum(r.get("runs", 1) for r in rounds),
            "load": rounds[-1]["load"], "profile": rounds[0]["profile"]}


def timeline_of(t: dict) -> BackwardTimeline:
    ready = [min(r, t["backward_end_ms"]) / 1e3 for r in t["ready_ms"]]
    return BackwardTimeline(tuple(t["bucket_elems"]), tuple(ready), t["backward_end_ms"] / 1e3,
                            t["after_sync_ms"] / 1e3)


def round_key(base: str, i: int) -> str:
    return f"{base}#{i}"


def rounds_of(rows: dict, base: str) -> list[dict]:
    """The finished rounds of the group (or quarter row) stored under ``base``, in round order."""
    found = sorted((int(k.rsplit("#", 1)[1]), v) for k, v in rows.items() if k.rsplit("#", 1)[0] == base)
    return [v for _, v in found]


def summary_of_rounds(rounds: list[dict], labels: tuple[str, ...]) -> dict:
    """Each configuration's summary over its rounds (``runs_s`` in round order, so paired ratios pair
    runs of one round, ``steps`` the steady steps of each, ``inner_spread``); the load average before every
    round."""
    def one(k: str) -> dict:
        s = summary([r[k] for r in rounds])
        return {**s, "steps": [len(r[k]["steps_ms"]) for r in rounds], "inner_spread": inner_spread(s["runs_s"])}
    return {"load": "; ".join(r["load"] for r in rounds), **{k: one(k) for k in labels}}


INNER_FROM = 5  # rounds from which one stray process at each end no longer moves the median


def inner_spread(runs_s: list[float]) -> float:
    """How far a configuration's rounds spread around their median (``(max - min) / median``), without its
    fastest and slowest round once it has INNER_FROM or more: the figure is their median, which one stray
    process at either end does not move. On 2 cores about one process in ten runs 8-15% slow (a small
    model's bf16 at 256 Mbit/s: 94.8, 96.2, 108.9 ms; the large model's Squinch: 334-349 and 372, 377 ms)."""
    t = sorted(runs_s)
    if len(t) >= INNER_FROM:
        t = t[1:-1]
    return (t[-1] - t[0]) / statistics.median(t)


def judged_spread(s: dict) -> float:
    """The spread the noise guard judges a summary by: ``inner_spread``, or the whole spread of a summary
    made without it (a reused squinch_bandwidth row)."""
    return s.get("inner_spread", s["spread"])


def noisy_keys(rows: dict, limit: float) -> list[str]:
    """Groups (and quarter rows) of a rows cache with a configuration whose rounds spread above ``limit``
    (``inner_spread``)."""
    bases = sorted({k.rsplit("#", 1)[0] for k in rows if "#" in k and not k.startswith("timeline|")})
    noisy = []
    for base in bases:
        rounds = rounds_of(rows, base)
        labels = tuple(k for k, v in rounds[0].items() if isinstance(v, dict))  # a configuration's run
        if len(rounds) > 1 and any(v["inner_spread"] > limit for k, v in summary_of_rounds(rounds, labels).items()
                                   if k != "load"):
            noisy.append(base)
    return noisy


def extend_noisy(plans: list[Plan], opts, rows: RowCache, limit: float, extra: int) -> None:
    """``extra`` more rounds for each plan with a configuration spread above ``limit``: from INNER_FROM
    rounds on, a stray process no longer counts (``inner_spread``). A plan extended once is not extended
    again (its rounds are then its own + ``extra``, measured or resumed)."""
    if extra <= 0:
        return
    noisy = set(noisy_keys(rows.rows, limit))
    more = [replace(p, rounds=(p.rounds or opts.repeats) + extra) for p in plans if p.base in noisy]
    if more:
        print(f"  noisy: {', '.join(p.name for p in more)}: {extra} more round(s)", flush=True)
        measure_rounds(more, opts, rows)


def drop_rounds(rows: dict, base: str) -> None:
    for key in [k for k in rows if k.rsplit("#", 1)[0] == base]:
        del rows[key]


def steps_for(predicted_s: float, opts) -> int:
    """Steady steps of one run: enough for ``opts.min_steady_s`` at the step time the model predicts, never
    fewer than ``opts.steps``. A step's time varies about +-5% step to step: the median of 20 steps of a
    65 ms step moved 65-72 ms between processes, of 100 steps 70-72 ms (docs/squinch-performance.md)."""
    return max(opts.steps, math.ceil(opts.min_steady_s / predicted_s))


@dataclass(frozen=True)
class Plan:
    """What one round of a group (or of the quarter row) measures: ``runs`` are (configuration, link rate,
    group for its flags, ranks per host, steady steps), in the order they run."""

    base: str
    name: str
    runs: tuple[tuple[str, float | None, Group, int, int], ...]
    rounds: int | None = None

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(label for label, *_ in self.runs)

    def describe(self, res: dict) -> str:
        return ", ".join(f"{k} {1e3 * res[k]['step_s']:.1f} ms" for k in self.labels)

    def measure(self, opts) -> dict:
        out = {"load": load()}
        for label, rate, group, per_host, steps in self.runs:
            setup_link(rate)
            out[label] = run_job(flags_of(group, label), per_host, steps, opts.warmup, CONFIGS[label][2] or None)
        return out


StepCounts = Callable[[Group, str], int]  # (group, configuration) -> steady steps of one run


def group_plan(group: Group, labels: tuple[str, ...], store: str, steps: StepCounts,
               rounds: int | None = None) -> Plan:
    return Plan(store, f"{group.key} {link_name(group.rate)}",
                tuple((label, group.rate, group, group.dp // 2, steps(group, label)) for label in labels), rounds)


def quarter_plan(size: str, b_mbit: float, steps: StepCounts, rounds: int | None = None) -> Plan:
    """Squinch at B/4 against fp32 at B, both with overlap, the links alternating run by run."""
    links = [(label, Group(size, 2, rate, True, ())) for label, rate in (("fp32", b_mbit), ("squinch", b_mbit / 4))]
    return Plan(quarter_base(size, b_mbit), f"quarter {size} B = {b_mbit:.0f} Mbit/s",
                tuple((label, g.rate, g, 1, steps(g, label)) for label, g in links), rounds)


def quarter_base(size: str, b_mbit: float) -> str:
    return f"quarter-fp32|{size}|{b_mbit:.4g}"


def measure_rounds(plans: list[RoundPlan], opts, rows: RowCache, rounds: int | None = None) -> None:
    """Each plan's rounds (its own, else ``opts.repeats``; at most ``rounds``): round i of each plan before
    round i + 1 of any, so that a group's repeats fall minutes apart and a slow minute of the machine moves
    one repeat of several groups, not the median of one (the configurations of a group still alternate
    within a round)."""
    def count(plan: RoundPlan) -> int:
        own = plan.rounds or opts.repeats
        return own if rounds is None else min(own, rounds)

    for i in range(max(map(count, plans), default=0)):
        for plan in plans:
            key = round_key(plan.base, i)
            if i >= count(plan) or key in rows.rows:  # done, or measured by an earlier invocation of this run
                continue
            t0 = time.time()
            res = rows.rows[key] = plan.measure(opts)
            res["wall_s"] = time.time() - t0
            rows.save()
            print(f"  round {i + 1}/{count(plan)} {plan.name}: {plan.describe(res)} ({res['load']})", flush=True)


def reused_part(group: Group, reuse: dict) -> dict:
    return {k: v for k, v in reuse.get(group.key, {}).items() if k in group.configs}


def store_of(group: Group, reuse: dict) -> str:
    """Where a group's measured configurations are kept: next to a reused part, under their own key."""
    return group.key + ("|rest" if reused_part(group, reuse) else "")


def group_rows(group: Group, opts, rows: RowCache, reuse: dict) -> dict:
    """A group's summaries: the reusable rows plus its rounds measured here."""
    old = reused_part(group, reuse)
    missing = tuple(k for k in group.configs if k not in old)
    new = summary_of_rounds(rounds_of(rows.rows, store_of(group, reuse)), missing) if missing else {}
    if old:
        print(f"  {group.key}: reused {', '.join(old)} from {opts.reuse}", flush=True)
    return {**{k: {**v, "reused": True} for k, v in old.items()}, **{k: v for k, v in new.items() if k != "load"},
            "load": new.get("load", "reused rows")}


def quarter_group(size: str, b_mbit: float, compute_s: float, fp32_bytes: int, rows: RowCache) -> dict:
    res = summary_of_rounds(rounds_of(rows.rows, quarter_base(size, b_mbit)), ("fp32", "squinch"))
    return {"size": size, "B_mbit": b_mbit, "compute_s": compute_s, "fp32_bytes": fp32_bytes, **res,
            "squinch/fp32": paired_ratio(res, "squinch", "fp32")}


# --------------------------------------------------------------------------------------- the model
def op_costs(fits: dict) -> dict[str, OpCost]:
    return {k: OpCost(f["alpha_s"], f["bytes_per_s"], issue_s=f["issue_s"], cpu_s_per_byte=f["cpu_s_per_byte"],
                      issue_s_per_byte=f["issue_s_per_byte"]) for k, f in fits.items()}


def inter_tier(phases: dict, rate: float | None) -> Tier:
    """The veth at ``rate``: its own fit if the phases measured it, else each collective's efficiency
    (beta / rate), alpha, issue and transport CPU interpolated in log(rate) between the two measured shaped
    rates around it (the nearest one's outside them)."""
    links = phases["fits"]["links"]
    if rate is None or rate_key(rate) in links:
        fits = links[rate_key(rate)]
    else:
        shaped = sorted((float(k), v) for k, v in links.items() if k not in ("unshaped", "loopback"))
        (lo, f_lo) = ([x for x in shaped if x[0] < rate] or shaped[:1])[-1]
        (hi, f_hi) = ([x for x in shaped if x[0] > rate] or shaped[-1:])[0]
        w = math.log(rate / lo) / math.log(hi / lo) if hi != lo else 0.0
        keys = ("alpha_s", "issue_s", "issue_s_per_byte", "cpu_s_per_byte")
        fits = {}
        for name in f_lo:
            a, b = f_lo[name], f_hi[name]
            fits[name] = {k: (1 - w) * a[k] + w * b[k] for k in keys}
            fits[name]["bytes_per_s"] = rate * ((1 - w) * a["bytes_per_s"] / lo + w * b["bytes_per_s"] / hi)
    costs = op_costs(fits)
    refill = rate * 1e6 / 8 if rate is not None else 0.0
    return Tier(costs["allreduce_fp32"], costs, burst_bytes=TBF_BURST if rate is not None else 0.0,
                refill_bytes_per_s=refill)


def codec_of(phases: dict) -> CodecCost:
    c = phases["fits"]["codec"]
    return CodecCost(c["encode_elems_per_s"], c["decode_accumulate_elems_per_s"], c["decode_elems_per_s"],
                     c["memory_bytes_per_s"], c["launch_s"], per_rank_launches=True, on_host=True)


def shared_cores(phases: dict, dp: int) -> float:
    """How many ranks share one core of the machine that measured ``phases`` (at least 1): the phases ran
    2 processes, a DP = 4 job runs 4 on the same 2 cores, so each rank's host work (codec, gloo's issue and
    transport CPU, the loopback's copies) runs at half the measured speed. 1 where the phases do not say
    how many CPUs measured them (a synthetic input)."""
    cpus = cpus_of_load_line(phases.get("load_before", ""))
    return max(1.0, dp / cpus) if cpus else 1.0


def on_shared_cores(cost: OpCost, share: float, beta_is_cpu: bool) -> OpCost:
    """``cost`` for a rank with 1 / ``share`` of a core: host time x share; bandwidth too where the CPU
    moves the bytes (the loopback), not where a shaper does (the veth)."""
    return replace(cost, issue_s=cost.issue_s * share, issue_s_per_byte=cost.issue_s_per_byte * share,
                   cpu_s_per_byte=cost.cpu_s_per_byte * share,
                   bytes_per_s=cost.bytes_per_s / share if beta_is_cpu else cost.bytes_per_s)


def tier_on_shared_cores(tier: Tier, share: float, beta_is_cpu: bool) -> Tier:
    return replace(tier, default=on_shared_cores(tier.default, share, beta_is_cpu),
                   ops={k: on_shared_cores(v, share, beta_is_cpu) for k, v in tier.ops.items()})


def codec_on_shared_cores(codec: CodecCost, share: float) -> CodecCost:
    return replace(codec, encode_elems_per_s=codec.encode_elems_per_s / share,
                   decode_accumulate_elems_per_s=codec.decode_accumulate_elems_per_s / share,
                   decode_elems_per_s=codec.decode_elems_per_s / share,
                   memory_bytes_per_s=codec.memory_bytes_per_s / share, launch_s=codec.launch_s * share)


def predict_row(phases: dict, timeline: dict, dp: int, rate: float | None, overlap: bool, label: str):
    """The model's step for one real row: the phase fits (host costs on the cores each rank has,
    ``shared_cores``) and the row's (model, DP) timeline, which already ran DP processes."""
    share = shared_cores(phases, dp)
    loop = op_costs(phases["fits"]["links"]["loopback"])
    topo = Topology(dp=dp, ranks_per_node=dp // 2,
                    intra=tier_on_shared_cores(Tier(loop["allreduce_fp32"], loop), share, beta_is_cpu=True),
                    inter=tier_on_shared_cores(inter_tier(phases, rate), share, beta_is_cpu=False),
                    reduce_scatter="all_to_all")
    mode = CONFIGS[label][1]
    return predict(timeline_of(timeline), topo, codec_on_shared_cores(codec_of(phases), share), ReducerMode(
        mode.reducer, hierarchical=mode.hierarchical, overlap=overlap, stages=mode.stages))


def compared_b(path: str | None, size: str) -> float | None:
    """The B of the run this one is compared with (``--compare``), when it measured the same model: a
    repeat then measures the same links, and its ratios differ by the machine alone (B from each run's own
    compute moved 666 -> 695 Mbit/s between two runs, and Squinch's step at B/4 with it)."""
    if not path:
        return None
    with open(path) as f:
        q = json.load(f).get("quarter") or {}
    return q["B_mbit"] if q.get("size") == size else None


def model_steps(phases: dict, first_timelines: dict[str, dict], opts) -> StepCounts:
    """Each configuration's steady steps (``steps_for``) at the step the model predicts from the phase fits
    and the first round of its timeline: only the number of steps comes from the model, never a time."""
    def steps(g: Group, label: str) -> int:
        tl = first_timelines[f"{g.size}|{g.dp}"]
        return steps_for(predict_row(phases, tl, g.dp, g.rate, g.overlap, label).step_s, opts)
    return steps


def validate(groups: list[tuple[Group, dict]], quarter: dict | None, timelines: dict, phases: dict) -> dict:
    rows = []
    for g, res in groups:
        tl = timelines[f"{g.size}|{g.dp}"]
        for label in g.configs:
            p = predict_row(phases, tl, g.dp, g.rate, g.overlap, label)
            m = res[label]["median_s"]
            rows.append({"size": g.size, "dp": g.dp, "link": link_name(g.rate), "overlap": g.overlap,
                         "config": label, "measured_s": m, "spread": res[label]["spread"],
                         "inner_spread": judged_spread(res[label]),
                         "steps": res[label].get("steps"),  # absent from a reused row
                         "reused": res[label].get("reused", False), "predicted_s": p.step_s,
                         "ratio": p.step_s / m, "exposed_s": p.exposed_s, "compute_s": p.compute_s})
    if quarter:
        tl = timelines[f"{quarter['size']}|2"]
        for label, rate in (("fp32", quarter["B_mbit"]), ("squinch", quarter["B_mbit"] / 4)):
            p = predict_row(phases, tl, 2, rate, True, label)
            m = quarter[label]["median_s"]
            rows.append({"size": quarter["size"], "dp": 2, "link": link_name(round(rate, 1)), "overlap": True,
                         "config": label + " (quarter)", "measured_s": m, "spread": quarter[label]["spread"],
                         "inner_spread": judged_spread(quarter[label]),
                         "steps": quarter[label].get("steps"), "reused": False, "predicted_s": p.step_s,
                         "ratio": p.step_s / m, "exposed_s": p.exposed_s, "compute_s": p.compute_s})
        q_pred = rows[-1]["predicted_s"] / rows[-2]["predicted_s"]
        quarter["predicted squinch/fp32"] = q_pred
    errs = [abs(r["ratio"] - 1) for r in rows]
    return {"rows": rows, "median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}


# ------------------------------------------------------------------------------------------ report
def ratios(res: dict) -> dict[str, float]:
    """Every ratio of a run by a stable name: measured ratios within a group, predicted / measured."""
    out = {}
    for g in res["groups"]:
        first = g["configs"][0]
        for label in g["configs"][1:]:
            out[f"{g['key']} {label}/{first}"] = g["rows"][label]["median_s"] / g["rows"][first]["median_s"]
    if res.get("quarter"):
        out[f"quarter {res['quarter']['size']} squinch(B/4)/fp32(B)"] = res["quarter"]["squinch/fp32"]["ratio"]
    for r in res["validation"]["rows"]:
        # a quarter row's link is B (or B/4), which each run derives from its own compute: named by its role
        link = "B/4" if r["config"] == "squinch (quarter)" else "B" if r["config"] == "fp32 (quarter)" else r["link"]
        out[f"predicted/measured dp{r['dp']} {r['size']} {link} overlap={r['overlap']} {r['config']}"] = r["ratio"]
    return out


def compare(first: dict, second: dict, limit: float) -> list[str]:
    return drift_lines(ratios(first), ratios(second), limit)


def report(res: dict) -> list[str]:
    v = res["validation"]
    L = ["# Squinch step time: the model against real runs over the shaped veth", "",
         f"Run id {res['run_id']}; {res['settings']['repeats']} rounds over the whole set{large_rounds(res)} "
         f"(a group's configurations alternate within a round), {steady_steps(res['settings'])} per configuration "
         f"and round; measured = median over the rounds.{extended(res)} "
         f"The model sees only the phase fits (`squinch_phases`) "
         f"and one backward timeline per model and DP{timeline_processes(res)}. "
         f"Machine before: {res['load_before']}; after: {res['load_after']}; wall time {res['wall_s'] / 60:.1f} min"
         f"{invocations(res)} "
         f"({wall_parts(res)}).", "",
         f"**Model error over {len(v['rows'])} rows: median {100 * v['median_abs_error']:.1f}%, "
         f"max {100 * v['max_abs_error']:.1f}%** (acceptance: 10% / 20%).", "",
         "| DP | model | link | overlap | reducer | steps | measured ms [spread] | predicted ms "
         "| predicted / measured |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in v["rows"]:
        L.append(f"| {r['dp']} | {r['size']} | {r['link']} | {'yes' if r['overlap'] else 'no'} | {r['config']}"
                 f"{' (reused)' if r['reused'] else ''} | {steps_cell(r.get('steps'), res['settings'])} | "
                 f"{1e3 * r['measured_s']:.1f} [{100 * r['spread']:.0f}%] | "
                 f"{1e3 * r['predicted_s']:.1f} | {r['ratio']:.3f} |")
    q = res.get("quarter")
    if q:
        L += ["", f"## Quarter bandwidth, {q['size']} model: Squinch at B/4 against fp32 at B, with overlap", "",
              f"{b_origin(q)}. fp32 at B: {1e3 * q['fp32']['median_s']:.1f} ms; "
              f"Squinch at B/4: {1e3 * q['squinch']['median_s']:.1f} ms; **ratio {q['squinch/fp32']['ratio']:.3f}** "
              f"[{q['squinch/fp32']['min']:.3f}-{q['squinch/fp32']['max']:.3f}] (acceptance: <= 1.0); "
              f"the model predicted {q['predicted squinch/fp32']:.3f}."]
    L += ["", "## Backward timelines (the model's compute input; ms on the compute-only clock)", "",
          "| model, DP | buckets | first ready | backward end | after the sync | raw step | profile |",
          "|---|---|---|---|---|---|---|"]
    for k, t in res["timelines"].items():
        L.append(f"| {k.replace('|', ', DP ')} | {len(t['bucket_elems'])} ({sum(t['bucket_elems'])} el) | "
                 f"{t['ready_ms'][0]:.1f} | {t['backward_end_ms']:.1f} | {t['after_sync_ms']:.1f} | "
                 f"{t['raw_step_ms']:.1f} | {t['profile']} |")
    if res.get("compare"):
        L += ["", f"## Against {res['compare']['path']} (a ratio may move by at most "
              f"{100 * res['compare']['limit']:.0f}%)", "", *[f"- {x}" for x in res["compare"]["lines"]]]
    return L


DOC = os.path.join(ROOT, "docs", "squinch-performance.md")
DOC_BEGIN, DOC_END = "<!-- squinch_scale: begin -->", "<!-- squinch_scale: end -->"


def large_rounds(res: dict) -> str:
    n = res["settings"].get("repeats_large", res["settings"]["repeats"])
    return "" if n == res["settings"]["repeats"] else f", {n} over the large model's groups and the quarter row"


def extended(res: dict) -> str:
    """The groups (and quarter row) that took more rounds than planned (``extend_noisy``), with their count."""
    planned = res["settings"]["repeats"]
    large = res["settings"].get("repeats_large", planned)
    parts = [(g["key"], g["size"], next((len(r["runs_s"]) for r in g["rows"].values()
                                         if isinstance(r, dict) and not r.get("reused")), 0)) for g in res["groups"]]
    if res.get("quarter"):
        q = res["quarter"]
        parts.append((f"quarter {q['size']}", q["size"], len(q["fp32"]["runs_s"])))
    big = res["quarter"]["size"] if res.get("quarter") else "large"  # the model --repeats-large is for ("toy": --quick)
    more = [f"{key} {n}" for key, size, n in parts if n > (large if size == big else planned)]
    return f" Noisy after its planned rounds, so measured in more (--extra-rounds): {', '.join(more)}." if more else ""


def b_origin(q: dict) -> str:
    own_b = q.get("own_B_mbit", q["B_mbit"])
    why = f"fp32's {q['fp32_bytes']} gradient bytes per step over the {1e3 * q['compute_s']:.0f} ms of compute"
    if own_b == q["B_mbit"]:
        return f"B = {q['B_mbit']:.0f} Mbit/s ({why})"
    return (f"B = {q['B_mbit']:.0f} Mbit/s, the B of the run compared with, so that both runs measure the same "
            f"links ({why} give {own_b:.0f} Mbit/s)")


def steady_steps(settings: dict) -> str:
    if not settings.get("min_steady_s"):
        return f"{settings['steps']} steady steps (after {settings['warmup']})"
    return (f"at least {settings['steps']} steady steps (after {settings['warmup']}), and enough for "
            f"{settings['min_steady_s']:g} s at the model's predicted step (column steps)")


def steps_cell(steps: list[int] | None, settings: dict) -> str:
    if not steps:  # a reused row (measured with settings["steps"]), or a run before step counts were recorded
        return str(settings["steps"])
    return str(steps[0]) if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}"


def timeline_processes(res: dict) -> str:
    runs = sorted({t.get("runs", 1) for t in res["timelines"].values()})
    if runs == [1]:
        return ""
    return f" (the median of {runs[0]}{'' if len(runs) == 1 else '-' + str(runs[-1])} processes)"


def wall_parts(res: dict) -> str:
    parts = {"phases": res["phases_wall_s"], **res.get("parts_wall_s", {})}
    return ", ".join(f"{k} {v / 60:.1f} min" if v >= 1 or k != "phases" else "phases in an earlier invocation, "
                     "time not recorded" for k, v in parts.items())


def invocations(res: dict) -> str:
    n = res.get("invocations", 1)
    return f" over {n} invocations" if n > 1 else ""


def doc_section(runs: list[dict], phases: dict) -> list[str]:
    """The measured section of docs/squinch-performance.md: the fits of the first run's phases, and
    every run's model error and quarter-bandwidth row."""
    L = ["## Measured here", "", f"Phases: {phases['load_before']} (`bench/results/squinch_phases.md`). "
         "alpha per algorithm step (us) / beta per direction (Mbit/s), per collective:", "",
         "| link | fp32 all-reduce | bf16 all-reduce | fp32 reduce-scatter | all-to-all (uint8) | all-gather (uint8) |",
         "|---|---|---|---|---|---|"]
    for key, fits in phases["fits"]["links"].items():
        cells = [fits[k] for k in ("allreduce_fp32", "allreduce_bf16", "reduce_scatter_fp32", "all_to_all",
                                   "all_gather")]
        L.append(f"| {squinch_phases.link_label(key)} | " + " | ".join(
            f"{1e6 * f['alpha_s']:.0f} / {8 * f['bytes_per_s'] / 1e6:.0f}" for f in cells) + " |")
    c = phases["fits"]["codec"]
    L += ["", f"Codec on one CPU thread: encode with error feedback {c['encode_elems_per_s'] / 1e6:.0f} M el/s, "
          f"decode-accumulate {c['decode_accumulate_elems_per_s'] / 1e6:.0f} M el/s, decode "
          f"{c['decode_elems_per_s'] / 1e6:.0f} M el/s, {1e6 * c['launch_s']:.1f} us per call.", "",
          "| run | rows | model error: median / max | Squinch at B/4 / fp32 at B (large model): measured / predicted "
          "| wall time |", "|---|---|---|---|---|"]
    for r in runs:
        v, q = r["validation"], r["quarter"]
        L.append(f"| {r['run_id']} | {len(v['rows'])} | {100 * v['median_abs_error']:.1f}% / "
                 f"{100 * v['max_abs_error']:.1f}% | {q['squinch/fp32']['ratio']:.3f} / "
                 f"{q['predicted squinch/fp32']:.3f} | {r['wall_s'] / 60:.1f} min{invocations(r)} |")
        if r.get("compare"):
            moved = [x for x in r["compare"]["lines"] if x.startswith("DRIFT")]
            L.append(f"| {r['run_id']} vs {r['compare']['path']} | {len(r['compare']['lines'])} ratios | "
                     f"{len(moved)} moved by more than {100 * r['compare']['limit']:.0f}% | | |")
    return L + ["", "Per row: `bench/results/squinch_scale.md` (run 1) and `squinch_scale_run<id>.md`."]


def update_doc(results_dir: str, phases: dict) -> None:
    """Rewrite the measured section of the doc from every committed run of this bench."""
    runs = []
    for name in sorted(os.listdir(results_dir)):
        if re.fullmatch(r"squinch_scale(_run\w+)?\.json", name):
            with open(os.path.join(results_dir, name)) as f:
                runs.append(json.load(f))
    with open(DOC) as f:
        text = f.read()
    head, rest = text.split(DOC_BEGIN)
    _, tail = rest.split(DOC_END)
    with open(DOC, "w") as f:
        f.write(head + DOC_BEGIN + "\n" + "\n".join(doc_section(runs, phases)) + "\n" + DOC_END + tail)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["validation"]["rows"]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for dp, marker in ((2, "o"), (4, "s")):
        sel = [r for r in rows if r["dp"] == dp]
        ax.scatter([1e3 * r["measured_s"] for r in sel], [1e3 * r["predicted_s"] for r in sel], marker=marker,
                   label=f"DP = {dp}")
    lo = min(1e3 * min(r["measured_s"], r["predicted_s"]) for r in rows) * 0.8
    hi = max(1e3 * max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.25
    for f, style in ((1.0, "-"), (1.1, ":"), (0.9, ":"), (1.2, "--"), (0.8, "--")):
        ax.plot([lo, hi], [lo * f, hi * f], style, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured step (ms)", ylabel="predicted step (ms)",
           title="step-time model vs real runs (shaped veth)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _first_phases(results_dir: str, fallback: dict) -> dict:
    path = os.path.join(results_dir, "squinch_phases.json")
    if not os.path.exists(path):
        return fallback
    with open(path) as f:
        return json.load(f)


def add_comparison(res: dict, path: str, limit: float) -> None:
    with open(path) as f:
        lines = compare(json.load(f), res, limit)
    res["compare"] = {"path": os.path.relpath(path, ROOT), "limit": limit, "lines": lines}


def measured_groups(res: dict) -> list[tuple[Group, dict]]:
    """A finished run's groups with their measured rows, as ``validate`` takes them."""
    return [(Group(g["size"], g["dp"], None if (r := g["key"].split("|")[2]) == "unshaped" else float(r), g["overlap"],
                   tuple(g["configs"])), g["rows"]) for g in res["groups"]]


def rerender(out: str, opts, results: str, doc: bool) -> None:
    """The report, plot (and, for the committed results, the doc section) of a finished run from its JSON
    (``--rerender``), with today's fits of its phases' samples and today's model on its measurements
    (run 1 first: a repeat's comparison reads run 1's JSON)."""
    with open(out + ".json") as f:
        res = json.load(f)
    phases_out = os.path.join(os.path.dirname(out), os.path.basename(out).replace("squinch_scale", "squinch_phases"))
    with open(phases_out + ".json") as f:
        phases = json.load(f)
    phases["fits"] = squinch_phases.fits_of(phases)
    squinch_phases.write(phases_out, phases)
    res["validation"] = validate(measured_groups(res), res["quarter"], res["timelines"], phases)
    if opts.compare:
        add_comparison(res, opts.compare, opts.max_drift)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("\n".join(report(res)) + "\n")
    plot(res, out + ".png")
    if doc:
        update_doc(results, _first_phases(results, {}))
    print(f"rendered {out}.md, .png from {out}.json")


# -------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "squinch_scale", from_json=False)
    squinch_phases.add_args(p)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-steady-s", dest="min_steady_s", type=float, default=4.0,
                   help="more steady steps where the model predicts a short step: at least this many seconds of them")
    p.add_argument("--repeats-real", dest="repeats_real", type=int, default=4, help="repeats of each training run")
    p.add_argument("--repeats-large", dest="repeats_large", type=int, default=5,
                   help="repeats of the large model's runs (its timeline, its groups and the quarter row): 20 steps "
                        "of 0.3-0.6 s each, where the machine's drift over minutes shows")
    p.add_argument("--run-id", default="1")
    p.add_argument("--fresh", action="store_true", help="discard this run id's finished measurements")
    p.add_argument("--reuse", default="none", help="a squinch_bandwidth rows file measured on this same tree whose "
                                                  "finished rows are reused (default: none, measure all)")
    p.add_argument("--compare", default=None, help="an earlier run's JSON: report each ratio's drift")
    p.add_argument("--max-drift", type=float, default=0.05)
    p.add_argument("--max-spread", type=float, default=0.10,
                   help="a configuration whose repeats spread more than this is noisy: its group gets --extra-rounds "
                        "more rounds; still noisy, nothing is written (exit 3)")
    p.add_argument("--extra-rounds", dest="extra_rounds", type=int, default=2,
                   help="more rounds for a noisy group: from 5 rounds on, its fastest and slowest no longer count "
                        "towards the spread (one stray process does not move a median of 5)")
    p.add_argument("--drop-noisy", action="store_true",
                   help="forget this run id's noisy groups first, so that they are measured again")
    p.add_argument("--no-projection", action="store_true", help="skip squinch_cluster_projection")
    p.add_argument("--rerender", action="store_true", help="measure nothing: render this run id's report (its "
                   "comparison again with --compare) and the doc's section from its JSON")
    out_default = p.get_default("out")
    opts = p.parse_args(argv)  # its --quick (the chain over a shaped link, toy sizes) is set below
    given_out = None if opts.out == out_default else opts.out
    t_start = time.time()
    where = "results"
    if opts.quick:
        squinch_phases.quick(opts)
        opts.steps, opts.warmup, opts.repeats_real, opts.repeats_large, opts.min_steady_s = 4, 2, 2, 2, 0.0
        opts.extra_rounds = 0  # a smoke run: its toy steps are noisy, and nothing is refused for it
        where = ".cache"
    elif opts.repeats < 3 or opts.repeats_real < 3 or opts.repeats_large < 3 or opts.steps < 20:
        p.error("a measurement needs --repeats, --repeats-real and --repeats-large >= 3, and --steps >= 20 "
                "(--quick for a smoke run)")
    tag = f"quick{opts.run_id}" if opts.quick else opts.run_id
    suffix = "" if opts.run_id == "1" else f"_run{opts.run_id}"
    results = os.path.join(ROOT, "bench", where)
    out = given_out or os.path.join(results, "squinch_scale" + ("_quick" if opts.quick else suffix))
    if opts.rerender:
        rerender(out, opts, results, doc=given_out is None and not opts.quick)
        return
    print(load(), flush=True)
    res = {"run_id": opts.run_id, "load_before": load(), "settings": {
        "repeats": opts.repeats_real, "repeats_large": opts.repeats_large, "steps": opts.steps, "warmup": opts.warmup,
        "min_steady_s": opts.min_steady_s, "phase_repeats": opts.repeats}}

    # 1. phases
    phase_rows = RowCache(os.path.join(results, f"squinch_phases_rows_{tag}.json"), squinch_phases.row_settings(opts),
                          opts.fresh)
    t0 = time.time()
    phases = squinch_phases.run(opts, phase_rows)
    phase_rows.spent.append(time.time() - t0)  # a resumed run's phases were measured by an earlier invocation
    phase_rows.save()
    res["phases_wall_s"] = sum(phase_rows.spent)
    squinch_phases.write(os.path.join(results, "squinch_phases" + ("_quick" if opts.quick else suffix)), phases)

    # 2.-3. timelines and the real set
    real = argparse.Namespace(repeats=opts.repeats_real, steps=opts.steps, warmup=opts.warmup, reuse=None,
                              min_steady_s=opts.min_steady_s)
    settings = {k: getattr(real, k) for k in ROW_SETTINGS}
    rows = RowCache(os.path.join(results, f"squinch_scale_rows_{tag}.json"),
                    {"format": ROW_FORMAT, **settings, "min_steady_s": opts.min_steady_s,
                     "repeats_large": opts.repeats_large}, opts.fresh)
    reuse_path = "none" if opts.quick else opts.reuse
    reuse = {}
    if reuse_path != "none" and os.path.exists(reuse_path):
        with open(reuse_path) as f:
            saved = json.load(f)
        if json.loads(saved.get("settings", "{}")) == settings:
            reuse, real.reuse = saved["rows"], os.path.relpath(reuse_path, ROOT)
    groups = QUICK_SET if opts.quick else REAL_SET
    if opts.drop_noisy:
        for base in noisy_keys(rows.rows, opts.max_spread):
            print(f"  dropping noisy {base}: every round measured again", flush=True)
            drop_rounds(rows.rows, base)
        rows.save()
    big = "toy" if opts.quick else "large"
    try:
        profiles = [TimelinePlan(size, dp, opts.repeats_large if size == big else None)  # as its rows
                    for size, dp in sorted({(g.size, g.dp) for g in groups} | {(big, 2)})]
        measure_rounds(profiles, real, rows, rounds=1)  # the first round up front: B is the large model's
        first = rounds_of(rows.rows, TimelinePlan(big, 2).base)[0]
        fp32_bytes = 4 * sum(first["bucket_elems"])  # all-reduce at n = 2: S per rank
        compute_s = (first["backward_end_ms"] + first["after_sync_ms"]) / 1e3
        own_b = fp32_bytes * 8 / compute_s / 1e6  # B: fp32's gradient bytes take as long as the compute
        b_mbit = compared_b(opts.compare, big) or own_b  # a repeat measures the same quarter row
        steps = model_steps(phases, {f"{p.size}|{p.dp}": rounds_of(rows.rows, p.base)[0] for p in profiles}, real)
        plans = [group_plan(g, missing, store_of(g, reuse), steps, opts.repeats_large if g.size == big else None)
                 for g in groups if (missing := tuple(k for k in g.configs if k not in reused_part(g, reuse)))]
        quarter_row = quarter_plan(big, b_mbit, steps, opts.repeats_large)
        measure_rounds(profiles + plans + [quarter_row], real, rows)
        extend_noisy(plans + [quarter_row], real, rows, opts.max_spread, opts.extra_rounds)
        timelines = {f"{p.size}|{p.dp}": timeline_of_rounds([run for r in rounds_of(rows.rows, p.base)
                                                             for run in r["per_run"]]) for p in profiles}
        measured = [(g, group_rows(g, real, rows, reuse)) for g in groups]
        res["parts_wall_s"] = {name: sum(r["wall_s"] for p in part for r in rounds_of(rows.rows, p.base))
                               for name, part in (("timelines", profiles), ("real set", plans),
                                                  ("quarter row", [quarter_row]))}
        quarter = {**quarter_group(big, b_mbit, compute_s, fp32_bytes, rows), "own_B_mbit": own_b}
    finally:
        teardown_link()
    # a refused (noisy) invocation's measurements are part of this run when it resumes: its time counts too
    rows.spent.append(time.time() - t_start)
    rows.save()
    res["timelines"] = timelines
    res["groups"] = [{"key": g.key, "size": g.size, "dp": g.dp, "link": link_name(g.rate), "overlap": g.overlap,
                      "configs": list(g.configs), "rows": r} for g, r in measured]
    res["quarter"] = quarter

    validation = validate(measured, quarter, timelines, phases)
    noisy = [f"{r['size']} DP {r['dp']} {r['link']} overlap={r['overlap']} {r['config']}: spread "
             f"{100 * r['inner_spread']:.0f}%" for r in validation["rows"]
             if r["inner_spread"] > opts.max_spread and not r["reused"]]
    if noisy and not opts.quick:
        os.makedirs(os.path.join(ROOT, "bench", ".cache"), exist_ok=True)
        with open(os.path.join(ROOT, "bench", ".cache", "squinch_scale_refused.json"), "w") as f:
            json.dump({**res, "noisy": noisy}, f, indent=1)
        print(f"\nNOT WRITING RESULTS: {len(noisy)} configuration(s) spread more than {100 * opts.max_spread:.0f}% "
              f"over their repeats:\n  " + "\n  ".join(noisy) + f"\nre-measure them on a quiet machine: "
              f"python bench/squinch_scale.py --run-id {opts.run_id} --drop-noisy", flush=True)
        sys.exit(3)

    # 4.-5. the model against them
    res["validation"] = validation
    res["load_after"], res["wall_s"], res["invocations"] = load(), sum(rows.spent), len(rows.spent)
    if opts.compare:
        add_comparison(res, opts.compare, opts.max_drift)
    lines = report(res)
    print("\n".join(lines), flush=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(res, out + ".png")
    print(f"wrote {out}.json, .md, .png")
    if not opts.quick and given_out is None:
        update_doc(results, phases if opts.run_id == "1" else _first_phases(results, phases))

    # 6. the projection (the model on clusters; no measurement)
    if not opts.no_projection:
        import squinch_cluster_projection

        squinch_cluster_projection.main(["--quick"] if opts.quick else [])
    if res.get("compare") and any(x.startswith("DRIFT") for x in res["compare"]["lines"]):
        sys.exit(4)


if __name__ == "__main__":
    main()

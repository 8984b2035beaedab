"""Statistics the benches report: alternated repeats, medians with their spread, means over seeds, paired gaps."""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from typing import Any


def alternate(configs: dict[str, Callable[[], Any]], repeats: int, *, mirror: bool = False) -> dict[str, list]:
    """Run every configuration ``repeats`` times, interleaved (A B A B ...; with ``mirror``, A B B A ...), so
    that a drift of the machine's speed falls on all of them alike. Returns each one's results in order."""
    out: dict[str, list] = {k: [] for k in configs}
    for r in range(repeats):
        order = list(configs)
        if mirror and r % 2:
            order.reverse()
        for k in order:
            out[k].append(configs[k]())
    return out


def spread(values: Iterable[float | None]) -> dict:
    """Median, min, max and (max - min) / median of the values that are not None (all None if none are)."""
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "spread": None}
    med = statistics.median(v)
    return {"median": med, "min": min(v), "max": max(v), "spread": (max(v) - min(v)) / med if med else None}


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    v = [float(x) for x in values]
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def seed_summary(per_seed: dict, key: str) -> dict:
    """{'mean', 'std', 'values'} of ``per_seed[seed][key]`` over the seeds."""
    vals = [per_seed[s][key] for s in sorted(per_seed, key=int)]
    m, sd = mean_std(vals)
    return {"mean": m, "std": sd, "values": vals}


def paired_gap(per_seed: dict, baseline: dict, key: str) -> dict:
    """Per-seed gap of ``key`` to the baseline run of the same seed: absolute and relative (%)."""
    seeds = sorted(set(per_seed) & set(baseline), key=int)
    diff = [per_seed[s][key] - baseline[s][key] for s in seeds]
    rel = [100.0 * (per_seed[s][key] / baseline[s][key] - 1.0) for s in seeds]
    (dm, ds), (rm, rs) = mean_std(diff), mean_std(rel)
    return {"diff_mean": dm, "diff_std": ds, "rel_pct_mean": rm, "rel_pct_std": rs, "diff": diff, "rel_pct": rel}


def fmt_pm(mean: float, std: float, digits: int = 4) -> str:
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def count_spikes(losses: list[float], window: int = 10, jump: float = 0.5) -> int:
    """Iterations whose loss is non-finite or exceeds the median of the previous ``window`` by > ``jump``."""
    spikes = 0
    for i, v in enumerate(losses):
        if not math.isfinite(v):
            spikes += 1
        elif i >= 2 and v - statistics.median(losses[max(0, i - window):i]) > jump:
            spikes += 1
    return spikes

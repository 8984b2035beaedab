"""DiLoCo across islands against synchronous data parallelism over a slow link (docs/diloco.md).

Part 1, measured: 2 islands x 2 ranks, each island in its own network namespace, joined by a veth link shaped
to --rates Mbit/s both ways (unshaped inside an island; "unshaped" is the compute reference). Per link rate and
seed, the same small GPT on the demo corpus, the same tokens:

    dp fp32 | dp bf16 (--grad-reduce-in-bf16) | dp squinch (hierarchical: uncompressed inside an island)
    diloco 6 | diloco 16   (--diloco-islands 2, H = --inner-steps, K = --fragments, tau = --overlap)

Figures: the final validation loss (the last island's model, fixed held-out batches) at equal tokens, the
wall time of training, the bytes that crossed the slow link per token (the veth counters under namespaces,
else counted from the ranks' byte counts), the compute utilisation (DiLoCo: 1 - the inner loop's waits / wall;
DP: the unshaped run's wall / this one's) and the loss curves against tokens and wall time (the PNG).

Part 2, the model: every measured row predicted from its inner step time (DiLoCo: (wall - waits) / steps of
the same run; DP: the unshaped run) and its bytes over the link rate (core/diloco/outer_model.py); the
report states each row's error and whether all are within ERROR_BOUND.

Part 3, projection (arithmetic, no run): islands of 64 H100 (the inner step of
squinch_cluster_projection.py's model: 4M tokens per island per inner step, bf16 all-reduce inside at
3,200 Gbit/s per node), 2 and 8 islands joined at 100 and 10 Gbit/s per island: for fp32, bf16 and Squinch
pseudo-gradients, the least H that keeps compute utilisation >= 90% (K = 1 and K = 4 fragments, overlap up to
the next fragment's send), utilisation at H = 20 and 100, and synchronous DP's across the same link.

Every configuration of a seed starts from one checkpoint of --warm-start-iters synchronous DP iterations (as
DiLoCo's paper starts from a pretrained model) and the figures are the iterations after it; with
--warm-start-iters 0 every configuration trains from scratch (bench/results/diloco_scratch.md).

    python bench/diloco.py                  # needs root (namespaces, tc); long: run it on a quiet machine
    python bench/diloco.py --warm-start-iters 0 --configs "dp bf16" "diloco 6" --link-configs \
        --out bench/results/diloco_scratch  # the same from scratch, losses only
    python bench/diloco.py --projection-only  # part 3 only: seconds
    python bench/diloco.py --quick --no-netns  # every part at toy size on the loopback, one rate (CI)
"""
from __future__ import annotations

import os
import re
import statistics

import harness as H
from harness import shaped_link as link
from harness.data import QUICK, demo_corpus
from squinch_cluster_projection import COLUMNS, HBM, MODELS, Model, step

from megatron_cai.core.diloco.outer_model import (
    OuterLink,
    allreduce_s,
    min_inner_steps,
    utilisation,
    window_s,
    wire_bytes,
)

CORPUS_MB = 16.0  # the whole standard library (about 11 MB, 4M tokens): 600 iterations stay inside one epoch
ERROR_BOUND = 0.20  # the model's stated error on measured rows (part 2)
TARGET_RATE = "10"  # the link (Mbit/s, as a row's key) the Acceptance section's targets are stated for
ISLAND_GPUS = 64
WAN_ALPHA_S = 0.025  # one message's latency between islands
PROJECTION_H = (20, 100)
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "4", "--global-batch-size", "16"]
QUICK_MODEL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
               "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8"]
LOSS_RE = re.compile(r"iteration +(\d+)/ *\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+) .*?lm loss: ([0-9.E+-]+)")
VAL_RE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
OUTER_RE = re.compile(r"diloco outer .*?bytes sent (\d+) .*?inner loop waited ([0-9.]+) s")


# ------------------------------------------------------------------------------------------ part 1
# Options a finished row does not depend on (a row's key names its configuration, rate and seed): a run with
# another subset of them resumes from the rows an interrupted one finished (a finished run removes its rows file).
ROW_INDEPENDENT = ("out", "from_json", "configs", "link_configs", "rates", "seeds", "dp_link_seeds", "link_seeds",
                   "projection_only")


def configurations(opts) -> dict[str, list[str]]:
    diloco = ["--diloco-islands", "2", "--diloco-inner-steps", str(opts.inner_steps), "--diloco-fragments",
              str(opts.fragments), "--diloco-overlap-steps", str(opts.overlap), "--diloco-outer-lr",
              str(opts.outer_lr), "--diloco-outer-momentum", str(opts.outer_momentum)]
    every_step = ["--diloco-islands", "2", "--diloco-inner-steps", "1", "--diloco-outer-bits", "32",
                  "--diloco-outer-lr", "1", "--diloco-outer-momentum", "0"]
    return {"dp fp32": [], "dp bf16": ["--grad-reduce-in-bf16"],
            "dp squinch": ["--squinch", "--squinch-hierarchical", "--ranks-per-node", "2"],
            "diloco 6": diloco + ["--diloco-outer-bits", "6"], "diloco 16": diloco + ["--diloco-outer-bits", "16"],
            LOCAL_ADAM: every_step}


# The islands average their weights after every inner step, in fp32 (DiLoCo with H = 1, outer lr 1): what
# separates DiLoCo from DP before any outer loop or compression: each island's Adam steps on its half of the
# batch. Its loss is reported; over a link it would be as slow as fp32 DP, so it runs unshaped unless named.
LOCAL_ADAM = "islands avg every step"


def _veth_bytes() -> int | None:
    if not link.NETNS[0]:
        return None
    total = 0
    for ns, dev, _ in link.NS:
        out = os.popen(f"ip netns exec {ns} cat /sys/class/net/{dev}/statistics/tx_bytes").read().strip()
        total += int(out)
    return total


def _argv(flags: list[str], seed: int, opts, data: tuple[str, str]) -> list[str]:
    prefix, tokenizer = data
    return ["pretrain_gpt.py", *(QUICK_MODEL if opts.quick else MODEL), *flags, "--data-path", prefix,
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tokenizer, "--split", "949,50,1",
            "--lr", str(opts.lr), "--min-lr", str(opts.lr / 10), "--lr-decay-style", "cosine", "--seed", str(seed),
            "--lr-warmup-iters", str(opts.warmup_iters),
            "--train-iters", str(opts.iters), "--log-interval", "1", "--eval-interval", str(opts.iters),
            "--eval-iters", str(opts.eval_iters), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--position-embedding-type", "rope", "--num-workers", "0"]


def warm_start(seed: int, opts, data: tuple[str, str]) -> list[str]:
    """``--warm-start-iters W``: the flags that load the checkpoint every configuration of ``seed`` starts from,
    W iterations of synchronous fp32 DP on the run's own schedule (unshaped; trained once per seed and settings,
    kept in the cache). [] when W is 0 (every configuration from scratch)."""
    if not opts.warm_start_iters:
        return []
    data_key = "quick" if opts.quick else f"full{CORPUS_MB:g}mb"
    settings = f"{data_key}_s{seed}_w{opts.warm_start_iters}_of{opts.iters}_lr{opts.lr:g}_wu{opts.warmup_iters}"
    path = os.path.join(opts.cache_dir, f"warm_start_{settings}")
    if not os.path.exists(os.path.join(path, "latest_checkpointed_iteration.txt")):
        link.setup_link(None)
        link.spawn_ranks([*_argv([], seed, opts, data), "--save", path, "--ckpt-format", "torch",
                          "--exit-interval", str(opts.warm_start_iters)], per_ns=2)
    return ["--load", path, "--ckpt-format", "torch"]


def run(name: str, flags: list[str], rate, seed: int, opts, data: tuple[str, str]) -> dict:
    """One training run of ``name`` over a link of ``rate`` Mbit/s (None: unshaped): its figures, over the
    iterations after the warm start (all of them without one)."""
    argv = _argv([*flags, *warm_start(seed, opts, data)], seed, opts, data)
    link.setup_link(rate)
    before = _veth_bytes()
    log = link.spawn_ranks(argv, per_ns=2)[-1]
    after = _veth_bytes()
    its = [(int(i), float(ms) / 1000, float(loss)) for i, ms, loss in LOSS_RE.findall(log)]
    outer = [(int(b), float(w)) for b, w in OUTER_RE.findall(log)]
    comm = [int(b) for b in link.BYTES_RE.findall(log)]
    val = VAL_RE.findall(log)
    tokens = (opts.iters - opts.warm_start_iters) * (8 if opts.quick else 16) * (32 if opts.quick else 128)
    if outer:  # every outer byte of every rank crosses the link (the outer group pairs the islands' ranks)
        counted = 4 * sum(b for b, _ in outer)
    else:  # a ring over 4 ranks on 2 hosts: 2 of its 4 edges cross, each carrying one rank's bytes
        counted = 2 * sum(comm)
    return {"name": name, "rate": link.rate_key(rate), "seed": seed, "wall_s": sum(t for _, t, _ in its),
            "wait_s": sum(w for _, w in outer), "losses": [loss for _, _, loss in its],
            "times_s": [t for _, t, _ in its], "val_loss": float(val[-1][1]) if val else None,
            "crossing_bytes": (after - before) if before is not None else counted, "counted_bytes": counted,
            "measured_on": "veth counters" if before is not None else "rank byte counts", "tokens": tokens,
            "outer_bytes_per_rank": [b for b, _ in outer]}


def link_rows(entries: list[str]) -> dict[str, set]:
    """``--link-configs`` entries, ``NAME`` (every rate) or ``NAME@R1,R2`` (those Mbit/s only): name -> rates
    (None: every rate)."""
    out: dict[str, set] = {}
    for entry in entries:
        name, _, rates = entry.partition("@")
        out.setdefault(name, set()).update({float(r) for r in rates.split(",")} if rates else {None})
    return out


def link_seeds(opts, name: str) -> int | None:
    """Over how many of the first seeds ``name`` runs over a shaped link (None: all)."""
    return opts.dp_link_seeds if name.startswith("dp") and opts.dp_link_seeds is not None else opts.link_seeds


def measure(opts, results: H.Results) -> list[dict]:
    data = demo_corpus(opts.cache_dir, **({"vocab": QUICK["vocab"], "max_mb": QUICK["corpus_mb"]} if opts.quick
                                          else {"vocab": 2048, "max_mb": CORPUS_MB}))
    rows = []
    configs = configurations(opts)
    names = opts.configs or list(configs)
    over_link = link_rows(opts.link_configs if opts.link_configs is not None else
                          [n for n in names if n != LOCAL_ADAM])
    try:
        for rate in ([] if opts.quick else [None]) + list(opts.rates):  # --quick: no unshaped reference
            for seed in opts.seeds:
                for name in names:
                    if rate is not None and not over_link.get(name, set()) & {None, rate}:
                        continue
                    if rate is not None and seed not in opts.seeds[:link_seeds(opts, name)]:
                        continue  # the losses do not depend on the link: the unshaped run has them (see acceptance)
                    key = f"{name}|{link.rate_key(rate)}|{seed}"
                    row = results.row(key, lambda n=name, r=rate, s=seed: run(n, configs[n], r, s, opts, data))
                    rows.append({**row, **results.meta.get(key, {})})  # the load average it ran under, when
    finally:
        link.teardown_link()
    return rows


# ------------------------------------------------------------------------------------------ part 2
def predict(row: dict, rows: list[dict], opts) -> float | None:
    """The model's wall time for a measured row (None for the unshaped reference runs)."""
    if row["rate"] == "unshaped":
        return None
    steps = len(row["times_s"])
    # DiLoCo: the outer payload its ranks logged (the link's other traffic, start-up broadcasts, falls outside the
    # windows). DP: what crossed the link (the rank byte counts of --squinch-hierarchical include its uncompressed
    # traffic inside an island, which never crosses).
    moved = row["counted_bytes"] if row["name"].startswith("diloco") else row["crossing_bytes"]
    per_direction = moved / 2  # each island sends its half over its own direction
    bytes_per_s = float(row["rate"]) * 1e6 / 8
    if row["name"].startswith("diloco"):
        inner_s = (row["wall_s"] - row["wait_s"]) / steps
        windows = steps / opts.inner_steps
        fragment_s = per_direction / max(windows * opts.fragments, 1) / bytes_per_s
        return windows * window_s(inner_s, opts.inner_steps, opts.fragments, opts.overlap, fragment_s)
    ref = [r for r in rows if r["name"] == row["name"] and r["seed"] == row["seed"] and r["rate"] == "unshaped"]
    if not ref:
        return None
    return ref[0]["wall_s"] + per_direction / bytes_per_s


# ------------------------------------------------------------------------------------------ part 3
def island_inner_s(model: Model) -> float:
    """An island's inner step (4M tokens on 64 H100, bf16 all-reduce inside at 3,200 Gbit/s per node)."""
    return step(model, ISLAND_GPUS, 3200, COLUMNS["bf16"]).step_s


def min_gbit(params: float, islands: int, bits: int, inner_s: float, h: int, k: int = 4) -> float:
    """The slowest link (Gbit/s per island) at which H = ``h``, K = ``k`` keeps utilisation >= 90%."""
    def ok(gbit: float) -> bool:
        full_s = allreduce_s(params, islands, bits, OuterLink(gbit * 1e9 / 8, WAN_ALPHA_S))
        return utilisation(inner_s, h, k, h // k - 1, full_s / k) >= 0.9

    lo, hi = 1e-4, 1e4
    for _ in range(60):  # bisection in log(rate): utilisation grows with the rate
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def projection(models=MODELS, islands=(2, 8), gbits=(100, 10)) -> list[dict]:
    out = []
    for m in models:
        inner_s = island_inner_s(m)
        codec_s = m.params / ISLAND_GPUS * 24 / HBM  # each rank's slice: encode + decode passes, memory-bound
        for n in islands:
            for gbit in gbits:
                wan = OuterLink(bytes_per_s=gbit * 1e9 / 8, alpha_s=WAN_ALPHA_S)
                row = {"model": m.name, "params": m.params, "islands": n, "gbit": gbit, "inner_s": inner_s}
                for bits in (32, 16, 6):
                    full_s = allreduce_s(m.params, n, bits, wan, codec_s if bits == 6 else 0.0)
                    row[f"{bits}"] = {
                        "model_allreduce_s": full_s, "island_bytes": wire_bytes(m.params, n, bits),
                        "min_h_k1": min_inner_steps(inner_s, 1, full_s),
                        "min_h_k4": min_inner_steps(inner_s, 4, full_s),
                        **{f"util_h{h}_k4": utilisation(inner_s, h, 4, h // 4 - 1, full_s / 4) for h in PROJECTION_H},
                        **{f"min_gbit_h{h}_k4": min_gbit(m.params, n, bits, inner_s, h) for h in PROJECTION_H},
                        "dp_util": inner_s / max(inner_s, full_s)}  # synchronous DP, overlapped at best
                out.append(row)
    return out


# ------------------------------------------------------------------------------------------ report
def _mean_sd(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.mean(xs):.4g} +- {statistics.stdev(xs):.2g}" if len(xs) > 1 else f"{xs[0]:.4g}"


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def acceptance(rows: list[dict]) -> list[str]:
    """Squinch-DiLoCo against synchronous bf16 DP per shaped link: loss at equal tokens (DP's 3-seed losses from its
    unshaped runs, which equal its shaped ones: checked where both ran), wall time and slow-link bytes per token;
    then 6-bit against bf16 pseudo-gradients."""
    out = ["## Acceptance", ""]
    same = [(r["val_loss"], u["val_loss"]) for r in rows if r["rate"] != "unshaped"
            for u in rows if u["rate"] == "unshaped" and u["name"] == r["name"] and u["seed"] == r["seed"]]
    if same:
        equal = sum(a == b for a, b in same)
        out.append(f"A configuration's validation loss over a shaped link equals its unshaped run's in {equal} of "
                   f"{len(same)} (configuration, seed) pairs (the link changes its time, not its arithmetic), so the "
                   "losses below are the unshaped runs' (every seed), and the time and bytes the shaped runs'.")

    def unshaped_losses(name: str) -> list[float]:
        return [r["val_loss"] for r in rows if r["name"] == name and r["rate"] == "unshaped"]

    dp_loss = unshaped_losses("dp bf16")
    out += loss_against_dp(rows)
    for rate in dict.fromkeys(r["rate"] for r in rows if r["rate"] != "unshaped"):
        def at(name: str) -> list[dict]:
            return [r for r in rows if r["name"] == name and r["rate"] == rate]  # noqa: B023
        six, dp = at("diloco 6"), at("dp bf16")
        if not six or not dp:
            continue
        dp_losses = dp_loss or [r["val_loss"] for r in dp]  # --quick has no unshaped runs
        six_losses = unshaped_losses("diloco 6") or [r["val_loss"] for r in six]
        loss_gap = _mean(six_losses) / _mean(dp_losses) - 1
        wall = _mean([r["wall_s"] for r in six]) / _mean([r["wall_s"] for r in dp])
        by = _mean([r["crossing_bytes"] / r["tokens"] for r in six]) / _mean([r["crossing_bytes"] / r["tokens"]
                                                                              for r in dp])
        payload = _mean([r["counted_bytes"] / r["tokens"] for r in six]) / _mean([r["crossing_bytes"] / r["tokens"]
                                                                                 for r in dp])
        targeted = rate == TARGET_RATE  # the targets are the 10 Mbit/s link's; other rates: the figures

        def verdict(text: str, ok: bool, targeted: bool = targeted) -> str:
            return f" (target {text}: {'holds' if ok else 'NOT'})" if targeted else ""

        seeds = f"{len(six_losses)} and {len(dp_losses)} seeds"
        out.append(f"- {rate} Mbit/s: Squinch-DiLoCo's validation loss is {loss_gap:+.2%} against bf16 DP's "
                   f"({seeds}){verdict('within 2%', abs(loss_gap) <= 0.02)}, "
                   f"its wall time {wall:.3f}x DP's{verdict('<= 0.2', wall <= 0.2)}, "
                   f"its slow-link bytes per token {by:.4f}x DP's{verdict('<= 0.01', by <= 0.01)}; the outer payload "
                   f"alone, without the run's other traffic over the link (start-up, exit votes, evaluation): "
                   f"{payload:.4f}x.")
        sixteen = at("diloco 16")
        if sixteen:
            paired = {n: {r["seed"]: r["val_loss"] for r in rows if r["name"] == n and r["rate"] == "unshaped"}
                      or {r["seed"]: r["val_loss"] for r in at(n)} for n in ("diloco 6", "diloco 16")}
            d = [v - paired["diloco 16"][s] for s, v in paired["diloco 6"].items() if s in paired["diloco 16"]]
            b6 = _mean([r["crossing_bytes"] / r["tokens"] for r in six])
            b16 = _mean([r["crossing_bytes"] / r["tokens"] for r in sixteen])
            p6, p16 = (_mean([r["counted_bytes"] / r["tokens"] for r in rs]) for rs in (six, sixteen))
            out.append(f"- {rate} Mbit/s, 6-bit minus bf16 pseudo-gradients: validation loss {_mean_sd(d)} (paired "
                       f"over {len(d)} seeds), slow-link bytes per token {b6:.4g} vs {b16:.4g} ({b6 / b16:.3f}x; "
                       f"the outer payload alone {p6:.4g} vs {p16:.4g}, {p6 / p16:.3f}x).")
    return out + [""]


def loss_against_dp(rows: list[dict]) -> list[str]:
    """Every configuration's validation loss against bf16 DP's at equal tokens, over the unshaped runs (every
    seed): the difference of the means, and the per-seed differences' mean and spread."""
    def by_seed(name: str) -> dict[int, float]:
        return {r["seed"]: r["val_loss"] for r in rows if r["name"] == name and r["rate"] == "unshaped"}

    dp = by_seed("dp bf16")
    if not dp:
        return []
    out = ["", "Validation loss against bf16 DP's at equal tokens (unshaped runs; the relative difference of the "
           "means, then the per-seed relative differences):"]
    for name in dict.fromkeys(r["name"] for r in rows if r["name"] != "dp bf16"):
        mine = by_seed(name)
        paired = [mine[s] / dp[s] - 1 for s in mine if s in dp]
        if not paired:
            continue
        gap = _mean(list(mine.values())) / _mean(list(dp.values())) - 1
        spread = f"{_mean(paired):+.2%} +- {statistics.stdev(paired):.2%}" if len(paired) > 1 else f"{paired[0]:+.2%}"
        note = (" (averaging after every step in fp32, no outer optimizer: the part of the gap that the islands' Adam "
                "steps on half the batch make)") if name == LOCAL_ADAM else ""
        out.append(f"- {name}: {gap:+.2%} (per seed {spread}, {len(paired)} seeds){note}")
    return out + [""]


def render(res: dict) -> str:
    lines = ["# DiLoCo across islands vs synchronous DP over a slow link", ""]
    rows = res.get("measured", [])
    if rows:
        o = res["options"]
        mu = o.get("outer_momentum", 0.9)
        momentum = f"Nesterov momentum {mu}" if mu else "no outer momentum"
        warm = o.get("warm_start_iters", 0)
        start = (f"every configuration of a seed starts from one checkpoint of {warm} synchronous fp32 DP iterations "
                 f"and trains the {o['iters'] - warm} after it (the figures are theirs)" if warm else "from scratch")
        lines += [f"2 islands x 2 ranks; {o['iters']} iterations, {start}; DiLoCo H = {o['inner_steps']}, "
                  f"K = {o['fragments']}, "
                  f"tau = {o['overlap']}, outer lr {o['outer_lr']}, {momentum}; {o.get('warmup_iters', 0)} warm-up "
                  f"iterations (every configuration); seeds {o['seeds']}; bytes measured "
                  f"on: {rows[0]['measured_on']}. Model error bound {ERROR_BOUND:.0%}.", "",
                  "| link | configuration | val loss (mean +- sd) | wall s | slow-link bytes / token | utilisation | "
                  "model wall s (error) |", "|---|---|---|---|---|---|---|"]
        for rate in dict.fromkeys(r["rate"] for r in rows):
            for name in dict.fromkeys(r["name"] for r in rows):
                group = [r for r in rows if r["rate"] == rate and r["name"] == name]
                if not group:  # not run over this link (--link-configs)
                    continue
                ref = [r for r in rows if r["rate"] == "unshaped" and r["name"] == name]
                util = [1 - r["wait_s"] / r["wall_s"] if name.startswith("diloco") else
                        (ref[0]["wall_s"] / r["wall_s"] if ref else None) for r in group]
                preds = [(p, r["wall_s"]) for r in group if (p := r.get("predicted_s")) is not None]
                err = f"{statistics.mean(p for p, _ in preds):.1f} ({max(abs(p / w - 1) for p, w in preds):.0%})" \
                    if preds else "-"
                lines.append(f"| {rate} | {name} | {_mean_sd([r['val_loss'] for r in group])} | "
                             f"{_mean_sd([r['wall_s'] for r in group])} | "
                             f"{_mean_sd([r['crossing_bytes'] / r['tokens'] for r in group])} | "
                             f"{_mean_sd(util)} | {err} |")
        loads = [r["load_average"][0] for r in rows if "load_average" in r]
        if loads:
            lines += ["", f"The machine's 1-minute load average as each row finished: {min(loads):.1f} to "
                      f"{max(loads):.1f} (median {statistics.median(loads):.1f}) on "
                      f"{res.get('machine', {}).get('start', {}).get('cpus', '?')} CPUs. Compute-bound rows (DiLoCo, "
                      "unshaped DP) are slowed by it; link-bound DP rows much less."]
        errors = [abs(r["predicted_s"] / r["wall_s"] - 1) for r in rows if r.get("predicted_s")]
        if errors:
            lines += ["", f"Model error over {len(errors)} measured rows: median {statistics.median(errors):.1%}, "
                      f"max {max(errors):.1%}: {'within' if max(errors) <= ERROR_BOUND else 'NOT within'} the stated "
                      f"{ERROR_BOUND:.0%}."]
        lines.append("")
        lines += acceptance(rows)
    lines += ["## Projection: islands of 64 H100 (arithmetic, core/diloco/outer_model.py)", "",
              f"Inner step: squinch_cluster_projection's model (4M tokens per island, 40% MFU). WAN latency "
              f"{WAN_ALPHA_S * 1000:g} ms per message. H90: least H with compute utilisation >= 90% (K fragments, "
              f"overlap up to the next send). DP: synchronous data parallelism across the link, fully overlapped.",
              "Slowest link: the least Gbit/s per island at which H (K = 4) keeps >= 90%.",
              "", "| model | islands | Gbit/s | inner s | bits | model all-reduce s | H90 K=1 | H90 K=4 | "
              + " | ".join(f"util H={h} K=4" for h in PROJECTION_H) + " | "
              + " | ".join(f"slowest link H={h}" for h in PROJECTION_H) + " | DP util |",
              "|---|---|---|---|---|---|---|---|" + "---|" * 2 * len(PROJECTION_H) + "---|"]
    for r in res["projection"]:
        for bits in ("32", "16", "6"):
            c = r[bits]
            lines.append(f"| {r['model']} | {r['islands']} | {r['gbit']} | {r['inner_s']:.2f} | {bits} | "
                         f"{c['model_allreduce_s']:.2f} | {c['min_h_k1']} | {c['min_h_k4']} | "
                         + " | ".join(f"{c[f'util_h{h}_k4']:.1%}" for h in PROJECTION_H) + " | "
                         + " | ".join(f"{c[f'min_gbit_h{h}_k4']:.3g}" for h in PROJECTION_H)
                         + f" | {c['dp_util']:.1%} |")
    six = [r for r in res["projection"] if (r["6"]["min_h_k4"] or 10**9) <= 20]
    fail = [r for r in res["projection"] if r not in six]
    lines += ["", "Squinch-DiLoCo (6 bits, K = 4) keeps utilisation >= 90% at some H <= 20 for "
              f"{len(six)} of {len(res['projection'])} (model, islands, link) rows"
              + (": not for " + ", ".join(f"{r['model']} x {r['islands']} at {r['gbit']} Gbit/s" for r in fail)
                 if fail else "") + ". Below the 'slowest link' column it does not at that H."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in res.get("measured", []) if r["seed"] == res["options"]["seeds"][0]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in rows:
        if r["rate"] == "unshaped" and len({x["rate"] for x in rows}) > 1:
            continue
        label = f"{r['name']} @ {r['rate']}"
        tokens = [r["tokens"] * (i + 1) / len(r["losses"]) for i in range(len(r["losses"]))]
        wall = [sum(r["times_s"][:i + 1]) for i in range(len(r["times_s"]))]
        axes[0].plot(tokens, r["losses"], lw=0.8, label=label)
        axes[1].plot(wall, r["losses"], lw=0.8, label=label)
    axes[0].set(xlabel="tokens", ylabel="training loss (last island)", title="loss vs tokens")
    axes[0].ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    axes[1].set(xlabel="wall s", xscale="log", title="loss vs wall time")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "diloco")
    H.add(p, iters=600, lr=2e-3, seeds=[1, 2, 3], eval_iters=8)
    p.add_argument("--rates", type=float, nargs="+", default=[10, 30, 100], help="slow-link rates, Mbit/s")
    p.add_argument("--configs", nargs="*", default=None, help="a subset of the configurations")
    p.add_argument("--link-configs", nargs="*", default=None,
                   help="the configurations run over the shaped links too, NAME or NAME@R1,R2 (at those "
                        "Mbit/s only; default: all of --configs at every rate; the others run unshaped only)")
    p.add_argument("--inner-steps", type=int, default=30)
    p.add_argument("--fragments", type=int, default=5)
    p.add_argument("--overlap", type=int, default=4)
    p.add_argument("--outer-lr", type=float, default=1.4,
                   help="the outer SGD's learning rate (above 1 makes up for the averaged islands' shorter steps)")
    p.add_argument("--outer-momentum", type=float, default=0.0, help="Nesterov momentum of the outer SGD (0: none)")
    p.add_argument("--warmup-iters", type=int, default=None,
                   help="linear learning-rate warm-up of every configuration (default: a tenth of --iters)")
    p.add_argument("--dp-link-seeds", type=int, default=None,
                   help="synchronous DP over a shaped link at the first N seeds only (its losses equal the unshaped "
                        "run's, which the report checks; over a 10 Mbit/s link one DP run takes tens of minutes)")
    p.add_argument("--link-seeds", type=int, default=None,
                   help="every configuration over a shaped link at the first N seeds only (the losses are the "
                        "unshaped runs'; the report checks that they equal the shaped ones where both ran)")
    p.add_argument("--warm-start-iters", type=int, default=300,
                   help="every configuration starts from one checkpoint per seed: this many iterations of synchronous "
                        "fp32 DP on the run's schedule (as DiLoCo's paper starts from a pretrained model); the "
                        "figures count the iterations after it (0: from scratch)")
    p.add_argument("--no-netns", action="store_true", help="every rank on the loopback, unshaped")
    p.add_argument("--projection-only", action="store_true", help="part 3 only (no runs)")
    opts = H.parse(p, argv, quick=dict(iters=4, seeds=[1], eval_iters=1, rates=[100], inner_steps=2, fragments=2,
                                       overlap=1, configs=["dp bf16", "diloco 6"], warm_start_iters=2))
    if opts.warmup_iters is None:
        opts.warmup_iters = opts.iters // 10
    link.use_namespaces(not opts.no_netns)
    results = H.Results(opts.out, settings={k: v for k, v in vars(opts).items() if k not in ROW_INDEPENDENT})
    if opts.from_json:
        results.rewrite(render, plot)
        return
    measured = [] if opts.projection_only else measure(opts, results)
    for r in measured:
        r["predicted_s"] = predict(r, measured, opts)
    kept = ("iters", "inner_steps", "fragments", "overlap", "outer_lr", "outer_momentum", "warmup_iters",
            "warm_start_iters", "seeds", "rates", "quick", "dp_link_seeds", "link_seeds", "link_configs")
    payload = {"options": {k: getattr(opts, k) for k in kept},
               "measured": measured, "projection": projection(MODELS[:1] if opts.quick else MODELS)}
    results.write(payload, render, plot if measured else None)


if __name__ == "__main__":
    main()

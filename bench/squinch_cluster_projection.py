"""Projection: step time against inter-node bandwidth on H100-class clusters, from the step-time model
(core/distributed/comm_model.py) validated against real runs in ``squinch_scale.py``.

GPT 1.3B / 7B / 70B with Megatron-typical TP x PP (Megatron's rank order: TP fastest, then DP, so a
node of 8 GPUs holds 8 / TP ranks of each data-parallel group) on 64, 512 and 4,096 GPUs; a global
batch of about 4M tokens; compute per step from Megatron's FLOP count at 40% MFU of 989 TFLOP/s (bf16
dense); NVLink 900 GB/s per GPU (450 GB/s each way); the node's NICs from 100 to 3,200 Gbit/s, shared by
the node's data-parallel groups. The Squinch codec is costed memory-bound at 0.7 x 3.35 TB/s (HBM3)
with 5 us per kernel launch: PROJECTED until a GPU measurement replaces it. Columns: fp32 all-reduce
(Megatron's default for bf16 training), bf16 all-reduce (--grad-reduce-in-bf16), Squinch flat and
Squinch hierarchical, each with --overlap-grad-reduce and the default bucket size (Megatron's
max(40M, 1M x DP); hierarchical Squinch max(40M, 1M x nodes), DDPConfig.bucket_elements). A third table
compares bucket sizes for hierarchical Squinch.

The seed claim (Squinch on a quarter of the bandwidth trains as fast): Squinch at 800 Gbit/s against
bf16 and fp32 at 3,200 Gbit/s, with and without overlap, and the compute per step under which it holds.
A second table shows what the codec's per-DP-rank kernel launches (today's reducer) cost against one
launch per bucket (the reducer of branch ``gpu``).

    python bench/squinch_cluster_projection.py          # seconds; writes bench/results/squinch_cluster_projection.*
    python bench/squinch_cluster_projection.py --quick  # fewer points; writes bench/.cache/quick/
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import harness as H

from megatron_cai.core.distributed.comm_model import (
    STAGE_POLICIES,
    BackwardTimeline,
    CodecCost,
    OpCost,
    ReducerMode,
    Tier,
    Topology,
    launches_per_bucket,
    predict,
)
from megatron_cai.core.distributed.config import DDPConfig, SquinchConfig
from megatron_cai.training.logging import gpt_flops_per_iteration

PEAK_FLOPS = 989e12      # H100 SXM bf16 dense
MFU = 0.40
HBM = 0.7 * 3.35e12      # projected codec and optimizer bandwidth, bytes/s
LAUNCH_S = 5e-6          # per kernel launch
NVLINK = 450e9           # bytes/s per GPU each way (900 GB/s both ways)
GPUS_PER_NODE = 8
INTRA = Tier(OpCost(alpha_s=2e-6, bytes_per_s=NVLINK))
INTER_ALPHA, PER_PEER = 6e-6, 1e-6  # per ring step across nodes; an all-to-all's extra per peer
ADAM_BYTES = 36          # per parameter and step: fp32 param, grad, two moments read and written, bf16 copy
GLOBAL_TOKENS = 4 * 2**20
BANDWIDTHS = (100, 200, 400, 800, 1600, 3200)  # Gbit/s per node
CLUSTERS = (64, 512, 4096)
COLUMNS = {"fp32": ReducerMode("fp32"), "bf16": ReducerMode("bf16"), "squinch flat": ReducerMode("squinch"),
           "squinch hierarchical": ReducerMode("squinch", hierarchical=True)}


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    tp: int
    pp: int
    micro_batch: int
    vocab: int = 51200

    @property
    def params(self) -> int:
        return 12 * self.layers * self.hidden**2 + 13 * self.layers * self.hidden + self.vocab * self.hidden

    def flops(self, sequences: int) -> float:
        """Megatron's FLOP count (training/logging.gpt_flops_per_iteration) of ``sequences`` sequences."""
        cfg = SimpleNamespace(hidden_size=self.hidden, seq_length=self.seq, num_layers=self.layers,
                              kv_channels=self.hidden // self.heads, num_attention_heads=self.heads,
                              num_query_groups=self.heads, ffn_hidden_size=4 * self.hidden, activation="gelu",
                              padded_vocab_size=self.vocab)
        return gpt_flops_per_iteration(cfg, sequences)


MODELS = (Model("GPT 1.3B", 24, 2048, 16, 2048, tp=1, pp=1, micro_batch=4),
          Model("GPT 7B", 32, 4096, 32, 4096, tp=2, pp=1, micro_batch=2),
          Model("GPT 70B", 80, 8192, 64, 4096, tp=4, pp=4, micro_batch=1))


def setup(model: Model, gpus: int) -> dict | None:
    """The parallel layout and compute of ``model`` on ``gpus`` GPUs; None when the global batch has fewer
    sequences than data-parallel ranks x micro-batch."""
    dp = gpus // (model.tp * model.pp)
    seqs = GLOBAL_TOKENS // model.seq
    if seqs < dp * model.micro_batch:
        return None
    microbatches = seqs // (dp * model.micro_batch)
    per_node = GPUS_PER_NODE // model.tp if model.tp <= GPUS_PER_NODE else 1  # DP ranks of one group per node
    compute = model.flops(seqs) / gpus / (MFU * PEAK_FLOPS)
    elems = model.params // (model.tp * model.pp)
    per_node = min(per_node, dp)
    return {"dp": dp, "per_node": per_node, "microbatches": microbatches, "compute_s": compute,
            "grad_elems": elems, "tokens_per_gpu": GLOBAL_TOKENS / gpus, "bucket": DDPConfig().bucket_elements(dp),
            "bucket_hierarchical": HIER.bucket_elements(dp, nodes=dp // per_node),
            "optimizer_s": elems * ADAM_BYTES / HBM}


HIER = DDPConfig(reducer="squinch", squinch=SquinchConfig(hierarchical=True))  # the reducer's own bucket rule


def topology(s: dict, gbit: float) -> Topology:
    groups_per_node = GPUS_PER_NODE // s["per_node"]  # the node's NICs serve that many DP groups at once
    inter = Tier(OpCost(INTER_ALPHA, gbit * 1e9 / 8 / groups_per_node, per_peer_s=PER_PEER))
    return Topology(dp=s["dp"], ranks_per_node=s["per_node"], intra=INTRA, inter=inter, tree_latency=True)


def timeline(s: dict, mode: ReducerMode | None = None) -> BackwardTimeline:
    """Buckets as the DDP wrapper cuts them for ``mode`` (hierarchical Squinch: its own rule)."""
    k, c = s["microbatches"], s["compute_s"]
    bucket = s["bucket_hierarchical"] if mode is not None and mode.hierarchical else s["bucket"]
    return BackwardTimeline.uniform(s["grad_elems"], bucket, c / (3 * k), 2 * c / (3 * k), s["optimizer_s"],
                                    microbatches=k)


def codec(per_rank_launches: bool) -> CodecCost:
    return CodecCost.memory_bound(HBM, LAUNCH_S, per_rank_launches=per_rank_launches)


def step(model: Model, gpus: int, gbit: float, mode: ReducerMode, per_rank_launches: bool = True):
    s = setup(model, gpus)
    return None if s is None else predict(timeline(s, mode), topology(s, gbit), codec(per_rank_launches), mode)


def project(bandwidths, clusters) -> dict:
    cells = []
    for m in MODELS:
        for gpus in clusters:
            s = setup(m, gpus)
            for gbit in bandwidths:
                row = {"model": m.name, "gpus": gpus, "gbit": gbit, "setup": s, "step_s": {}, "exposed_s": {}}
                for name, mode in COLUMNS.items():
                    p = step(m, gpus, gbit, mode)
                    row["step_s"][name] = p.step_s if p else None
                    row["exposed_s"][name] = p.exposed_s if p else None
                cells.append(row)
    return {"cells": cells, "seed": seed_claim(clusters), "launches": launch_table(), "buckets": bucket_table(clusters),
            "stages": stage_table(clusters)}


def seed_claim(clusters) -> list[dict]:
    """Squinch (hierarchical, and flat) at 800 Gbit/s against fp32 and bf16 at 3,200, overlap on and off."""
    out = []
    for m in MODELS:
        for gpus in clusters:
            s = setup(m, gpus)
            if s is None:
                continue
            row = {"model": m.name, "gpus": gpus, "tokens_per_gpu": s["tokens_per_gpu"], "compute_s": s["compute_s"]}
            for ov in (True, False):
                sq = step(m, gpus, 800, ReducerMode("squinch", hierarchical=True, overlap=ov)).step_s
                for base in ("fp32", "bf16"):
                    row[f"{base} overlap={ov}"] = sq / step(m, gpus, 3200, ReducerMode(base, overlap=ov)).step_s
            out.append(row)
    return out


def launch_table() -> list[dict]:
    """Per step at 512 GPUs: codec launches and their cost, per DP rank (today) vs per bucket."""
    out = []
    for m in MODELS:
        s = setup(m, 512)
        if s is None:
            continue
        topo = topology(s, 800)
        for name in ("squinch flat", "squinch hierarchical"):
            mode = COLUMNS[name]
            buckets = timeline(s, mode).bucket_elems
            n = {r: sum(launches_per_bucket(b, topo, codec(r), mode) for b in buckets) for r in (True, False)}
            steps = {r: step(m, 512, 800, mode, per_rank_launches=r).step_s for r in (True, False)}
            out.append({"model": m.name, "reducer": name, "dp": s["dp"], "buckets": len(buckets),
                        "launches_per_rank": n[True], "launches_per_bucket": n[False],
                        "launch_s_per_rank": n[True] * LAUNCH_S, "launch_s_per_bucket": n[False] * LAUNCH_S,
                        "step_s_per_rank": steps[True], "step_s_per_bucket": steps[False]})
    return out


def stage_table(clusters) -> list[dict]:
    """Hierarchical Squinch at 800 Gbit/s under the three rules for starting a bucket's later stages
    (comm_model.STAGE_POLICIES), against bf16 at 3,200 Gbit/s."""
    out = []
    for m in MODELS:
        for gpus in clusters:
            if setup(m, gpus) is None:
                continue
            bf16 = step(m, gpus, 3200, COLUMNS["bf16"]).step_s
            row = {"model": m.name, "gpus": gpus, "bf16_3200_s": bf16}
            for rule in STAGE_POLICIES:
                row[rule] = step(m, gpus, 800, ReducerMode("squinch", hierarchical=True, stages=rule)).step_s
            out.append(row)
    return out


def bucket_table(clusters, candidates=(10, 20, 40, 64, 128, 256, 512)) -> list[dict]:
    """Hierarchical Squinch at 800 Gbit/s: the step with Megatron's bucket rule, with the reducer's
    (1M x nodes), and with the best of ``candidates`` (millions of elements)."""
    out, mode = [], COLUMNS["squinch hierarchical"]
    for m in MODELS:
        for gpus in clusters:
            s = setup(m, gpus)
            if s is None:
                continue

            def at(bucket: int, s: dict = s) -> float:
                return predict(timeline(dict(s, bucket_hierarchical=bucket), mode), topology(s, 800), codec(True),
                               mode).step_s
            tried = {b: at(b * 1_000_000) for b in candidates}
            best = min(tried, key=tried.get)
            out.append({"model": m.name, "gpus": gpus, "nodes": s["dp"] // s["per_node"],
                        "megatron_bucket": s["bucket"], "megatron_s": at(s["bucket"]),
                        "rule_bucket": s["bucket_hierarchical"], "rule_s": at(s["bucket_hierarchical"]),
                        "best_bucket": best * 1_000_000, "best_s": tried[best]})
    return out


# ------------------------------------------------------------------------------------------ report
def report(res: dict) -> list[str]:
    L = ["# Squinch at cluster scale: projected step time against inter-node bandwidth", "",
         "**Projected** by the step-time model (`megatron_cai/core/distributed/comm_model.py`; its error against "
         "real runs: `bench/results/squinch_scale.md`). Codec: memory-bound at 0.7 x 3.35 TB/s, 5 us per launch "
         "(not measured on a GPU). Compute: Megatron's FLOPs at 40% MFU of 989 TFLOP/s. NVLink 450 GB/s each way; "
         f"inter-node alpha {INTER_ALPHA * 1e6:.0f} us per step (ring, or tree when cheaper), all-to-all "
         f"{PER_PEER * 1e6:.0f} us per peer; global batch {GLOBAL_TOKENS} tokens; plain data-parallel all-reduce "
         "with --overlap-grad-reduce, Megatron's bucket size; today's reducer (codec launches per DP rank, "
         "later stages started by progress()).", "",
         "## Step time (s), each reducer with overlap", ""]
    cols = list(COLUMNS)
    for m in MODELS:
        for gpus in sorted({c["gpus"] for c in res["cells"]}):
            cells = [c for c in res["cells"] if c["model"] == m.name and c["gpus"] == gpus]
            s = cells[0]["setup"]
            if s is None:
                L += [f"### {m.name}, {gpus} GPUs: not run (the global batch has fewer sequences than DP ranks)", ""]
                continue
            L += [f"### {m.name} ({m.params / 1e9:.2f}B), {gpus} GPUs: TP {m.tp} x PP {m.pp} x DP {s['dp']} "
                  f"({s['per_node']} per node), {s['microbatches']} micro-batches, "
                  f"{s['tokens_per_gpu']:.0f} tokens/GPU, compute {s['compute_s']:.3f} s", "",
                  "| Gbit/s per node | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
            for c in cells:
                L.append(f"| {c['gbit']} | " + " | ".join(f"{c['step_s'][k]:.3f}" for k in cols) + " |")
            L.append("")
    L += ["## The seed claim: Squinch (hierarchical) at 800 Gbit/s against fp32 / bf16 at 3,200 Gbit/s", "",
          "Ratio of step times; <= 1.00: the quarter bandwidth trains as fast.", "",
          "| model | GPUs | tokens/GPU | compute (s) | vs fp32, overlap | vs bf16, overlap | vs fp32, no overlap "
          "| vs bf16, no overlap |", "|---|---|---|---|---|---|---|---|"]
    for r in res["seed"]:
        L.append(f"| {r['model']} | {r['gpus']} | {r['tokens_per_gpu']:.0f} | {r['compute_s']:.3f} | "
                 + " | ".join(f"{r[k]:.2f}" for k in ("fp32 overlap=True", "bf16 overlap=True", "fp32 overlap=False",
                                                      "bf16 overlap=False")) + " |")
    L += ["", "## Bucket size of hierarchical Squinch at 800 Gbit/s (step, s)", "",
          "Megatron's max(40M, 1M x DP) against the reducer's max(40M, 1M x nodes) and the best of 10M-512M.", "",
          "| model | GPUs | nodes | Megatron's rule | the reducer's rule | best |", "|---|---|---|---|---|---|"]
    for r in res["buckets"]:
        cells = [f"{r[k + '_bucket'] / 1e6:.0f}M: {r[k + '_s']:.3f}" for k in ("megatron", "rule", "best")]
        L.append(f"| {r['model']} | {r['gpus']} | {r['nodes']} | " + " | ".join(cells) + " |")
    L += ["", "## When a bucket's later stages start: hierarchical Squinch at 800 Gbit/s (step, s)", "",
          "progress: the reducer's host-side progress() at each hand-over (the other columns assume it); wait: "
          "every later stage in wait() (a host that runs ahead of the device); chained: on the device, as soon "
          "as the collective completes. In brackets: against bf16 at 3,200 Gbit/s.", "",
          "| model | GPUs | bf16 at 3,200 | progress | wait | chained |", "|---|---|---|---|---|---|"]
    for r in res["stages"]:
        L.append(f"| {r['model']} | {r['gpus']} | {r['bf16_3200_s']:.3f} | " + " | ".join(
            f"{r[k]:.3f} ({r[k] / r['bf16_3200_s']:.2f})" for k in STAGE_POLICIES) + " |")
    L += ["", "## Codec launches per step at 512 GPUs, 800 Gbit/s: per DP rank (today) vs per bucket", "",
          "| model | reducer | DP | buckets | launches (per rank / per bucket) | launch time (ms) | step (s) |",
          "|---|---|---|---|---|---|---|"]
    for r in res["launches"]:
        L.append(f"| {r['model']} | {r['reducer']} | {r['dp']} | {r['buckets']} | {r['launches_per_rank']} / "
                 f"{r['launches_per_bucket']} | {1e3 * r['launch_s_per_rank']:.1f} / "
                 f"{1e3 * r['launch_s_per_bucket']:.2f} | {r['step_s_per_rank']:.3f} / {r['step_s_per_bucket']:.3f} |")
    return L


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = sorted({c["gpus"] for c in res["cells"]})
    fig, axes = plt.subplots(len(MODELS), len(clusters), figsize=(4 * len(clusters), 3.2 * len(MODELS)), squeeze=False)
    for i, m in enumerate(MODELS):
        for j, gpus in enumerate(clusters):
            ax = axes[i][j]
            cells = [c for c in res["cells"] if c["model"] == m.name and c["gpus"] == gpus]
            if cells[0]["setup"] is None:
                ax.set_axis_off()
                ax.set_title(f"{m.name}, {gpus} GPUs: n/a", fontsize=9)
                continue
            for name in COLUMNS:
                ax.plot([c["gbit"] for c in cells], [c["step_s"][name] for c in cells], marker="o", ms=3, label=name)
            ax.axhline(cells[0]["setup"]["compute_s"] + cells[0]["setup"]["optimizer_s"], color="grey", lw=0.8,
                       ls=":", label="compute")
            ax.set(xscale="log", yscale="log", title=f"{m.name}, {gpus} GPUs (projected)")
            ax.set_xlabel("inter-node Gbit/s per node", fontsize=8)
            ax.set_ylabel("step (s)", fontsize=8)
            ax.title.set_fontsize(9)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(res: dict) -> str:
    return "\n".join(report(res)) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "squinch_cluster_projection")
    opts = H.parse(p, argv)
    out = H.Results(opts.out)
    if opts.from_json:
        out.rewrite(render, plot)
        return
    bws, clusters = ((800, 3200), (64, 512)) if opts.quick else (BANDWIDTHS, CLUSTERS)
    out.write(project(bws, clusters), render, plot, record_machine=False)


if __name__ == "__main__":
    main()

"""Step time where bandwidth is scarce: fp32 / bf16 / Squinch gradient reduction, with and without overlap.

Part 1, projection from measurements. On this machine, for one data-parallel rank of a small GPT: the
forward and backward time per token, the optimizer step and the Squinch codec time for the rank's
buckets, and the exact bytes each rank sends per step at DP = 8 (one rank per node). A step processes
--tokens-per-node tokens per node (65,536 by default, the gradient-compression note's example).
Cluster bandwidths B of 100, 400, 800 and 3,200 Gb/s per node are mapped to this machine by keeping the
ratio of communication to compute: B_here = B * F_here / F_node, with F_here the FLOP/s measured here
and F_node an 8-GPU node at 8 x 400 TFLOP/s (H100-class, ~40% of bf16 peak). Step time without overlap
= fwd + bwd + codec + comm + opt; with overlap (buckets reduced during backward) = fwd + max(bwd,
codec + comm) + opt. Reported relative to the compute-only step, which is what carries over to the
cluster. The codec's share is the CPU's (its C kernel vs CPU matmuls), not a GPU's.

Part 2, measured for real. Two network namespaces joined by a veth pair shaped with ``tc tbf`` to a
few rates; pretrain_gpt.py with DP = 2 (one rank per namespace, gloo over the shaped link) and bf16
all-reduce vs Squinch all-reduce, with and without --overlap-grad-reduce; the mean step time from the
log lines, side by side, against the byte ratio 6/16. Needs root and iproute2 (``ip netns``, ``tc``).

    python bench/squinch_bandwidth.py                  # both parts; writes results/squinch_bandwidth.*
    python bench/squinch_bandwidth.py --skip-link      # part 1 only
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--vocab-size", "2000", "--mock-data", "--micro-batch-size", "4", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--eval-interval", "0", "--eval-iters", "0", "--lr", "1e-3"]
NODE_FLOPS = 8 * 400e12
CLUSTER_GBPS = [100, 400, 800, 3200]
DP_PROJECTED = 8


def _measure_compute(steps: int = 6) -> dict:
    """fwd / bwd / opt times of one rank (single process), codec times and FLOPs per step."""
    import pretrain_gpt
    from megatron_cai.core.squinch import decode, decode_accumulate, encode_with_feedback
    from megatron_cai.training.training import Trainer

    config, tokenizer = pretrain_gpt.build_run(
        MODEL + ["--global-batch-size", "4", "--train-iters", "100", "--log-interval", "1000"], world_size=1)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    model = config.model
    ddp = trainer.model[0]
    batch = trainer._next_microbatches(trainer.train_iter)[0]
    t = {"fwd": [], "bwd": [], "opt": []}
    for i in range(steps + 2):
        ddp.zero_grad_buffer()
        t0 = time.perf_counter()
        loss = ddp(batch["tokens"], batch["position_ids"], labels=batch["labels"]).mean()
        t1 = time.perf_counter()
        loss.backward()
        ddp.finish_grad_sync()
        t2 = time.perf_counter()
        trainer.optimizer.clip_and_check(1.0)
        trainer.optimizer.step(1e-3)
        t3 = time.perf_counter()
        if i >= 2:
            t["fwd"].append(t1 - t0)
            t["bwd"].append(t2 - t1)
            t["opt"].append(t3 - t2)
    med = {k: sorted(v)[len(v) // 2] for k, v in t.items()}
    n_params = sum(p.numel() for p in ddp.module.parameters())
    tokens = config.training.micro_batch_size * model.seq_length
    flops = 6 * n_params * tokens + 12 * model.num_layers * model.hidden_size * model.seq_length * tokens
    # Squinch codec on this rank's buckets at DP = 8: encode with feedback + decode-accumulate of 8
    # chunks-worth (one shard), re-encode the shard, decode all 8 shards.
    g = ddp.buffer.grad_data.clone().normal_()
    res = torch.zeros_like(g)
    n = g.numel() - g.numel() % (8 * DP_PROJECTED)
    g, res = g[:n], res[:n]
    shard = n // DP_PROJECTED
    out = torch.zeros(shard)
    times = []
    for _ in range(5):
        c0 = time.perf_counter()
        payload, _ = encode_with_feedback(g, res)
        decode_accumulate(payload.view(DP_PROJECTED, -1), out)
        p2, _ = encode_with_feedback(out, torch.zeros_like(out))
        full = torch.empty(n)
        for r in range(DP_PROJECTED):
            decode(p2, shard, out=full[r * shard:(r + 1) * shard])
        times.append(time.perf_counter() - c0)
    med["codec_allreduce"] = sorted(times)[2]
    return {**med, "params": n_params, "grad_elements": ddp.buffer.numel, "flops": flops, "tokens": tokens}


def projection(m: dict, tokens_per_node: int) -> list[dict]:
    scale = tokens_per_node / m["tokens"]
    fwd, bwd = m["fwd"] * scale, m["bwd"] * scale
    compute = fwd + bwd + m["opt"]
    f_here = m["flops"] / (m["fwd"] + m["bwd"])
    n, elems = DP_PROJECTED, m["grad_elements"]
    wire = {"fp32": 2 * (n - 1) / n * elems * 4, "bf16": 2 * (n - 1) / n * elems * 2,
            "squinch": 2 * (n - 1) / n * (elems * 6 / 8 + 1)}
    rows = []
    for gbps in CLUSTER_GBPS:
        bytes_per_s = gbps * 1e9 / 8 * f_here / NODE_FLOPS
        row = {"cluster_gbps": gbps, "equivalent_here_mbps": bytes_per_s * 8 / 1e6}
        for kind, nbytes in wire.items():
            comm = nbytes / bytes_per_s
            codec = m["codec_allreduce"] if kind == "squinch" else 0.0
            row[f"{kind}_no_overlap"] = (fwd + bwd + codec + comm + m["opt"]) / compute
            row[f"{kind}_overlap"] = (fwd + max(bwd, codec + comm) + m["opt"]) / compute
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------ real link
def _sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True, capture_output=True)


def setup_link(rate_mbit: float) -> None:
    teardown_link()
    for c in ("ip netns add mcaiA", "ip netns add mcaiB", "ip link add mcaiA0 type veth peer name mcaiB0",
              "ip link set mcaiA0 netns mcaiA", "ip link set mcaiB0 netns mcaiB",
              "ip -n mcaiA addr add 10.211.0.1/24 dev mcaiA0", "ip -n mcaiB addr add 10.211.0.2/24 dev mcaiB0",
              "ip -n mcaiA link set mcaiA0 up", "ip -n mcaiB link set mcaiB0 up",
              "ip -n mcaiA link set lo up", "ip -n mcaiB link set lo up"):
        _sh(c)
    for ns, dev in (("mcaiA", "mcaiA0"), ("mcaiB", "mcaiB0")):
        _sh(f"ip netns exec {ns} tc qdisc add dev {dev} root tbf rate {rate_mbit}mbit burst 64kb latency 2000ms")


def teardown_link() -> None:
    for ns in ("mcaiA", "mcaiB"):
        subprocess.run(f"ip netns del {ns}", shell=True, capture_output=True)


def run_over_link(flags: list[str], iters: int, port: int) -> float:
    """Mean step time (s) of a DP = 2 run whose two ranks talk over the shaped veth link."""
    procs = []
    for rank, (ns, dev) in enumerate((("mcaiA", "mcaiA0"), ("mcaiB", "mcaiB0"))):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "LOCAL", "MASTER"))}
        env.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "10.211.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": dev,
                    "OMP_NUM_THREADS": "1"})
        cmd = ["ip", "netns", "exec", ns, sys.executable, "pretrain_gpt.py", *MODEL, *flags,
               "--global-batch-size", "8", "--train-iters", str(iters), "--log-interval", "1"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("run over the shaped link failed:\n" + outs[1][-3000:])
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", outs[1])]
    steady = ms[2:] or ms
    return sum(steady) / len(steady) / 1000.0


def measure_link(rates: list[float], iters: int) -> list[dict]:
    rows = []
    port = 29711
    try:
        for rate in rates:
            setup_link(rate)
            row = {"rate_mbit": rate}
            for label, flags in (("bf16", ["--grad-reduce-in-bf16"]), ("squinch", ["--squinch"])):
                for ov in (False, True):
                    port += 1
                    extra = ["--overlap-grad-reduce", "--ddp-bucket-size", "100000"] if ov else []
                    row[f"{label}{'_overlap' if ov else ''}_s"] = run_over_link(flags + extra, iters, port)
            row["ratio"] = row["squinch_s"] / row["bf16_s"]
            row["ratio_overlap"] = row["squinch_overlap_s"] / row["bf16_overlap_s"]
            rows.append(row)
            print(f"  {rate} Mbit/s: bf16 {row['bf16_s']:.3f} s, squinch {row['squinch_s']:.3f} s "
                  f"(ratio {row['ratio']:.3f}); overlapped: {row['bf16_overlap_s']:.3f} / "
                  f"{row['squinch_overlap_s']:.3f} s (ratio {row['ratio_overlap']:.3f})", flush=True)
    finally:
        teardown_link()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="*", default=[4, 16, 64, 1000])
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--skip-link", action="store_true")
    p.add_argument("--tokens-per-node", type=int, default=65536)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "squinch_bandwidth"))
    opts = p.parse_args()
    torch.set_num_threads(1)
    m = _measure_compute()
    proj = projection(m, opts.tokens_per_node)
    link = [] if opts.skip_link else measure_link(opts.rates, opts.iters)
    f_here = m["flops"] / (m["fwd"] + m["bwd"])
    lines = ["# Squinch where bandwidth is scarce", "",
             "## 1. Projected step time (relative to compute only), DP = 8 nodes", "",
             f"Measured here (1 thread): forward {m['fwd'] * 1e3:.1f} ms, backward {m['bwd'] * 1e3:.1f} ms, optimizer "
             f"{m['opt'] * 1e3:.1f} ms, Squinch codec for a compressed all-reduce of the rank's "
             f"{m['grad_elements']:,} gradient elements {m['codec_allreduce'] * 1e3:.1f} ms; "
             f"{f_here / 1e9:.1f} GFLOP/s. {opts.tokens_per_node:,} tokens per node per step. Cluster bandwidth "
             "is mapped to this machine by B_here = B x F_here / (8 x 400 TFLOP/s).", "",
             "| Gb/s per node | fp32 | bf16 | Squinch | fp32 overlap | bf16 overlap | Squinch overlap | "
             "Squinch / bf16 | Squinch / bf16 overlap |", "|---|---|---|---|---|---|---|---|---|"]
    for r in proj:
        lines.append(f"| {r['cluster_gbps']} | {r['fp32_no_overlap']:.2f} | {r['bf16_no_overlap']:.2f} | "
                     f"{r['squinch_no_overlap']:.2f} | {r['fp32_overlap']:.2f} | {r['bf16_overlap']:.2f} | "
                     f"{r['squinch_overlap']:.2f} | {r['squinch_no_overlap'] / r['bf16_no_overlap']:.3f} | "
                     f"{r['squinch_overlap'] / r['bf16_overlap']:.3f} |")
    if link:
        lines += ["", "## 2. Measured: DP = 2 over a tc-shaped veth link (two network namespaces)", "",
                  "Mean step time of pretrain_gpt.py (steady state), bf16 all-reduce vs Squinch all-reduce; "
                  "byte ratio 6/16 = 0.375.", "",
                  "| link Mbit/s | bf16 s/step | Squinch s/step | ratio | bf16 overlap | Squinch overlap | "
                  "ratio overlap |", "|---|---|---|---|---|---|---|"]
        for r in link:
            lines.append(f"| {r['rate_mbit']:g} | {r['bf16_s']:.3f} | {r['squinch_s']:.3f} | {r['ratio']:.3f} | "
                         f"{r['bf16_overlap_s']:.3f} | {r['squinch_overlap_s']:.3f} | {r['ratio_overlap']:.3f} |")
    with open(opts.out + ".json", "w") as f:
        json.dump({"measured": m, "projection": proj, "link": link}, f, indent=1)
    with open(opts.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

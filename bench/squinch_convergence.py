"""Does a GPT trained with 6-bit Squinch gradients converge like one trained with bf16 gradients?

A small GPT on the demo corpus, DP = 4 on this CPU (gloo), trained for --iters iterations with a
cosine schedule (so the curve flattens), once per gradient reducer:

    fp32 all-reduce | bf16 all-reduce | Squinch + error feedback | Squinch, no error feedback |
    Squinch + stochastic rounding (no EF) | Squinch hierarchical (2 simulated nodes of 2) + EF

Same seed, initialisation and data order in every run; only the reduction differs. Reports the
validation loss curve and the final validation loss of each variant, and its ratio to bf16.

    python bench/squinch_convergence.py             # ~1 h on 2 cores; results/squinch_convergence.*
    python bench/squinch_convergence.py --iters 200 # a quicker look
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from _demo_data import ensure_demo_data  # noqa: E402

from megatron_cai.testing.distributed import run_distributed  # noqa: E402

VARIANTS = {
    "fp32": [],
    "bf16": ["--grad-reduce-in-bf16"],
    "squinch+EF": ["--squinch"],
    "squinch no-EF": ["--squinch", "--no-squinch-error-feedback"],
    "squinch stochastic": ["--squinch", "--no-squinch-error-feedback", "--squinch-stochastic-rounding"],
    "squinch hierarchical+EF": ["--squinch", "--squinch-hierarchical", "--ranks-per-node", "2"],
}


def _worker(rank, world, argv):
    import pretrain_gpt
    from megatron_cai.training.training import Trainer

    config, tokenizer = pretrain_gpt.build_run(argv, world_size=world)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    t0 = time.time()
    state = trainer.train()
    reducer = trainer.model[0].reducer
    inter = getattr(reducer, "inter_node_bytes_sent", reducer.bytes_sent) / max(state.iteration, 1)
    return {"train": [h["lm loss"] for h in state.extra["history"] if "lm loss" in h],
            "validation": state.extra.get("validation", []), "seconds": time.time() - t0,
            "bytes_per_iter": state.extra["history"][-1]["grad comm bytes"], "inter_node_bytes_per_iter": inter}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=1200)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--replot", action="store_true", help="redraw table and figure from the saved JSON")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "squinch_convergence"))
    opts = p.parse_args()
    data, tok = ensure_demo_data()
    base = ["--data-path", data, "--tokenizer-model", tok, "--num-layers", "2", "--hidden-size", "128",
            "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "4",
            "--global-batch-size", "16", "--train-iters", str(opts.iters), "--lr", "2e-3", "--min-lr", "2e-4",
            "--lr-warmup-iters", str(max(opts.iters // 50, 1)), "--weight-decay", "0.1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1000000",
            "--eval-interval", str(opts.eval_interval), "--eval-iters", "8", "--seed", "1234"]
    partial = os.path.join(ROOT, "bench", ".cache", "squinch_convergence.partial.json")
    os.makedirs(os.path.dirname(partial), exist_ok=True)
    results = json.load(open(partial)) if os.path.exists(partial) else {}
    if opts.replot:
        results = json.load(open(opts.out + ".json"))
    for name in opts.variants:
        if name in results and results[name].get("iters") == opts.iters:
            continue
        print(f"== {name}", flush=True)
        r = run_distributed(_worker, 4, (base + VARIANTS[name],), env={"OMP_NUM_THREADS": "1"},
                            timeout=6 * 3600)[-1]
        r["iters"] = opts.iters
        results[name] = r
        json.dump(results, open(partial, "w"))
        print(f"   final validation loss {r['validation'][-1]['lm loss']:.5f} in {r['seconds']:.0f} s", flush=True)
    bf16 = results["bf16"]["validation"][-1]["lm loss"]
    lines = ["# Squinch convergence: DP = 4 on CPU, small GPT on the demo corpus", "",
             f"2 layers, hidden 128, seq 128, global batch 16 (2,048 tokens per step), {opts.iters} iterations, "
             "cosine LR 2e-3 -> 2e-4; validation loss on 8 x 16 held-out sequences.", "",
             "| reducer | final validation loss | ratio to bf16 | (ratio - 1) in % | grad bytes / iteration / rank "
             "| of which inter-node |", "|---|---|---|---|---|---|"]
    for name in opts.variants:
        v = results[name]["validation"][-1]["lm loss"]
        lines.append(f"| {name} | {v:.5f} | {v / bf16:.5f} | {100 * (v / bf16 - 1):+.3f}% | "
                     f"{results[name]['bytes_per_iter']:,} | {results[name]['inter_node_bytes_per_iter']:,.0f} |")
    with open(opts.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(opts.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n\n![validation loss](squinch_convergence.png)\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for name in opts.variants:
            tr = results[name]["train"]
            k = 25
            smooth = [sum(tr[max(0, i - k):i + 1]) / len(tr[max(0, i - k):i + 1]) for i in range(len(tr))]
            axes[0].plot(range(1, len(tr) + 1), smooth, label=name, lw=1)
            val = results[name]["validation"]
            axes[1].plot([x["iteration"] for x in val], [x["lm loss"] for x in val], marker="o", ms=3, label=name)
        axes[0].set(title="training loss (moving average of 25)", xlabel="iteration", ylabel="lm loss")
        axes[1].set(title="validation loss", xlabel="iteration", ylabel="lm loss")
        lo = min(min(x["lm loss"] for x in results[n]["validation"]) for n in opts.variants)
        axes[1].set_ylim(lo - 0.05, lo + 1.0)
        tr_lo = min(min(results[n]["train"]) for n in opts.variants)
        axes[0].set_ylim(tr_lo - 0.1, lo + 2.5)
        for ax in axes:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(opts.out + ".png", dpi=110)
    except ImportError:
        print("matplotlib not installed: no PNG")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

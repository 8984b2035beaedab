"""Does a GPT trained with 6-bit Squinch gradients converge like one trained with bf16 gradients?

A small GPT on the demo corpus, DP = 4 on this CPU (gloo), trained for --iters iterations with a
cosine schedule (so the curve flattens), once per gradient reducer and seed:

    fp32 all-reduce | bf16 all-reduce | Squinch + error feedback | Squinch, no error feedback |
    Squinch + stochastic rounding (no EF) | Squinch hierarchical (2 simulated nodes of 2) + EF |
    FSDP2 (--use-torch-fsdp2) with Squinch + EF as its reduce-scatter | FSDP2 HSDP (2 simulated nodes
    of 2: FSDP2 inside a node, Squinch + EF all-reduce across nodes)

Within a seed every variant has the same initialisation and data order; only the reduction differs.
The validation set is fixed: the same --eval-iters x global-batch held-out sequences (built with one
fixed shuffle seed, whatever --seeds says) at every evaluation of every run. The report gives, per
seed, the paired gap of each variant's final validation loss to bf16 at that seed, then the mean and
standard deviation of the paired gap over seeds, and bf16's own seed-to-seed spread. Finished runs
(in ``<out>.rows.json`` as each one finishes, else in ``<out>.json`` when it has the same --iters) are
reused, not rerun; each new run records when it ran, and the report lists the dates when they differ.

    python bench/squinch_convergence.py --seeds 1 2 3 --iters 400   # results/squinch_convergence.*
    python bench/squinch_convergence.py --quick     # 2 iterations of a toy model, every variant in one set of ranks
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import harness as H
from harness.data import QUICK, demo_corpus

from megatron_cai.testing.distributed import run_distributed

VALIDATION_SEED = 4242  # shuffle seed of the fixed validation set, independent of the training seed
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "4", "--global-batch-size", "16"]
QUICK_MODEL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
               "--micro-batch-size", "4", "--global-batch-size", "16"]
DEFAULT_VARIANTS = ["bf16", "squinch+EF", "squinch no-EF", "squinch hierarchical+EF", "fsdp2 squinch+EF",
                    "fsdp2 HSDP squinch+EF"]
VARIANTS = {
    "fp32": [],
    "bf16": ["--grad-reduce-in-bf16"],
    "squinch+EF": ["--squinch"],
    "squinch no-EF": ["--squinch", "--no-squinch-error-feedback"],
    "squinch stochastic": ["--squinch", "--no-squinch-error-feedback", "--squinch-stochastic-rounding"],
    "squinch hierarchical+EF": ["--squinch", "--squinch-hierarchical", "--ranks-per-node", "2"],
    "fsdp2 squinch+EF": ["--use-torch-fsdp2", "--squinch"],
    "fsdp2 HSDP squinch+EF": ["--use-torch-fsdp2", "--squinch", "--squinch-hierarchical", "--ranks-per-node", "2"],
}


def _fixed_validation_provider(provider, eval_samples: int):
    """Wrap a datasets provider so that the validation split is shuffled with VALIDATION_SEED."""
    import dataclasses

    def build(config, tokenizer, num_samples):
        train, _, test = provider(config, tokenizer, num_samples)
        val_config = dataclasses.replace(config, training=dataclasses.replace(config.training, seed=VALIDATION_SEED))
        _, valid, _ = provider(val_config, tokenizer, (num_samples[0], eval_samples, num_samples[2]))
        return train, valid, test

    return build


def _train(argv: list[str], world: int, eval_samples: int) -> dict:
    from harness import training

    import pretrain_gpt

    trainer = training.build_trainer(argv, world, _fixed_validation_provider(
        pretrain_gpt.train_valid_test_datasets_provider, eval_samples))
    evaluate = trainer.evaluate

    def evaluate_from_start(iterator=None):  # the same sequences at every evaluation
        if iterator is not None:  # the end-of-run evaluation on the validation and test sets
            return evaluate(iterator)
        trainer.valid_iter = training.loader(trainer, trainer.valid_ds)
        return evaluate()

    trainer.evaluate = evaluate_from_start
    t0 = time.time()
    state = trainer.train()
    reducer = trainer.model[0].reducer
    inter = getattr(reducer, "inter_node_bytes_sent", reducer.bytes_sent) / max(state.iteration, 1)
    return {"train": [h["lm loss"] for h in state.extra["history"] if "lm loss" in h],
            "validation": state.extra.get("validation", []), "seconds": time.time() - t0,
            "bytes_per_iter": state.extra["history"][-1]["grad comm bytes"], "inter_node_bytes_per_iter": inter}


def _worker(rank, world, argvs, eval_samples):
    return [_train(argv, world, eval_samples) for argv in argvs]


def _final(results: dict, name: str, seed: int) -> float | None:
    r = results.get(f"{name}@{seed}")
    return r["validation"][-1]["lm loss"] if r and r["validation"] else None


def _summary(results: dict, variants: list[str], seeds: list[int], opts) -> list[str]:
    """Markdown: per-seed final losses and paired gaps to bf16, their mean/std, and bf16's spread."""
    lines = ["# Squinch convergence: DP = 4 on CPU, small GPT on the demo corpus, three seeds", "",
             f"2 layers, hidden 128, seq 128, global batch 16 (2,048 tokens per step), {opts.iters} iterations, "
             f"cosine LR 2e-3 -> 2e-4. Validation: the same {opts.eval_iters * 16} held-out sequences "
             f"(fixed shuffle seed {VALIDATION_SEED}) at every evaluation of every run; the final one is "
             "compared. Paired gap = final loss / bf16's final loss at the same seed - 1.", "",
             "| reducer | " + " | ".join(f"seed {s}: loss (gap)" for s in seeds)
             + " | mean gap | std of gap | grad bytes / iter / rank | of which inter-node |",
             "|---|" + "---|" * (len(seeds) + 4)]
    for name in variants:
        cells, gaps = [], []
        for s in seeds:
            v, b = _final(results, name, s), _final(results, "bf16", s)
            if v is None or b is None:
                cells.append("not run")
                continue
            gaps.append(100 * (v / b - 1))
            cells.append(f"{v:.4f} ({gaps[-1]:+.3f}%)")
        mean = f"{statistics.mean(gaps):+.3f}%" if gaps else "-"
        std = f"{statistics.stdev(gaps):.3f}%" if len(gaps) > 1 else "-"
        any_run = next((results[f"{name}@{s}"] for s in seeds if f"{name}@{s}" in results), None)
        by = f"{any_run['bytes_per_iter']:,}" if any_run else "-"
        inter = f"{any_run['inter_node_bytes_per_iter']:,.0f}" if any_run else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} | {std} | {by} | {inter} |")
    bf = [v for v in (_final(results, "bf16", s) for s in seeds) if v is not None]
    if len(bf) > 1:
        mean_bf = statistics.mean(bf)
        lines += ["", f"bf16's own seed-to-seed spread of the final validation loss: std {statistics.stdev(bf):.4f} "
                  f"({100 * statistics.stdev(bf) / mean_bf:.3f}% of its mean {mean_bf:.4f}), "
                  f"max - min {max(bf) - min(bf):.4f} ({100 * (max(bf) - min(bf)) / mean_bf:.3f}%)."]
        ef = [100 * (_final(results, "squinch+EF", s) / _final(results, "bf16", s) - 1) for s in seeds
              if _final(results, "squinch+EF", s) is not None and _final(results, "bf16", s) is not None]
        if ef:
            spread = 100 * statistics.stdev(bf) / mean_bf
            met = abs(statistics.mean(ef)) <= 0.2 and abs(statistics.mean(ef)) < spread
            lines += ["", f"Goal (Squinch + EF mean paired gap <= 0.2% and smaller than bf16's seed-to-seed std "
                      f"{spread:.3f}%): {'met' if met else 'NOT met'} ({statistics.mean(ef):+.3f}%)."]
    for name in ("fsdp2 squinch+EF", "fsdp2 HSDP squinch+EF"):
        fs = [100 * (_final(results, name, s) / _final(results, "bf16", s) - 1) for s in seeds
              if _final(results, name, s) is not None and _final(results, "bf16", s) is not None]
        if fs and name in variants:
            met = max(abs(g) for g in fs) <= 0.5
            lines += ["", f"Goal ({name} within 0.5% of bf16 DDP's final validation loss at every seed): "
                      f"{'met' if met else 'NOT met'} (gaps {', '.join(f'{g:+.3f}%' for g in fs)})."]
    if any(n.startswith("fsdp2") for n in variants):
        lines += ["", "FSDP2's grad bytes are those of its gradient reduce-scatter alone (it all-gathers parameters, "
                  "not gradients); HSDP's include the fp32 reduce-scatter inside the node, and only its Squinch "
                  "all-reduce crosses nodes."]
    ran = sorted(k for k, r in results.items() if "run_at" in r and k.rsplit("@", 1)[0] in variants)
    reused = sorted({k.rsplit("@", 1)[0] for k, r in results.items() if "run_at" not in r} & set(variants))
    if ran and reused:
        lines += ["", f"Reused from the earlier results file (run before run dates were recorded, not rerun): "
                  f"{', '.join(reused)}, including the paired bf16 baseline. Run later: "
                  + "; ".join(f"{k} at {results[k]['run_at']}" for k in ran) + "."]
    return lines


def _plot(results: dict, variants: list[str], seeds: list[int], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    colors = dict(zip(variants, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = ["-", "--", ":", "-."]
    runs = [(n, s) for n in variants for s in seeds if f"{n}@{s}" in results]
    for n, s in runs:
        r = results[f"{n}@{s}"]
        tr, k = r["train"], 25
        smooth = [sum(tr[max(0, i - k):i + 1]) / len(tr[max(0, i - k):i + 1]) for i in range(len(tr))]
        style = styles[seeds.index(s) % len(styles)]
        axes[0].plot(range(1, len(tr) + 1), smooth, style, color=colors[n], lw=1, label=f"{n} seed {s}")
        val = r["validation"]
        axes[1].plot([x["iteration"] for x in val], [x["lm loss"] for x in val], style, color=colors[n],
                     marker="o", ms=2, lw=1, label=f"{n} seed {s}")
        base = results.get(f"bf16@{s}")
        if base and n != "bf16":  # paired gap to bf16 at the same seed, at every evaluation
            ref = {x["iteration"]: x["lm loss"] for x in base["validation"]}
            pts = [(x["iteration"], 100 * (x["lm loss"] / ref[x["iteration"]] - 1)) for x in val
                   if x["iteration"] in ref]
            axes[2].plot([a for a, _ in pts], [b for _, b in pts], style, color=colors[n], marker="o", ms=2,
                         lw=1, label=f"{n} seed {s}")
    axes[0].set(title="training loss (moving average of 25)", xlabel="iteration", ylabel="lm loss")
    axes[1].set(title="validation loss (fixed set)", xlabel="iteration", ylabel="lm loss")
    axes[2].set(title="validation loss gap to bf16, same seed (%)", xlabel="iteration", ylabel="%")
    axes[2].axhline(0, color="black", lw=0.8)
    if runs:
        lo = min(min(x["lm loss"] for x in results[f"{n}@{s}"]["validation"]) for n, s in runs)
        axes[1].set_ylim(lo - 0.05, lo + 1.0)
        tr_lo = min(min(results[f"{n}@{s}"]["train"]) for n, s in runs)
        axes[0].set_ylim(tr_lo - 0.1, lo + 2.5)
    for ax in axes:
        ax.legend(fontsize=6, ncol=2)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)


def render(payload: dict) -> str:
    """The report of a results file. Files written before the payload named its variants ran the defaults."""
    variants = payload.get("variants", DEFAULT_VARIANTS)
    opts = argparse.Namespace(iters=payload["iters"], eval_iters=payload["validation_sequences"] // 16)
    lines = _summary(payload["runs"], variants, payload["seeds"], opts)
    return "\n".join(lines) + f"\n\n![validation loss]({payload.get('name', 'squinch_convergence')}.png)\n"


def plot(payload: dict, path: str) -> None:
    _plot(payload["runs"], payload.get("variants", DEFAULT_VARIANTS), payload["seeds"], path[: -len(".png")])


def _quick(o: argparse.Namespace) -> None:
    o.iters, o.eval_interval, o.eval_iters, o.seeds = 2, 2, 4, o.seeds[:1]


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "squinch_convergence")
    H.add(p, iters=400, eval_interval=50, seeds=[1, 2, 3])
    p.add_argument("--eval-iters", type=int, default=8, help="validation set = eval-iters x 16 sequences (>= 4)")
    p.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--runs", nargs="*", default=None, metavar="VARIANT@SEED",
                   help="run only these, in this order (e.g. to split the work over two processes with "
                        "different --out, then merge their rows files)")
    opts = H.parse(p, argv, quick=_quick)
    if opts.eval_iters < 4:
        p.error("--eval-iters must be >= 4 (a validation set of at least 64 sequences)")
    if "bf16" not in opts.variants:
        opts.variants = ["bf16"] + opts.variants
    model = QUICK_MODEL if opts.quick else MODEL
    out = H.Results(opts.out, {"iters": opts.iters, "eval_interval": opts.eval_interval,
                               "eval_iters": opts.eval_iters, "model": model})
    if opts.from_json:
        out.rewrite(render, plot)
        return
    results = {}
    if os.path.exists(opts.out + ".json"):  # reuse finished runs of the same length
        with open(opts.out + ".json") as f:
            previous = json.load(f)
        if previous.get("iters") == opts.iters:
            results = previous["runs"]
    size = dict(vocab=QUICK["vocab"], max_mb=QUICK["corpus_mb"]) if opts.quick else {}
    data, tok = demo_corpus(opts.cache_dir, **size)
    order = [(n, s) for s in opts.seeds for n in opts.variants]  # seed-major: complete paired gaps first
    if opts.runs is not None:
        order = [(k.rsplit("@", 1)[0], int(k.rsplit("@", 1)[1])) for k in opts.runs]
    order = [(n, s) for n, s in order if results.get(f"{n}@{s}", {}).get("iters") != opts.iters]

    def argv_of(name: str, seed: int) -> list[str]:
        return ["--data-path", data, "--tokenizer-model", tok, *model, "--train-iters", str(opts.iters),
                "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", str(max(opts.iters // 50, 1)),
                "--weight-decay", "0.1", "--hidden-dropout", "0", "--attention-dropout", "0",
                "--log-interval", "1000000", "--eval-interval", str(opts.eval_interval),
                "--eval-iters", str(opts.eval_iters), "--seed", str(seed),
                "--position-embedding-type", "rope", "--lr-decay-style", "cosine", "--num-workers", "0",
                "--squared-relu", *VARIANTS[name]]

    def run(pairs: list[tuple[str, int]]) -> list[dict]:
        argvs = [argv_of(n, s) for n, s in pairs]
        runs = run_distributed(_worker, 4, (argvs, opts.eval_iters * 16), env={"OMP_NUM_THREADS": "1"},
                               timeout=6 * 3600)[-1]
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        return [{**r, "iters": opts.iters, "run_at": stamp} for r in runs]

    if opts.quick and order:  # every variant in one set of ranks
        results.update({f"{n}@{s}": r for (n, s), r in zip(order, run(order))})
    for name, seed in order:
        key = f"{name}@{seed}"
        if key in results:
            continue
        print(f"== {key}", flush=True)
        results[key] = out.row(key, lambda name=name, seed=seed: run([(name, seed)])[0])
        print(f"   final validation loss {results[key]['validation'][-1]['lm loss']:.5f} in "
              f"{results[key]['seconds']:.0f} s", flush=True)
    out.write({"iters": opts.iters, "seeds": opts.seeds, "validation_sequences": opts.eval_iters * 16,
               "validation_seed": VALIDATION_SEED, "variants": opts.variants,
               "name": os.path.basename(opts.out), "runs": results}, render, plot, record_machine=False)


if __name__ == "__main__":
    main()

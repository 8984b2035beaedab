"""fp16 with Megatron's dynamic loss scaler against bf16: the small GPT on the demo corpus.

    python bench/fp16_training.py [--iters 200] [--seeds 1234] [--quick] [--out bench/results/fp16_training]

Both runs train the same model from the same initialisation on the same batches through ``pretrain_gpt.py``'s
training path (fp32 master weights): ``bf16`` under bf16 autocast, ``fp16`` under fp16 autocast with
``--fp16`` (dynamic loss scale from 2**32, hysteresis 2, window 1000, as Megatron's defaults). Reports the
final validation loss on fixed validation batches, the mean training loss over the last 20 iterations, the
skipped (overflow) iterations and the loss-scale trajectory. Goal: fp16 ends within 1% of bf16.
Writes ``PREFIX.json``, ``PREFIX.md`` and ``PREFIX.png``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import harness as H
from harness import training
from harness.data import QUICK, demo_corpus

CONFIGS = {"bf16": ["--bf16"], "fp16": ["--fp16"]}


def training_argv(opts, data: str, tok: str, seed: int) -> list[str]:
    return ["--squared-relu",
            "--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden), "--num-attention-heads",
            str(opts.heads), "--seq-length", str(opts.seq), "--max-position-embeddings", str(opts.seq),
            "--micro-batch-size", str(opts.batch), "--global-batch-size", str(opts.batch),
            "--train-iters", str(opts.iters), "--lr", str(opts.lr), "--min-lr", str(opts.lr / 10),
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(opts.iters // 10), "--weight-decay", "0.1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", str(seed), "--data-path", data,
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok, "--split", "949,50,1",
            "--data-cache-path", os.path.join(opts.cache_dir, "index"), "--eval-interval", str(opts.iters + 1),
            "--eval-iters", "1", "--log-interval", str(opts.iters), "--device", "cpu",
            "--make-vocab-size-divisible-by", "128", "--no-exit-signal-handler",
            "--position-embedding-type", "rope", "--num-workers", "0"]


def run_one(name: str, opts, data: str, tok: str, seed: int) -> dict:
    trainer = training.build_trainer(training_argv(opts, data, tok, seed) + CONFIGS[name])
    start = time.time()
    state = trainer.train()
    seconds = time.time() - start
    trainer.config.logging.eval_iters = opts.final_eval_iters
    trainer.valid_iter = training.loader(trainer, trainer.valid_ds)
    final = trainer.evaluate()["lm loss"]
    hist = state.extra["history"]
    return {"name": name, "seed": seed, "final_valid_loss": final, "seconds": seconds,
            "train_loss": [h["lm loss"] for h in hist], "skipped": state.skipped_iterations,
            "loss_scale": [h.get("loss scale") for h in hist],
            "last20_train_loss": statistics.mean(h["lm loss"] for h in hist[-20:])}


def report(payload: dict) -> str:
    runs, opts = payload["runs"], argparse.Namespace(**payload["options"])
    lines = ["# fp16 (dynamic loss scaling) vs bf16", "",
             f"`python bench/fp16_training.py` — GPT {opts.layers} layers, hidden {opts.hidden}, {opts.heads} heads, "
             f"seq {opts.seq}, batch {opts.batch}, {opts.iters} iterations (lr {opts.lr:g} cosine), on the demo "
             f"corpus (vocab {opts.vocab}); same initialisation and batches per seed. Final validation loss over "
             f"{opts.final_eval_iters} fixed validation batches; train loss = mean of the last 20 iterations.", "",
             "| seed | run | final valid loss | ratio to bf16 | last-20 train loss | skipped iterations | "
             "final loss scale |", "|---|---|---|---|---|---|---|"]
    ratios = []
    for seed in sorted({r["seed"] for r in runs}):
        ref = next(r for r in runs if r["seed"] == seed and r["name"] == "bf16")
        for r in (x for x in runs if x["seed"] == seed):
            ratio = r["final_valid_loss"] / ref["final_valid_loss"]
            if r["name"] == "fp16":
                ratios.append(ratio)
            scale = r["loss_scale"][-1]
            lines.append(f"| {seed} | {r['name']} | {r['final_valid_loss']:.4f} | {ratio:.4f} | "
                         f"{r['last20_train_loss']:.4f} | {r['skipped']} | {scale if scale else '-'} |")
    lines += ["", f"fp16 / bf16 final validation loss: median {statistics.median(ratios):.4f} "
              f"(min {min(ratios):.4f}, max {max(ratios):.4f}) over {len(ratios)} seed(s); goal within 1%: "
              f"{'met' if all(abs(x - 1) < 0.01 for x in ratios) else 'NOT met'}."]
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    runs = payload["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in runs:
        ax1.plot(r["train_loss"], label=f"{r['name']} seed {r['seed']}", alpha=0.8)
        if r["name"] == "fp16":
            ax2.semilogy([s for s in r["loss_scale"]], label=f"seed {r['seed']}")
    ax1.set(xlabel="iteration", ylabel="train loss", title="training loss")
    ax2.set(xlabel="iteration", ylabel="loss scale", title="fp16 dynamic loss scale")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "fp16_training")
    H.add(p, iters=200, layers=4, hidden=128, heads=4, seq=128, batch=8, lr=1e-3, vocab=4096, corpus_mb=4.0,
          final_eval_iters=20, seeds=[1234])
    opts = H.parse(p, argv, quick=dict(iters=4, layers=1, hidden=32, heads=2, seq=32, batch=2, final_eval_iters=1,
                                       vocab=QUICK["vocab"], corpus_mb=QUICK["corpus_mb"]))
    out = H.Results(opts.out)
    if opts.from_json:
        out.rewrite(report, plot)
        return
    data, tok = demo_corpus(opts.cache_dir, opts.vocab, opts.corpus_mb)
    runs = []
    for seed in opts.seeds:
        for name in CONFIGS:  # alternated per seed
            runs.append(out.row(f"{name}@{seed}", lambda name=name, seed=seed: run_one(name, opts, data, tok, seed)))
            print(f"seed {seed} {name}: final valid loss {runs[-1]['final_valid_loss']:.4f} "
                  f"skipped {runs[-1]['skipped']} ({runs[-1]['seconds']:.0f} s)", flush=True)
    out.write({"options": {k: v for k, v in vars(opts).items() if k not in ("from_json", "bench")}, "runs": runs},
              report, plot, record_machine=False)


if __name__ == "__main__":
    main()

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
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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
    import pretrain_gpt
    from megatron_cai.training.training import Trainer

    config, tokenizer = pretrain_gpt.build_run(training_argv(opts, data, tok, seed) + CONFIGS[name], world_size=1)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    start = time.time()
    state = trainer.train()
    seconds = time.time() - start
    trainer.config.logging.eval_iters = opts.final_eval_iters
    trainer.valid_iter = trainer._loader(trainer.valid_ds, 0)
    final = trainer.evaluate()["lm loss"]
    hist = state.extra["history"]
    return {"name": name, "seed": seed, "final_valid_loss": final, "seconds": seconds,
            "train_loss": [h["lm loss"] for h in hist], "skipped": state.skipped_iterations,
            "loss_scale": [h.get("loss scale") for h in hist],
            "last20_train_loss": statistics.mean(h["lm loss"] for h in hist[-20:])}


def report(runs: list[dict], opts) -> str:
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


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--final-eval-iters", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234])
    p.add_argument("--quick", action="store_true", help="20 iterations, a smaller model (a smoke run)")
    p.add_argument("--cache-dir", default="/tmp/megatron_cai_bench/fp16_training")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fp16_training"))
    opts = p.parse_args()
    if opts.quick:
        opts.iters, opts.layers, opts.hidden, opts.seq, opts.final_eval_iters = 20, 2, 64, 64, 4
    from bench._demo_data import ensure_demo_data

    data, tok = ensure_demo_data(opts.vocab)
    runs = []
    for seed in opts.seeds:
        for name in CONFIGS:  # alternated per seed
            runs.append(run_one(name, opts, data, tok, seed))
            print(f"seed {seed} {name}: final valid loss {runs[-1]['final_valid_loss']:.4f} "
                  f"skipped {runs[-1]['skipped']} ({runs[-1]['seconds']:.0f} s)", flush=True)
    md = report(runs, opts)
    print(md)
    os.makedirs(os.path.dirname(opts.out) or ".", exist_ok=True)
    with open(opts.out + ".json", "w") as f:
        json.dump({"options": vars(opts), "runs": runs}, f, indent=1)
    with open(opts.out + ".md", "w") as f:
        f.write(md)
    plot(runs, opts.out + ".png")


if __name__ == "__main__":
    main()

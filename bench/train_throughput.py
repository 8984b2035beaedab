"""Training-step throughput of pretrain_gpt.py's Trainer vs a minimal plain-PyTorch loop.

Same model (GPTModel, same config and initialisation), same micro-batches, same CPU and thread count,
in one process. The plain loop is what a nanoGPT-style script does: forward, mean loss, backward,
clip, ``torch.optim.AdamW`` (foreach), ``zero_grad``. Ours is ``Trainer.train_step`` (DDP wrapper with
contiguous gradient buckets and backward hooks, flat AdamW, global grad norm, skip-on-non-finite).
Timing windows alternate between the two to cancel drift on a shared machine; the ratio of median
tokens/s is reported.

    python bench/train_throughput.py [--steps 10 --rounds 5]     # writes bench/results/train_throughput.*
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pretrain_gpt  # noqa: E402
from megatron_cai.core.models.gpt.model import GPTModel  # noqa: E402
from megatron_cai.training.training import Trainer  # noqa: E402

CONFIGS = {
    "small (4L, h192, seq128, mbs16)": ["--squared-relu",
                                        "--num-layers", "4", "--hidden-size", "192", "--num-attention-heads", "4",
                                        "--seq-length", "128", "--micro-batch-size", "16"],
    "medium (6L, h256, seq256, mbs8)": ["--squared-relu",
                                        "--num-layers", "6", "--hidden-size", "256", "--num-attention-heads", "4",
                                        "--seq-length", "256", "--micro-batch-size", "8"],
}


def run_config(name: str, flags: list[str], steps: int, rounds: int) -> dict:
    argv = flags + ["--mock-data", "--vocab-size", "4096", "--train-iters", str(10_000), "--lr", "1e-3",
                    "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1000000",
                    "--eval-interval", "0", "--eval-iters", "0", "--clip-grad", "1.0",
                    "--position-embedding-type", "rope", "--lr-decay-style", "cosine", "--num-workers", "0"]
    config, tokenizer = pretrain_gpt.build_run(argv, world_size=1)
    trainer = Trainer(config, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step, tokenizer)
    plain = GPTModel(trainer.config.model)
    plain.initialize(config.training.seed)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    batches = trainer._next_microbatches(trainer.train_iter)
    tokens = config.training.global_batch_size * config.model.seq_length

    def plain_step():
        for b in batches:
            loss = plain(b["tokens"], b["position_ids"], labels=b["labels"])
            loss = (loss * b["loss_mask"]).sum() / b["loss_mask"].sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def ours_step():
        trainer.train_step()

    for fn in (plain_step, ours_step):  # warm up both
        fn()
        fn()
    times = {"plain": [], "ours": []}
    for _ in range(rounds):
        for label, fn in (("plain", plain_step), ("ours", ours_step)):
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[label].append(tokens * steps / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"config": name, "tokens_per_step": tokens, "threads": torch.get_num_threads(),
            "plain_tokens_per_s": med["plain"], "ours_tokens_per_s": med["ours"],
            "ratio": med["ours"] / med["plain"], "rounds": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "train_throughput"))
    opts = p.parse_args()
    rows = []
    for name, flags in CONFIGS.items():
        from megatron_cai.core import parallel_state as ps

        ps.destroy_model_parallel()
        rows.append(run_config(name, flags, opts.steps, opts.rounds))
        r = rows[-1]
        print(f"{name}: plain {r['plain_tokens_per_s']:.0f} tok/s, ours {r['ours_tokens_per_s']:.0f} tok/s, "
              f"ratio {r['ratio']:.3f}", flush=True)
    lines = ["# Training throughput: pretrain_gpt.py's step vs a plain PyTorch loop (same model, CPU)", "",
             f"torch {torch.__version__}, {rows[0]['threads']} threads, fp32, median of {opts.rounds} "
             f"alternating windows of {opts.steps} steps.", "",
             "| config | tokens/step | plain loop tok/s | pretrain_gpt tok/s | ratio (ours / plain) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['tokens_per_step']} | {r['plain_tokens_per_s']:.0f} | "
                     f"{r['ours_tokens_per_s']:.0f} | {r['ratio']:.3f} |")
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(opts.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Training-step throughput of pretrain_gpt.py's Trainer vs a minimal plain-PyTorch loop.

Same model (GPTModel, same config and initialisation), same micro-batches, same CPU and thread count,
in one process. The plain loop is what a nanoGPT-style script does: forward, mean loss, backward,
clip, ``torch.optim.AdamW`` (foreach), ``zero_grad``. Ours is ``Trainer.train_step`` (DDP wrapper with
contiguous gradient buckets and backward hooks, flat AdamW, global grad norm, skip-on-non-finite).
Timing windows alternate between the two to cancel drift on a shared machine; the ratio of median
tokens/s is reported, with the load average before and after.

    python bench/train_throughput.py [--steps 8 --rounds 5]     # writes bench/results/train_throughput.*
"""
from __future__ import annotations

import statistics
import time

import harness as H
import torch
from harness import training

CONFIGS = {
    "small (4L, h192, seq128, mbs16)": ["--num-layers", "4", "--hidden-size", "192", "--num-attention-heads", "4",
                                        "--seq-length", "128", "--micro-batch-size", "16"],
    "medium (6L, h256, seq256, mbs8)": ["--num-layers", "6", "--hidden-size", "256", "--num-attention-heads", "4",
                                        "--seq-length", "256", "--micro-batch-size", "8"],
}
QUICK_CONFIGS = {"toy (1L, h32, seq16, mbs2)": ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
                                                "2", "--seq-length", "16", "--micro-batch-size", "2"]}


def run_config(name: str, flags: list[str], steps: int, rounds: int) -> dict:
    from megatron_cai.core.models.gpt.model import GPTModel

    argv = flags + ["--mock-data", "--vocab-size", "4096", "--train-iters", str(10_000), "--lr", "1e-3",
                    "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1000000",
                    "--eval-interval", "0", "--eval-iters", "0", "--clip-grad", "1.0",
                    "--position-embedding-type", "rope", "--lr-decay-style", "cosine", "--num-workers", "0",
                    "--squared-relu"]
    trainer = training.build_trainer(argv)
    config = trainer.config
    plain = GPTModel(config.model)
    plain.initialize(config.training.seed)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    batches = training.microbatches(trainer)
    tokens = config.training.global_batch_size * config.model.seq_length

    def plain_step():
        for b in batches:
            loss = plain(b["tokens"], b["position_ids"], labels=b["labels"])
            loss = (loss * b["loss_mask"]).sum() / b["loss_mask"].sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def window(step):
        def timed() -> float:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            return tokens * steps / (time.perf_counter() - t0)
        return timed

    for fn in (plain_step, trainer.train_step):  # warm up both
        fn()
        fn()
    times = H.alternate({"plain": window(plain_step), "ours": window(trainer.train_step)}, rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"config": name, "tokens_per_step": tokens, "threads": torch.get_num_threads(),
            "plain_tokens_per_s": med["plain"], "ours_tokens_per_s": med["ours"],
            "ratio": med["ours"] / med["plain"], "rounds": times}


def render(payload: dict) -> str:
    rows, s = payload["rows"], payload["settings"]
    lines = ["# Training throughput: pretrain_gpt.py's step vs a plain PyTorch loop (same model, CPU)", "",
             f"torch {s['torch']}, {rows[0]['threads']} threads, fp32, median of {s['rounds']} "
             f"alternating windows of {s['steps']} steps.", "",
             "| config | tokens/step | plain loop tok/s | pretrain_gpt tok/s | ratio (ours / plain) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['tokens_per_step']} | {r['plain_tokens_per_s']:.0f} | "
                     f"{r['ours_tokens_per_s']:.0f} | {r['ratio']:.3f} |")
    if "machine" in payload:
        lines += ["", f"Machine: {H.results.load_line(payload['machine']['start'])} at the start, "
                  f"{H.results.load_line(payload['machine']['end'])} at the end."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = H.parser(__doc__, "train_throughput")
    H.add(p, steps=8, rounds=5)
    opts = H.parse(p, argv, quick=dict(steps=1, rounds=1))
    settings = {"steps": opts.steps, "rounds": opts.rounds, "torch": torch.__version__}
    out = H.Results(opts.out, settings)
    if opts.from_json:
        out.rewrite(render)
        return
    rows = []
    for name, flags in (QUICK_CONFIGS if opts.quick else CONFIGS).items():
        rows.append(out.row(name, lambda name=name, flags=flags: run_config(name, flags, opts.steps, opts.rounds)))
        r = rows[-1]
        print(f"{name}: plain {r['plain_tokens_per_s']:.0f} tok/s, ours {r['ours_tokens_per_s']:.0f} tok/s, "
              f"ratio {r['ratio']:.3f}", flush=True)
    out.write({"settings": settings, "rows": rows}, render)


if __name__ == "__main__":
    main()

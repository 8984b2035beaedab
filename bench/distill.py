"""Gumbel top-k distillation: storage per token, and a teacher distilled into a smaller student four ways.

    python bench/distill.py                 # ~20-30 min on a 2-core CPU
    python bench/distill.py --quick         # seconds: tiny models, a few steps, the scripts run in-process

1. Bytes per token of the teacher's targets: dense bf16 logits (V x 2 bytes) vs a top-k store and the
   Gumbel-k store (ids + fp16 logits + kappa + lse, the sidecar format of tools/dump_teacher_samples.py) at
   k = 8, 32, 128, plus the size the store actually takes on disk.
2. The demo corpus (tools/make_demo_corpus.py -> train_tokenizer.py -> preprocess_data.py, cached under
   --cache-dir) trains a teacher with pretrain_gpt.py; a smaller student is then trained on the same
   tokens with no KD, full-logit KD (online teacher, --distill-estimator full), top-k KD (a top-k store,
   --distill-estimator topk) and Gumbel-k KD (a Gumbel store, --distill-estimator priority), all with the
   same seed, data order, steps and alpha. Each student is evaluated on held-out data (the valid split):
   cross entropy (validation loss) and the exact KL(teacher || student) over the full vocabulary, at
   several checkpoints (the curve) and at the end.

Writes bench/results/distill.{json,md,png}. Timings are not asserted; everything runs side by side in one go.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time

import harness as H
import torch
from harness.data import QUICK, demo_corpus
from harness.scripts import run_script

from megatron_cai.core import parallel_state as ps
from megatron_cai.core.datasets.builder import build_train_valid_test_datasets
from megatron_cai.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron_cai.training.checkpoint import load_canonical
from megatron_cai.training.features.distill import build_teacher

RUNS = ("no KD", "full KD (online)", "top-k KD", "Gumbel-k KD")
LOG_RE = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)(?:.*?distill loss: ([0-9.E+-]+))?"
                    r"(?:.*?distill kl: ([0-9.E+-]+))?")


# ------------------------------------------------------------------------------------------ storage
def bytes_per_token(vocab: int, k: int) -> dict[str, int]:
    """Bytes per token position of each way to keep the teacher's targets (see the module docstring)."""
    ids = 2 if vocab <= 1 << 16 else 4
    return {"dense bf16": 2 * vocab,
            "top-k (ids + fp16 logits + lse)": k * (ids + 2) + 4,
            "Gumbel-k (ids + fp16 logits + kappa + lse)": k * (ids + 2) + 8}


def storage_table(vocabs: list[int], ks: tuple[int, ...]) -> list[dict]:
    rows = []
    for v in vocabs:
        for k in ks:
            b = bytes_per_token(v, k)
            rows.append({"vocab": v, "k": k, **b,
                         "dense / Gumbel-k": b["dense bf16"] / b["Gumbel-k (ids + fp16 logits + kappa + lse)"]})
    return rows


# --------------------------------------------------------------------------------------------- runs
def model_flags(layers: int, hidden: int, heads: int) -> list[str]:
    return ["--squared-relu",
            "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads)]


def parse_log(text: str) -> list[dict]:
    rows = []
    for m in LOG_RE.finditer(text):
        row = {"iteration": int(m.group(1)), "lm loss": float(m.group(2))}
        if m.group(3):
            row["distill loss"], row["distill kl"] = float(m.group(3)), float(m.group(4))
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def eval_tokens(prefix: str, tok: str, split: str, seq: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels [n, seq] of the first n held-out (valid split) samples."""
    from megatron_cai.training.tokenizer import build_tokenizer

    eod = build_tokenizer("SentencePieceTokenizer", tok).eod
    _, valid, _ = build_train_valid_test_datasets([prefix], split, (1, n, 0),
                                                  GPTDatasetConfig(sequence_length=seq, random_seed=1234,
                                                                   eod_token_id=eod))
    items = [valid[i] for i in range(min(n, len(valid)))]
    return torch.stack([it["tokens"] for it in items]), torch.stack([it["labels"] for it in items])


@torch.no_grad()
def log_probs(ckpt: str, step: int | None, tokens: torch.Tensor, batch: int = 8) -> torch.Tensor:
    """log softmax of a checkpoint's logits over its real vocabulary, [n, seq, V] fp32."""
    ck = load_canonical(ckpt, step, load_optimizer=False)
    model = build_teacher(ck, padded_vocab_size=ck.model["embedding.word_embeddings.weight"].shape[0])
    pos = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    out = [torch.log_softmax(model(tokens[i:i + batch], pos[i:i + batch])[..., : ck.config.vocab_size].float(), -1)
           for i in range(0, tokens.shape[0], batch)]
    return torch.cat(out)


def evaluate(log_q: torch.Tensor, log_p: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Held-out cross entropy of the student and KL(teacher || student), nats per token."""
    ce = -torch.gather(log_q, -1, labels.unsqueeze(-1)).mean().item()
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return {"val loss": ce, "KL(teacher||student)": kl}


# --------------------------------------------------------------------------------------------- main
def _quick(args: argparse.Namespace) -> None:
    args.teacher, args.student, args.teacher_iters, args.student_iters = "1,32,2", "1,16,2", 4, 4
    args.eval_samples, args.seq_length, args.batch, args.k, args.curve_points = 4, 32, 4, 8, 2
    args.corpus_mb, args.vocab_size = QUICK["corpus_mb"], QUICK["vocab"]


def parse_args(argv=None) -> argparse.Namespace:
    p = H.parser(__doc__, "distill")
    H.add(p, vocab_size=4096, corpus_mb=4.0, seq_length=128, batch=16, teacher="4,192,4", student="2,96,4",
          teacher_iters=250, student_iters=150)
    p.add_argument("--k", type=int, default=32)
    H.add(p, alpha=1.0)
    p.add_argument("--eval-samples", type=int, default=48)
    p.add_argument("--curve-points", type=int, default=4, help="held-out evaluations per student run")
    p.add_argument("--split", default="95,5,0")
    return H.parse(p, argv, quick=_quick)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_files = H.Results(args.out)
    if args.from_json:
        out_files.rewrite(to_markdown, plot)
        return 0
    t_start = time.time()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    print(f"== data ({args.cache_dir})", flush=True)
    prefix, tok = demo_corpus(args.cache_dir, args.vocab_size, args.corpus_mb)

    def sh(cmd: list[str], log: str) -> str:
        return run_script(cmd[0], cmd[1:], log, in_process=args.quick)

    # The teacher is cached per configuration; stores and students are always recomputed.
    key = hashlib.md5(json.dumps([args.teacher, args.teacher_iters, args.seq_length, args.batch, args.vocab_size,
                                  args.corpus_mb, args.split]).encode()).hexdigest()[:10]
    runs_dir = os.path.join(args.cache_dir, f"runs_{key}")
    os.makedirs(runs_dir, exist_ok=True)
    for name in os.listdir(runs_dir):
        if name.startswith(("store_", "student_")):
            shutil.rmtree(os.path.join(runs_dir, name))
    seq, gbs = args.seq_length, args.batch
    common = ["--seq-length", str(seq), "--max-position-embeddings", str(seq), "--hidden-dropout", "0",
              "--attention-dropout", "0", "--data-path", prefix, "--tokenizer-model", tok, "--split", args.split,
              "--micro-batch-size", str(gbs), "--global-batch-size", str(gbs), "--eval-interval", "0",
              "--eval-iters", "0", "--seed", "1234", "--lr-decay-style", "cosine", "--weight-decay", "0.01",
              "--no-save-optim", "--device", "cpu", "--position-embedding-type", "rope",
              "--num-workers", "0"]
    teacher_dir = os.path.join(runs_dir, "teacher")
    timings = {}
    print("== teacher", flush=True)
    t0 = time.time()
    if not os.path.exists(os.path.join(teacher_dir, "latest_checkpointed_iteration.txt")):
        out = sh(["pretrain_gpt.py", *model_flags(*map(int, args.teacher.split(","))), *common,
                  "--train-iters", str(args.teacher_iters), "--lr", "2e-3", "--lr-warmup-iters", "10",
                  "--log-interval", "10", "--save", teacher_dir], os.path.join(runs_dir, "teacher.log"))
        with open(os.path.join(runs_dir, "teacher_seconds.txt"), "w") as f:
            f.write(f"{time.time() - t0:.1f}\n")
    else:
        out = open(os.path.join(runs_dir, "teacher.log")).read()
    teacher_curve = parse_log(out)
    seconds_file = os.path.join(runs_dir, "teacher_seconds.txt")
    timings["teacher" if os.path.exists(seconds_file) else "teacher (cached)"] = (
        float(open(seconds_file).read()) if os.path.exists(seconds_file) else time.time() - t0)

    s_iters = args.student_iters
    student_data = [*common, "--train-iters", str(s_iters)]
    stores = {}
    for sampler in ("topk", "gumbel"):
        stores[sampler] = os.path.join(runs_dir, f"store_{sampler}_k{args.k}")
        print(f"== dump ({sampler}, k={args.k})", flush=True)
        t0 = time.time()
        sh(["tools/dump_teacher_samples.py", "--load", teacher_dir, "--output", stores[sampler], "--k", str(args.k),
            "--sampler", sampler, "--data-path", prefix, "--split", args.split, "--seq-length", str(seq), "--seed",
            "1234", "--train-iters", str(s_iters), "--global-batch-size", str(gbs), "--tokenizer-model", tok,
            "--shard-size", "256", "--micro-batch-size", "16", "--no-progress", "--device", "cpu"],
           os.path.join(runs_dir, f"dump_{sampler}.log"))
        timings[f"dump {sampler}"] = time.time() - t0
    kd = ["--distill-alpha", str(args.alpha), "--distill-k", str(args.k)]
    run_flags = {"no KD": [],
                 "full KD (online)": ["--distill-teacher-load", teacher_dir, "--distill-estimator", "full", *kd],
                 "top-k KD": ["--distill-samples", stores["topk"], "--distill-estimator", "topk", *kd],
                 "Gumbel-k KD": ["--distill-samples", stores["gumbel"], "--distill-estimator", "priority", *kd]}
    save_every = max(1, s_iters // args.curve_points)
    curves, ckpts = {}, {}
    for name in RUNS:
        slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        ckpts[name] = os.path.join(runs_dir, f"student_{slug}")
        print(f"== student: {name}", flush=True)
        t0 = time.time()
        out = sh(["pretrain_gpt.py", *model_flags(*map(int, args.student.split(","))), *student_data,
                  "--lr", "3e-3", "--lr-warmup-iters", "10", "--log-interval", "5", "--save", ckpts[name],
                  "--save-interval", str(save_every), *run_flags[name]], os.path.join(runs_dir, f"{slug}.log"))
        timings[name] = time.time() - t0
        curves[name] = parse_log(out)

    print("== held-out evaluation", flush=True)
    tokens, labels = eval_tokens(prefix, tok, args.split, seq, args.eval_samples)
    ps.initialize_model_parallel(1, 1)
    log_p = log_probs(teacher_dir, None, tokens)
    teacher_eval = {"val loss": -torch.gather(log_p, -1, labels.unsqueeze(-1)).mean().item(),
                    "entropy": -(log_p.exp() * log_p).sum(-1).mean().item()}
    steps = sorted({*range(save_every, s_iters + 1, save_every), s_iters})
    heldout = {name: [{"iteration": s, **evaluate(log_probs(ckpts[name], s, tokens), log_p, labels)} for s in steps]
               for name in RUNS}
    ps.destroy_model_parallel()
    final = {name: heldout[name][-1] for name in RUNS}
    full_kl = final["full KD (online)"]["KL(teacher||student)"]
    for name in RUNS:
        final[name]["KL / full-KD KL"] = final[name]["KL(teacher||student)"] / full_kl

    store_bytes = {}
    for sampler, path in stores.items():
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".bin"))
        store_bytes[sampler] = size / (s_iters * gbs * seq)
    g, t = final["Gumbel-k KD"]["KL(teacher||student)"], final["top-k KD"]["KL(teacher||student)"]
    goal = {"gumbel_within_5pct_of_full": abs(g / full_kl - 1) <= 0.05, "gumbel_below_topk": g < t}
    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("bench", "out", "from_json")},
        "tokens": {"teacher": args.teacher_iters * gbs * seq, "student": s_iters * gbs * seq,
                   "eval": int(tokens.numel())},
        "storage": storage_table([args.vocab_size] + ([8192] if args.vocab_size != 8192 else []), (8, 32, 128)),
        "store_bytes_per_token_on_disk": store_bytes,
        "teacher": {**teacher_eval, "curve": teacher_curve},
        "final": final, "heldout_curves": heldout, "train_curves": curves, "goal": goal,
        "seconds": {k: round(v, 1) for k, v in timings.items()}, "total_seconds": round(time.time() - t_start, 1),
        "torch": torch.__version__, "cpus": os.cpu_count(),
    }
    out_files.write(result, to_markdown, plot, record_machine=False)
    return 0


def to_markdown(r: dict) -> str:
    c = r["config"]
    lines = [f"# Gumbel top-k distillation (`python bench/distill.py`{' --quick' if c['quick'] else ''})", "",
             f"## Bytes per token of the teacher's targets (demo vocabulary V = {c['vocab_size']})", "",
             "Dense: all V logits in bf16. Top-k: k ids (uint16 for V <= 65536) + k fp16 logits + lse (fp32). "
             "Gumbel-k: the same plus kappa (fp32), the sidecar format of `tools/dump_teacher_samples.py`.", "",
             "| V | k | dense bf16 | top-k | Gumbel-k | dense / Gumbel-k |", "|---:|---:|---:|---:|---:|---:|"]
    for row in r["storage"]:
        vals = list(row.values())
        lines.append(f"| {row['vocab']} | {row['k']} | {vals[2]:,} | {vals[3]:,} | {vals[4]:,} | "
                     f"{row['dense / Gumbel-k']:.0f}x |")
    disk = r["store_bytes_per_token_on_disk"]
    lines += ["", f"Measured on disk (k = {c['k']}, shards incl. headers and alignment): top-k store "
              f"{disk['topk']:.1f} B/token, Gumbel store {disk['gumbel']:.1f} B/token.", "",
              "## Distilling a teacher into a smaller student", "",
              f"Demo corpus (stdlib sources, {c['corpus_mb']} MB), sentencepiece BPE V = {c['vocab_size']}, "
              f"split {c['split']}, seq {c['seq_length']}, batch {c['batch']}. Teacher (layers, hidden, heads) = "
              f"({c['teacher']}) trained {c['teacher_iters']} iterations ({r['tokens']['teacher']:,} tokens); "
              f"student ({c['student']}) trained {c['student_iters']} iterations ({r['tokens']['student']:,} "
              f"tokens), same seed, data order and LR schedule in every run; KD runs use alpha = {c['alpha']} "
              f"(loss = (1 - alpha) CE + alpha KD), tau = 1, k = {c['k']}. Held-out: the first "
              f"{r['tokens']['eval']:,} tokens of the valid split; KL(teacher || student) is exact over the full "
              "vocabulary (nats/token).", "",
              f"Teacher: held-out loss {r['teacher']['val loss']:.4f}, entropy {r['teacher']['entropy']:.4f}.", "",
              "| student | held-out loss | KL(teacher‖student) | KL / full-KD KL | wall time (s, shared CPU) |",
              "|---|---:|---:|---:|---:|"]
    for name, row in r["final"].items():
        lines.append(f"| {name} | {row['val loss']:.4f} | {row['KL(teacher||student)']:.4f} | "
                     f"{row['KL / full-KD KL']:.3f} | {r['seconds'].get(name, float('nan')):.0f} |")
    met = {k: "met" if v else "NOT met" for k, v in r["goal"].items()}
    lines += ["", f"Goal: Gumbel-k KL within 5% of full KD: **{met['gumbel_within_5pct_of_full']}**; "
              f"Gumbel-k KL below top-k KL: **{met['gumbel_below_topk']}**.", "",
              "Held-out KL(teacher‖student) during training:", "",
              "| iteration | " + " | ".join(r["heldout_curves"]) + " |", "|---:|" + "---:|" * len(r["heldout_curves"])]
    names = list(r["heldout_curves"])
    for i, row in enumerate(r["heldout_curves"][names[0]]):
        vals = " | ".join(f"{r['heldout_curves'][n][i]['KL(teacher||student)']:.4f}" for n in names)
        lines.append(f"| {row['iteration']} | {vals} |")
    lines += ["", f"Bench wall time {r['total_seconds']:.0f} s (+ the teacher when it was not cached) on "
              f"{r['cpus']} CPUs shared with other jobs (torch {r['torch']}); stage times (s): {r['seconds']}.", ""]
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in r["heldout_curves"].items():
        a.plot([x["iteration"] for x in rows], [x["KL(teacher||student)"] for x in rows], marker="o", label=name)
    a.set_xlabel("student iteration")
    a.set_ylabel("held-out KL(teacher || student) [nats/token]")
    a.set_yscale("log")
    a.legend()
    a.grid(alpha=0.3)
    for name, rows in r["train_curves"].items():
        b.plot([x["iteration"] for x in rows], [x["lm loss"] for x in rows], label=name)
    b.axhline(r["teacher"]["val loss"], color="gray", ls="--", label="teacher (held-out)")
    b.set_xlabel("student iteration")
    b.set_ylabel("train lm loss (CE part)")
    b.legend()
    b.grid(alpha=0.3)
    c = r["config"]
    fig.suptitle(f"Distillation, V={c['vocab_size']}, k={c['k']}, alpha={c['alpha']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
